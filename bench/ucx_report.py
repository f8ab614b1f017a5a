"""UCX's own account of which transport carried a READ, from its log (pure text parsing; bench/kv_handoff.py).

``UCX_PROTO_INFO=used`` makes UCX write, when an agent's worker is destroyed, one table per (endpoint
configuration, operation, memory types) with the protocols it actually used and how often; ``UCX_LOG_LEVEL=info``
adds one line per endpoint configuration naming its lanes. Both go to ``UCX_LOG_FILE`` (``%p``: the pid).
"""

from __future__ import annotations

import re

_PREFIX = re.compile(r"^\[[^\]]*\]\s+\[[^\]]*\]\s*")


def read_protocols(text: str) -> dict[str, list[str]]:
    """``{agent: ["zero-copy cuda_ipc/cuda ×12", …]}`` from ``UCX_PROTO_INFO`` tables of remote-memory reads."""
    out: dict[str, list[str]] = {}
    title: list[str] = []
    columns: list[str] | None = None
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw).strip()
        if line.startswith("+"):
            continue
        if not line.startswith("|"):
            title, columns = [], None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 1:
            if columns is not None:
                title, columns = [], None
            title.append(cells[0])
        elif "Range" in cells and "Config" in cells:
            columns = cells
        elif columns is not None and len(cells) == len(columns) and len(title) >= 2:
            row = dict(zip(columns, cells))
            if "remote memory read" not in title[1] or row.get("Count", "1") in ("0", ""):
                continue
            agent = title[0].split()[0]
            count = f" ×{row['Count']}" if "Count" in row else ""
            out.setdefault(agent, []).append(f"{row['Description']} {row['Config']}{count}")
    return out


def read_lanes(text: str) -> dict[str, list[str]]:
    """``{agent: ["intra-node cfg#2 rma_am(tcp/lo) …"]}`` from the endpoint configurations UCX logs at info."""
    out: dict[str, list[str]] = {}
    for raw in text.splitlines():
        m = re.search(r"UCX\s+INFO\s+(\S+)\s+((?:intra|inter)-node cfg#\d+.*)$", raw)
        if m and "rma" in m.group(2):
            out.setdefault(m.group(1), [])
            if m.group(2) not in out[m.group(1)]:
                out[m.group(1)].append(m.group(2).strip())
    return out


