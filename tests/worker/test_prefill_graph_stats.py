"""A rank's prefill-graph counters reach /healthz (the rank snapshot) and /metrics as the rank reported them."""

from dwdp_worker.front.metrics import Metrics
from dwdp_worker.rank.prefill_graphs import GraphCounters
from dwdp_worker.rank.protocol import RankSpec, RankStats
from dwdp_worker.front.rank_handle import RankHandle


def _snapshot(gid: int, graphs: GraphCounters | None) -> dict:
    handle = RankHandle(RankSpec(model_dir="m", config={}, rank=gid, group=0, global_id=gid, store_host="127.0.0.1",
                                 store_port=1))
    handle.stats = RankStats(forwards=7, graphs=graphs)  # what the rank's last heartbeat carried
    return handle.snapshot(now=handle.last_msg)


def test_graph_counters_reach_the_snapshot_and_the_metrics_and_are_zero_without_graphs():
    counters = GraphCounters(captured=2, replayed=11, failed=1, eager=4)
    assert counters.as_dict() == {"graphs_captured": 2, "graphs_replayed": 11, "graphs_failed": 1, "graphs_eager": 4}
    ranks = [_snapshot(0, counters), _snapshot(1, None)]
    assert ranks[0]["prefill_graphs"] == {"captured": 2, "replayed": 11, "failed": 1, "eager": 4}
    assert ranks[1]["prefill_graphs"] is None
    text = Metrics(lambda: {"ranks": ranks}).render().decode()
    assert 'dwdp_prefill_graph_replays_total{rank="0"} 11.0' in text
    assert 'dwdp_prefill_graph_failures_total{rank="0"} 1.0' in text
    assert 'dwdp_prefill_graph_replays_total{rank="1"} 0.0' in text  # --cuda-graphs 0: no graphs, zero
