"""The support matrix's group runs many model types in turn, one store per run: one run going wrong on one rank
must cost that run only, never every later one (real ranks, real TCPStores, real checkpoints).

The trigger reproduced here is the one that put a whole matrix past its time budget: two adjacent runs on one
store port. Without the step barrier a rank joins the previous run's store while it shuts down, the ranks fall a
run apart, and every later run times out on one side (measured: 6 runs, 4 lost at 30 s each).
"""

from __future__ import annotations

from tests.runtime.group import run_group
from tests.worker.programs import matrix_program

BATCHES = [[[5, 17, 42, 3, 99, 7, 8]]]
#: short enough that a regression fails in seconds, long enough for a loaded 2-core machine
RENDEZVOUS_S = 15.0


def test_runs_sharing_a_store_port_all_serve_because_ranks_step_together(checkpoints):
    from dwdp_runtime.ports import free_port

    port = free_port()
    archs = ("qwen3_moe", "mixtral", "qwen3_moe")
    runs = [(f"{arch}-{i}", str(checkpoints[arch]), 5, 3) for i, arch in enumerate(archs)]
    res = run_group(matrix_program, 2, runs=runs, batches=BATCHES, ports={job: port for job, *_ in runs},
                    step_barrier=True, rendezvous_timeout_s=RENDEZVOUS_S, harness_timeout_s=180)
    for rank, (status, value) in sorted(res.items()):
        assert status == "ok", (rank, status, value)
        errors = {job: got["error"] for job, got in value.items() if "error" in got}
        assert not errors, (rank, errors)
        assert sorted(value) == sorted(job for job, *_ in runs)


def test_a_peer_that_never_comes_ends_the_program_with_every_run_named_not_started(tmp_path):
    import threading

    from tests.worker.oracle_group import one_torch_thread

    runs = [(f"run-{i}", str(tmp_path), 5, 3) for i in range(3)]
    with one_torch_thread():   # the program sets one torch thread, as in a rank; restored after
        out = matrix_program(0, 2, 0, runs=runs, batches=BATCHES, ports={}, step=threading.Barrier(2),
                             step_timeout_s=0.2)
    assert sorted(out) == ["run-0", "run-1", "run-2"]
    assert all(got["error"].startswith("not started: a peer rank did not finish the start within 0.2 s")
               for got in out.values()), out
