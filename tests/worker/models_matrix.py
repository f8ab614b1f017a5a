"""The support matrix: every model type the installed `transformers` offers with the experts interface, served
by DWDP on CPU at d = 2 and d = 3 and compared bitwise with the unsharded model, or refused with its reason.

One process set per d serves every model type in turn (import cost paid once per rank); 8 experts: d=2 with
overlapping ranges [0,5) [3,8), d=3 with 8 % 3 != 0 ([0,3) [3,6) [6,8)). The reference runs the same packed
forwards with plain ``from_pretrained`` in the test process, on one thread like the ranks.
"""

from __future__ import annotations

import enum
import pathlib
from dataclasses import dataclass

from tests.runtime.group import job_ports, run_group
from tests.worker.oracle_group import one_torch_thread
from tests.worker.programs import matrix_program

#: two forwards: one sequence, then a packed batch of three (1-, 37- and 1-token sequences)
BATCHES = [[[5, 17, 42, 3, 99, 7, 8]], [[1, 2, 3], list(range(10, 47)), [200]]]
#: d -> (experts per rank k, stride s) over 8 experts
SHARDING = {2: (5, 3), 3: (3, 3)}
#: the model types the issue names: each must serve wherever transformers builds it tiny
NAMED = ("deepseek_v4", "deepseek_v32", "qwen3_5_moe", "qwen3_next", "glm4_moe", "glm5_next", "gpt_oss",
         "mistral_large4", "minimax_m2", "kimi_linear", "ernie4_5_moe", "hunyuan_v1_moe")
#: one d's group over every model type: ~20 s here (2 cores); two of them, the checkpoints and the references stay
#: inside pytest's 300 s, so a stuck rank fails rows that name it instead of the whole fixture
GROUP_TIMEOUT_S = 120.0
#: markers around the generated table in docs/MODELS.md
BEGIN, END = "<!-- models-matrix:begin -->", "<!-- models-matrix:end -->"


class Status(str, enum.Enum):
    SERVES = "serves"     # bitwise equal to the unsharded model at d=2 and d=3
    REFUSED = "refused"   # DWDP or transformers says why (the reason)
    FAILS = "fails"       # DWDP built it but differs or crashed: a bug


@dataclass(frozen=True)
class Row:
    model_type: str
    status: Status
    detail: str = ""      # SERVES: the experts layout; otherwise the reason


def _reference(path, batches):
    from dwdp_worker.launch.oracle import Reference

    with one_torch_thread():
        ref = Reference(path)
        return [ref.logits(b) for b in batches]


def _precheck(path) -> None:
    """The loader's refusals, in this process: layout discovery and checkpoint sources (no group needed)."""
    import torch

    from dwdp_worker.model import registry as models
    from dwdp_worker.checkpoint.names import CheckpointMap, resolve_sources
    from dwdp_worker.checkpoint.loader import build_meta_model, load_config
    from dwdp_worker.checkpoint.safetensors_index import SafetensorsIndex

    config = load_config(path)
    model = build_meta_model(config, torch.float32)
    layout = models.model_layout(model)
    with SafetensorsIndex(path) as ckpt:
        resolve_sources(layout, CheckpointMap.build(model, ckpt.entries), ckpt.shape)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}"


def build_matrix(base: pathlib.Path, model_types) -> list[Row]:
    import torch

    from dwdp_worker.model.architectures import probe
    from dwdp_worker.checkpoint.synth import write_synthetic

    rows: dict[str, Row] = {}
    candidates: dict[str, tuple[str, list, str]] = {}
    for model_type in model_types:
        p = probe(model_type)
        if not p.ok:
            rows[model_type] = Row(model_type, Status.REFUSED, p.reason)
            continue
        path = base / model_type
        try:
            write_synthetic(model_type, path, seed=1)
        except Exception as exc:  # noqa: BLE001
            rows[model_type] = Row(model_type, Status.REFUSED, f"save_pretrained fails: {_one_line(exc)}")
            continue
        try:
            want = _reference(path, BATCHES)
        except Exception as exc:  # noqa: BLE001
            rows[model_type] = Row(model_type, Status.REFUSED, f"the unsharded model fails on CPU: {_one_line(exc)}")
            continue
        try:
            _precheck(path)
        except Exception as exc:  # noqa: BLE001 - UnsupportedModelError / CheckpointError: the refusal itself
            rows[model_type] = Row(model_type, Status.REFUSED, _one_line(exc))
            continue
        from dwdp_worker.rank.engine import num_experts_of

        if num_experts_of(path) != 8:  # config.json's stated count (the supervisor's) must be the discovered one
            rows[model_type] = Row(model_type, Status.FAILS, f"config.json states {num_experts_of(path)} experts")
            continue
        layout = f"{p.auto_class.removeprefix('AutoModelFor')}; experts in layers {list(p.layers)}"
        candidates[model_type] = (str(path), want, layout + (f"; {p.flags}" if p.flags else ""))
    results = {}
    for d, (k, s) in SHARDING.items():
        runs = [(f"{t}-d{d}", path, k, s) for t, (path, _, _) in candidates.items()]
        if not runs:
            continue
        res = run_group(matrix_program, d, runs=runs, batches=BATCHES, ports=job_ports(r[0] for r in runs),
                        step_barrier=True, harness_timeout_s=GROUP_TIMEOUT_S)
        results[d] = res
    from dwdp_runtime.layout import peer_ranges

    for t, (_, want, layout) in candidates.items():
        problem = None
        for d, res in results.items():
            k, s = SHARDING[d]
            ranges = peer_ranges(dwdp_size=d, num_experts=8, num_experts_per_worker=k, num_prefetch_experts=s)
            for rank, (status, value) in sorted(res.items()):
                got = value.get(f"{t}-d{d}") if status == "ok" else None
                if got is None:
                    problem = problem or f"d={d} rank {rank}: the rank ended ({status}: {str(value)[:200]})"
                elif "error" in got:
                    problem = problem or f"d={d} rank {rank}: {got['error']}"
                elif tuple(got["local"]) != ranges[rank] or got["stats"].prefetch_bytes <= 0:
                    problem = problem or f"d={d} rank {rank}: local range {got['local']} / no remote experts pulled"
                else:
                    for i, (g, w) in enumerate(zip(got["logits"], want)):
                        g = torch.from_numpy(g)
                        if not torch.equal(g, w):
                            problem = problem or (f"d={d} rank {rank} forward {i}: max |diff| "
                                                  f"{(g - w).abs().max().item():.3g}")
        rows[t] = Row(t, Status.FAILS, problem) if problem else Row(t, Status.SERVES, layout)
    return [rows[t] for t in sorted(rows)]


def render(rows: list[Row], transformers_version: str) -> str:
    serves = sum(r.status is Status.SERVES for r in rows)
    lines = [BEGIN,
             f"Generated by `tests/worker/test_models_matrix.py` with transformers {transformers_version}: "
             f"**{serves} of {len(rows)}** model types serve bitwise (CPU, d = 2 and 3).",
             "", "| model_type | status | layout / reason |", "|---|---|---|"]
    for r in rows:
        detail = r.detail.replace("|", "\\|")
        lines.append(f"| `{r.model_type}` | {r.status.value} | {detail} |")
    lines.append(END)
    return "\n".join(lines)
