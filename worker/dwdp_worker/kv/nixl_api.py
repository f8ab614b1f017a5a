"""The NIXL adapter's one import point (lazy: every module imports without NIXL installed).

``nixl`` on PyPI is a meta package that picks ``nixl_cu12``/``nixl_cu13`` by the CUDA it finds (either
works on CPU); the ``kv`` extra installs ``nixl-cu13`` alone (CUDA 13 drivers, as on our H200s; half the
download), so without the meta package the backend module is imported directly. Only one of them may
ever be imported in a process (their bindings register the same C++ types). ``new_agent`` creates an agent with the UCX backend and **no progress thread**: NIXL's
progress thread spins (measured here: ~0.5 core per idle agent, on a 2-core CI machine that is a
quarter of it per rank); every agent in this project is progressed by the thread that polls it
(notifications on the prefill side, transfer state on the decode side) instead, and UCX's shared
memory and RDMA transports move a READ without the target's CPU.

``UCX_CUDA_DEFAULTS`` are UCX settings ``new_agent`` puts into the environment before the process's first
agent (UCX reads them when NIXL creates its UCX context), each only where the user has not set it, and only
where a CUDA device is visible (elsewhere UCX's cuda module is absent and warns of an unused variable):

  * ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on``: UCX's ``auto`` turns cuda_ipc GET (our READ) off on a GPU whose
    NVLinks NVML does not report active ("cuda-ipc get zcopy disabled as no nvlinks detected", openucx/ucx
    #7566: concurrent reads over PCIe were slower than writes), and the READ then runs as software
    emulation over TCP loopback: 0.4–0.5 GB/s measured on a single-GPU H200 VM (issue #36; vLLM #52607
    saw the same, 0.5 GB/s READ against 49 GB/s WRITE). A same-node copy by the copy engine is faster
    than TCP on any PCIe or NVLink system; NIXL's own UCX plugin turns it on from a later release
    (ai-dynamo/nixl #2208). Set ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto`` to get UCX's heuristic back.
"""

from __future__ import annotations

import base64
from typing import Any


class NixlUnavailableError(RuntimeError):
    """NIXL (``pip install nixl``, the ``kv`` extra) is not installed or failed to load."""


#: import names of NIXL's Python API, in preference order (the meta package first: it picks by CUDA)
NIXL_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


def nixl_installed() -> bool:
    """Whether one of ``NIXL_MODULES``' packages is installed, found without importing it (an import here
    would bind NIXL's C++ types before ``load_nixl`` picks the module)."""
    import importlib.util

    return any(importlib.util.find_spec(name.partition(".")[0]) is not None for name in NIXL_MODULES)


def load_nixl() -> Any:
    import importlib
    import logging
    import os

    errors = []
    for name in NIXL_MODULES:
        try:
            api = importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)  # one INFO line per agent otherwise
        return api
    raise NixlUnavailableError("KV transfer needs NIXL: pip install 'dwdp-k8s[kv]' (or `pip install nixl`); "
                               + "; ".join(errors))


#: UCX settings every agent of this project gets on a CUDA machine unless the environment sets them (see the
#: module docstring)
UCX_CUDA_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "on"}


def _cuda_visible() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no torch, or a broken CUDA install: no CUDA settings
        return False


def apply_ucx_defaults(environ=None, *, cuda: bool | None = None) -> dict[str, str]:
    """Put ``UCX_CUDA_DEFAULTS`` into ``environ`` (``os.environ``) where unset, on a CUDA machine; the UCX
    settings now in force."""
    import os

    environ = os.environ if environ is None else environ
    if _cuda_visible() if cuda is None else cuda:
        for key, value in UCX_CUDA_DEFAULTS.items():
            environ.setdefault(key, value)
    return {k: v for k, v in environ.items() if k.startswith("UCX_")}


def new_agent(name: str):
    apply_ucx_defaults()
    api = load_nixl()
    config = api.nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"],
                                   sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    agent = api.nixl_agent(name, config)
    if "UCX" not in agent.backends:
        raise NixlUnavailableError(f"NIXL has no UCX backend here (plugins: {agent.plugin_list})")
    return agent


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"), validate=True)
