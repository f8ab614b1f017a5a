"""Host side of ``programs.oracle_program``: run it on a real local group and hand back every rank's results."""

from __future__ import annotations

import contextlib

from tests.runtime.group import job_ports, run_group
from tests.worker.programs import oracle_program


def run_oracle_group(world: int, runs, batches, *, harness_timeout_s: float = 240.0, **kw) -> dict[int, dict]:
    """Serve each ``(job, model_dir, k, s, dtype)`` of ``runs`` on a ``world``-rank group (one store port per
    job), forward ``batches`` through it, assert that every rank finished, and return ``rank → {job: result}``."""
    res = run_group(oracle_program, world, runs=runs, batches=batches, ports=job_ports(r[0] for r in runs),
                    harness_timeout_s=harness_timeout_s, **kw)
    bad = {r: v for r, (st, v) in res.items() if st != "ok"}
    assert not bad, bad
    return {rank: value for rank, (_, value) in sorted(res.items())}


@contextlib.contextmanager
def one_torch_thread():
    """Compute references with one torch thread (restored after): the rank processes run one each, and CPU
    reductions then match theirs; the test process must not take both cores from the ranks either."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def assert_ranks_equal_references(res: dict[int, dict], names, d: int, references, ranges) -> None:
    """Every rank of ``run_oracle_group``'s result ran job ``<name>-d<d>`` on its own expert range and gave each
    batch the logits of ``references[name]`` (tensors) bitwise."""
    import numpy as np

    for name in names:
        for rank, value in res.items():
            got = value[f"{name}-d{d}"]
            assert tuple(got["local"]) == ranges[rank]
            for b, (g, want) in enumerate(zip(got["logits"], references[name])):
                assert np.array_equal(g, want.numpy()), (name, rank, b, float(np.abs(g - want.numpy()).max()))
