"""The front: the pod's (or local group's) HTTP process — OpenAI routes, admission, dispatch, probes, metrics.

It owns the port and talks to its rank processes only through ``rank.protocol`` messages
(``rank_handle``); it never imports the model or the runtime. README.md beside this file.
"""
