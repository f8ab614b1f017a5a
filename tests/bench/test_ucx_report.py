"""bench/ucx_report.py reads UCX's protocol tables and endpoint lines as UCX writes them (formats copied from a
UCX 1.23 log of bench/kv_handoff.py on CPU, and the emulation row from the GPU fallback of issue #36)."""

from __future__ import annotations

from bench.ucx_report import read_lanes, read_protocols

LOG = """\
[1796307877.974909] [vm:14096:0]   +-------+------------+--------------------+------------+
[1796307877.974909] [vm:14096:0]   | dwdp-decode-ee3a intra-node cfg#1                    |
[1796307877.974909] [vm:14096:0]   | active message by ucp_am_send*(egr) from host memory |
[1796307877.974909] [vm:14096:0]   +-------+------------+--------------------+------------+
[1796307877.974909] [vm:14096:0]   | Count |   Range    |    Description     |   Config   |
[1796307877.974909] [vm:14096:0]   +-------+------------+--------------------+------------+
[1796307877.974909] [vm:14096:0]   |     2 |   1..16515 | zero-copy          | tcp/lo     |
[1796307877.974909] [vm:14096:0]   +-------+------------+--------------------+------------+
[1796307877.974942] [vm:14096:0]   +-------+--------+-------------+-----------------------------------+
[1796307877.974942] [vm:14096:0]   | dwdp-decode-ee3a intra-node cfg#1                                |
[1796307877.974942] [vm:14096:0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda   |
[1796307877.974942] [vm:14096:0]   +-------+--------+-------------+-----------------------------------+
[1796307877.974942] [vm:14096:0]   | Count | Range  | Description |              Config               |
[1796307877.974942] [vm:14096:0]   +-------+--------+-------------+-----------------------------------+
[1796307877.974942] [vm:14096:0]   |     0 | 0..8K  | zero-copy   | cuda_ipc/cuda                     |
[1796307877.974942] [vm:14096:0]   |     6 | 8K..inf | software emulation | tcp/lo                   |
[1796307877.974942] [vm:14096:0]   +-------+--------+-------------+-----------------------------------+
[1796307877.97] [vm:14096:0]   ucp_worker.c:1912 UCX  INFO  dwdp-raw-1a2b intra-node cfg#2 rma_am(tcp/lo)  am(tcp/lo cuda_ipc/cuda)  ka(tcp/lo)
[1796307877.97] [vm:14096:0]   ucp_worker.c:1912 UCX  INFO  dwdp-raw-1a2b intra-node cfg#2 rma_am(tcp/lo)  am(tcp/lo cuda_ipc/cuda)  ka(tcp/lo)
"""


def test_only_used_read_rows_per_agent():
    assert read_protocols(LOG) == {"dwdp-decode-ee3a": ["software emulation tcp/lo ×6"]}


def test_endpoint_lanes_once_per_configuration():
    assert read_lanes(LOG) == {"dwdp-raw-1a2b": ["intra-node cfg#2 rma_am(tcp/lo)  am(tcp/lo cuda_ipc/cuda)  ka(tcp/lo)"]}
