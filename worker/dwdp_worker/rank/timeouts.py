"""Every time bound of the worker front, with its reason (one place; the CLI defaults read these).

Detection and exit bounds that follow from them (measured figures in RELIABILITY.md):
  * a rank process that freezes (SIGSTOP, a hung host) or dies: its front sees no heartbeat for
    ``HEARTBEAT_TIMEOUT_S`` (busy or idle: the rank's heartbeat thread beats through forwards), kills
    it and fails: detection ≤ ``HEARTBEAT_TIMEOUT_S + WATCHDOG_TICK_S``; exit ≤ that + ``FAILED_DRAIN_S``
    + ``SERVER_STOP_S`` (the ranks are killed at once, not stopped);
  * a peer rank in another pod, or the group's store host, frozen or dead: the peer monitor (whose
    checks never wait on the store) declares it lost after ``PEER_DEAD_AFTER_S`` and the rank reports
    it at once: detection ≤ ``PEER_DEAD_AFTER_S + 2 × PEER_HEARTBEAT_S`` (``dwdp_runtime.monitor``).
"""

from __future__ import annotations

# -- rendezvous (forming a group) -------------------------------------------------------------------
#: local launcher: every rank of a group is a process on this machine, started together; 120 s covers
#: spawning G×D processes and importing torch on a loaded 2-core machine.
RENDEZVOUS_LOCAL_S = 120.0
#: pod entrypoint: the pods of a group are scheduled, pull the image and start independently; a cold pull
#: of a CUDA image (~10 GB) onto a freshly provisioned node takes minutes.
RENDEZVOUS_POD_S = 600.0

# -- a rank's liveness ---------------------------------------------------------------------------------
#: a rank's heartbeat thread period: cheap (one small pickle), and 20 beats per liveness window.
RANK_HEARTBEAT_S = 0.5
#: ``--heartbeat-timeout-s``: a ready rank silent this long is frozen or dead (its beats come from a thread
#: that runs through forwards, so a long forward is not silence): the front kills it and fails.
HEARTBEAT_TIMEOUT_S = 10.0
#: ``--forward-timeout-s``: one packed forward (≤ max-num-tokens) takes seconds on the largest model; a
#: forward running longer is a hung kernel or copy: the rank is killed.
FORWARD_TIMEOUT_S = 300.0
#: how often the front's watchdog compares heartbeat ages and forward times with their limits.
WATCHDOG_TICK_S = 0.25

# -- peers of the group (through the group's store; dwdp_runtime.monitor) -------------------------------
#: one store heartbeat per second per rank: a handful of tiny TCPStore ops, off the forward path.
PEER_HEARTBEAT_S = 1.0
#: ten missed beats: a network hiccup between pods does not restart a group, a dead peer does.
PEER_DEAD_AFTER_S = 10.0
#: an elastic group (expert replicas r >= 2) survives a loss instead of restarting, so it may judge sooner:
#: two beats a second, silence after 3 s — detection within 3 + 2 × 0.5 = 4 s (issue #30's bound: 5 s). A
#: false verdict costs one healthy rank (fenced, re-run by its front), not the group.
ELASTIC_PEER_HEARTBEAT_S = 0.5
ELASTIC_PEER_DEAD_AFTER_S = 3.0

#: a replacement of a lost rank (issue #30), loaded and warm, asked to join: a member admits it within one agent
#: round (0.5 s) once its beats are seen moving; far longer means no member is serving, and the replacement gives up.
JOIN_ADMISSION_S = 60.0
#: ``--max-rank-respawns``: an elastic group's front restarts a lost rank's process in place (a replacement that
#: rejoins) at most this many times per DWDP rank: a rank that keeps dying (a bad GPU, a poison input) must not loop;
#: past it the group serves degraded and the pod's restart policy or the operator takes over.
MAX_RANK_RESPAWNS = 3
# -- stopping ---------------------------------------------------------------------------------------
#: ``--drain-timeout-s`` (SIGTERM): admitted requests finish; inside the pod's terminationGracePeriod.
DRAIN_TIMEOUT_S = 60.0
#: after a failure the group is broken: requests on healthy ranks get one more step (a forward, ≤ seconds)
#: to finish, then 503 — the front does not wait out the drain for a rank that will never answer.
FAILED_DRAIN_S = 5.0
#: a step that decodes with the KV cache (max_tokens > 1) stops decoding after this long and the request
#: goes back to the queue for the rest: a step stays about one prefill long, well inside FAILED_DRAIN_S
#: and the forward watchdog, however slow each decode forward is (kv, docs/KV_TRANSFER.md)
DECODE_STEP_BUDGET_S = 1.0
#: ranks leaving in order: the release barrier with the group's live peers (importers unmap first).
STOP_TIMEOUT_S = 20.0
#: a process that closed its pipe or was SIGKILLed is gone within milliseconds; this bounds its reaping on a
#: loaded node (after a failure the front kills its ranks at once: a release barrier would wait for the dead).
REAP_S = 5.0
#: shutdown: stop listening, then this long for requests already on accepted connections to arrive.
LISTEN_CLOSE_GRACE_S = 0.5
#: uvicorn's graceful shutdown, after the drain answered every admitted request: only responses being
#: written remain.
HTTP_GRACEFUL_SHUTDOWN_S = 5.0
#: the bound on the whole HTTP server stop (graceful shutdown + closing connections).
SERVER_STOP_S = 10.0

# -- HTTP connections ---------------------------------------------------------------------------------
#: a request's headers must arrive within this after the connection opens or the previous response ends
#: (a slowloris or a silent connection is closed; cluster clients send headers in one packet).
HTTP_HEADER_TIMEOUT_S = 10.0
#: idle keep-alive between requests (uvicorn's default).
HTTP_KEEP_ALIVE_S = 5.0
#: the whole request body must arrive within this (4 MiB at ≥ 1 Mbit/s); a never-finished upload is a 408.
HTTP_BODY_TIMEOUT_S = 30.0

# -- Retry-After (seconds) -------------------------------------------------------------------------------
#: 429: the queue drains in about one forward.
RETRY_AFTER_QUEUE_FULL_S = 1
#: 503 while loading: ranks load for tens of seconds.
RETRY_AFTER_NOT_READY_S = 5
#: 503 draining / failed: retry at once, on another replica behind the Service.
RETRY_AFTER_STOPPING_S = 1
