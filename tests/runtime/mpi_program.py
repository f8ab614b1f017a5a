"""Run under ``mpirun -n N python -m tests.runtime.mpi_program D``: MPI groups of D ranks build
composites through MpiRendezvous and check them bitwise (prints one line per rank)."""

import sys

import torch

from dwdp_runtime.config import DwdpConfig
from dwdp_runtime.manager import DwdpManager
from dwdp_runtime.rendezvous import MpiRendezvous

from .workloads import reference


def main() -> int:
    d = int(sys.argv[1])
    rdzv = MpiRendezvous(dwdp_size=d)
    cfg = DwdpConfig.even(dwdp_size=d, num_experts=11)
    shapes = {"w": (30, 25)}
    refs = {(l, n): reference(l, n, 11, shp, torch.float32) for l in range(3) for n, shp in shapes.items()}
    with rdzv, DwdpManager.create(config=cfg, rank=rdzv.rank, rendezvous=rdzv, backend="host",
                                  page_multiplier=1) as mgr:
        a, b = mgr.local_range
        for l in range(3):
            mgr.add_layer(l)
            mgr.add_expert_weight(l, "w", expert_shape=shapes["w"], dtype=torch.float32, fill=refs[(l, "w")][a:b])
        mgr.setup()
        ok = 0
        for _ in range(2):
            mgr.start_forward()
            for l in range(3):
                ok += torch.equal(mgr.wait_and_bind(l)["w"], refs[(l, "w")])
                mgr.finish_layer(l)
    print(f"group={rdzv.group} rank={rdzv.rank} ok={ok}/6", flush=True)
    return 0 if ok == 6 else 1


if __name__ == "__main__":
    sys.exit(main())
