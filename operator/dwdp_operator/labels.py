"""Label and annotation keys on the operator's children (one place, so selectors never drift)."""

PREFIX = "dwdp.io"
NAME = f"{PREFIX}/name"              # the DwdpGroup name
GROUP = f"{PREFIX}/group"            # group index g
POD_INDEX = f"{PREFIX}/pod-index"    # pod index i inside the group
ATTEMPT = f"{PREFIX}/attempt"        # group attempt; bumps on every group restart or rollout
TEMPLATE_HASH = f"{PREFIX}/template-hash"
GANG = f"{PREFIX}/gang"              # "pending" until every pod of the attempt exists, then "complete"
SERVING = f"{PREFIX}/serving"        # "true" = behind the client Service; "false" while draining
MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "dwdp-operator"
COMPONENT = "app.kubernetes.io/component"
GANG_GATE = f"{PREFIX}/gang"         # scheduling gate name, lifted once the gang is complete


def selector(name: str) -> str:
    """Label selector of every worker pod of DwdpGroup ``name`` (status.selector, scale subresource)."""
    return f"{NAME}={name}"
