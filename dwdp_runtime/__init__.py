"""dwdp_runtime: the DWDP library (no Kubernetes, no HTTP).

Importing this package never imports torch or CUDA: the operator image uses ``config`` and the
planner without them. Submodules that need torch import it themselves; GPU code imports lazily.
"""

__version__ = "0.1.0"
