"""Label and annotation keys on the operator's children (defined in ``dwdp_runtime.contract``)."""

from dwdp_runtime.contract import GANG_GATE, LABEL_PREFIX as PREFIX, Label

NAME = Label.NAME
GROUP = Label.GROUP
POD_INDEX = Label.POD_INDEX
ATTEMPT = Label.ATTEMPT
TEMPLATE_HASH = Label.TEMPLATE_HASH
GANG = Label.GANG
SERVING = Label.SERVING
MANAGED_BY = Label.MANAGED_BY
COMPONENT = Label.COMPONENT
LLMD_ROLE = Label.LLMD_ROLE
MANAGER = "dwdp-operator"
WORKER_COMPONENT = "worker"  # the COMPONENT label of worker pods, and only of them
__all__ = ["PREFIX", "NAME", "GROUP", "POD_INDEX", "ATTEMPT", "TEMPLATE_HASH", "GANG", "SERVING", "MANAGED_BY",
           "MANAGER", "WORKER_COMPONENT", "COMPONENT", "LLMD_ROLE", "GANG_GATE", "selector"]


def selector(name: str) -> str:
    """Label selector of every worker pod of DwdpGroup ``name`` (status.selector, scale subresource)."""
    return f"{NAME}={name}"
