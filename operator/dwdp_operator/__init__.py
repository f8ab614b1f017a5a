"""dwdp_operator: the kopf operator for DwdpGroup resources.

Importing the package registers every ``validate_spec`` rule: ``spec`` holds the rules of the
spec itself, ``sizing`` adds the planner's memory fit, ``autoscale`` the ``spec.autoscaling`` rules and
``degrade`` failurePolicy Degrade's pod-loss rule
(``@register_check``; ``spec`` imports none of them, so there is no import circle).
"""

from . import autoscale as _autoscale  # noqa: F401 — registers the autoscaling rules
from . import sizing as _sizing  # noqa: F401 — registers the memory-fit check
from . import degrade as _degrade  # noqa: F401 — registers failurePolicy Degrade's pod-loss rule
