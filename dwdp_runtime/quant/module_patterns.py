"""Module names as compressed-tensors matches them: a config's ``targets`` / ``ignore`` entries.

An entry is either ``"re:<pattern>"`` — a Python regular expression that must match **from the start** of the
module name (``re.match``, not ``re.search``: ``"re:.*mlp.gate$"`` is how llm-compressor writes "every
router") — or a plain string, which compressed-tensors compares with the module's full name **or** with the
name of its class (``"Linear"``). A checkpoint key carries only the module name, so a plain entry here matches
a name exactly; class-name entries (``Linear``, ``Embedding``) are kept, never matched against names.

Invariant: ``ModulePatterns.parse`` compiles every regular expression once (a bad pattern is a refusal
at config time, not an error in the middle of a load); ``matches`` says which entry matched, so a message can
quote it. Pure: no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .refusal import refuse

#: compressed-tensors' marker of a regular-expression entry (``compressed_tensors.utils.match.match_name``)
REGEX_PREFIX = "re:"


@dataclass(frozen=True)
class ModulePatterns:
    """Parsed ``targets`` / ``ignore`` entries: exact names and compiled ``re:`` patterns, in config order."""

    entries: tuple[str, ...] = ()
    _regexes: tuple[tuple[str, re.Pattern], ...] = field(default=(), compare=False, repr=False)

    @classmethod
    def parse(cls, raw, what: str) -> "ModulePatterns":
        """``raw`` (a list of strings, or None) → patterns; anything else is refused, naming ``what``."""
        if raw is None:
            return cls()
        if isinstance(raw, str) or not all(isinstance(x, str) for x in raw):
            raise refuse(f"{what} {raw!r} must be a list of module names or 're:' patterns")
        regexes = []
        for entry in raw:
            if entry.startswith(REGEX_PREFIX):
                try:
                    regexes.append((entry, re.compile(entry.removeprefix(REGEX_PREFIX))))
                except re.error as exc:
                    raise refuse(f"{what} entry {entry!r} is not a regular expression ({exc})") from None
        return cls(tuple(raw), tuple(regexes))

    def matches(self, module: str) -> str | None:
        """The first entry that matches module name ``module`` (exactly, or an ``re:`` pattern from its start)."""
        regexes = dict(self._regexes)
        for entry in self.entries:
            regex = regexes.get(entry)
            if (regex.match(module) if regex is not None else entry == module):
                return entry
        return None
