"""What the members of an elastic group publish in its store, and what a replacement must match to join.

Store entries (sealed with the group token, under the group attempt's keys; ``rendezvous.GroupKeys``):

  ``member/<rank>``   ``MemberRecord``: the incarnation serving the rank and where its exported expert memory is
                      fetched (the ``fdpass`` server's name for POSIX-fd handles, the handle bytes for fabric ones);
                      written at formation, by a replacement before it asks to join, and again after a failover
                      (a promoted standby store starts empty);
  ``join/<rank>``     ``JoinRequest``: a replacement of a lost rank has loaded its share and exported it;
  ``fingerprint``     ``GroupFingerprint``: what the group serves (claimed at formation by every rank, the first
                      claim wins); a replacement that loaded anything else is refused by name, before it asks.

Pure: encoding only, no store I/O.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass, field


def member_key(rank: int) -> str:
    return f"member/{rank}"


def join_key(rank: int) -> str:
    return f"join/{rank}"


FINGERPRINT_KEY = "fingerprint"


@dataclass(frozen=True)
class MemberRecord:
    rank: int
    incarnation: str
    fd_server: str | None = None   # fd transport: the abstract Unix socket serving this rank's exported fds
    handles: bytes = b""           # bytes transport (fabric): every exported handle, concatenated
    handle_width: int = 0          # bytes of one handle in ``handles``

    def encode(self) -> bytes:
        return json.dumps({"rank": self.rank, "incarnation": self.incarnation, "fd_server": self.fd_server,
                           "handles": base64.b64encode(self.handles).decode(), "width": self.handle_width}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "MemberRecord":
        d = json.loads(raw)
        return cls(int(d["rank"]), str(d["incarnation"]), d.get("fd_server"), base64.b64decode(d.get("handles", "")),
                   int(d.get("width", 0)))

    def handle_list(self) -> list[bytes]:
        w = self.handle_width
        return [self.handles[i:i + w] for i in range(0, len(self.handles), w)] if w else []


@dataclass(frozen=True)
class JoinRequest:
    incarnation: str

    def encode(self) -> bytes:
        return json.dumps({"incarnation": self.incarnation}).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "JoinRequest":
        return cls(str(json.loads(raw)["incarnation"]))


@dataclass(frozen=True)
class GroupFingerprint:
    """Named digests of what a rank serves: the layout (sharding, replicas), the weights' names, shapes and dtypes
    (``weights``), and the checkpoint's identity (``checkpoint``, the worker's digest of its files) — so a refusal
    says which differs."""

    parts: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    @classmethod
    def of(cls, **parts: object) -> "GroupFingerprint":
        return cls(tuple(sorted((k, _digest(v)) for k, v in parts.items() if v is not None)))

    def differences(self, other: "GroupFingerprint") -> list[str]:
        """The parts whose digests differ (or that one side lacks), by name."""
        mine, theirs = dict(self.parts), dict(other.parts)
        return sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))

    def encode(self) -> bytes:
        return json.dumps(dict(self.parts), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> "GroupFingerprint":
        return cls(tuple(sorted(json.loads(raw).items())))


def _digest(value: object) -> str:
    raw = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]
