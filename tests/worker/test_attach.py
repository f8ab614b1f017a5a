"""``model.attach``: every change DWDP makes to a model, and a ``close()`` that leaves it bitwise its old self.

Real tiny `transformers` models from synthetic checkpoints; the group tests run two real ranks of one group
(a real TCPStore, the host backend's memfd handles) as two threads of this one process, so two engines and
their attachments share one interpreter, its `transformers` modules and their globals.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib

import pytest
import torch

from dwdp_worker.launch.oracle import Reference
from dwdp_worker.model import experts_impl, layers_impl
from dwdp_worker.model.attach import attach

PROMPTS = [[5, 17, 42, 8, 99, 3], [7, 7, 1, 250, 64, 2, 2, 31, 12]]


@pytest.fixture(autouse=True)
def cpu_engine_path(monkeypatch):
    """What a CPU engine runs: no Triton interpreter (tests/kernels' conftest turns it on for the whole session;
    under it the kernels would run here, and its state is not safe for two ranks as threads of one process)."""
    _define_kernels_first()
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _define_kernels_first() -> None:
    """Import every kernel module under the session's own TRITON_INTERPRET before it is turned off here:
    ``triton.jit`` picks interpreter or driver when a kernel is defined, so a kernel first defined inside this
    fixture would stay driver-bound for the rest of the session, and a later interpreter test of it fails
    ("0 active drivers")."""
    import importlib
    import pkgutil

    import dwdp_runtime.kernels as kernels

    for mod in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"{kernels.__name__}.{mod.name}")


def snapshot(model, local: tuple[int, int] | None = None) -> dict:
    """Everything ``attach`` may touch, as values and object identities. ``local``: the rank's own experts
    ``[a, b)``; a sharded parameter's other rows are the page pool's slots (staging the prefetch refills),
    not the model's bytes, so only the local rows are compared."""
    from transformers import PreTrainedModel

    from dwdp_worker.model.registry import experts_sites

    sharded = {f"{site.name}.{p.name}" for site in experts_sites(model, getattr(model, "dwdp_layout", None))
               for p in site.layout.params} if local else set()

    def value(name, p):
        if p.device.type == "meta":
            return None
        return (p[local[0]:local[1]] if name in sharded else p).detach().clone()

    rope = {}
    for name in layers_impl.ROPE_MODULES:
        mod = importlib.import_module(name)
        rope[name] = mod.apply_rotary_pos_emb
    return {
        "modules": [(name, type(m), sorted(m.__dict__), len(m._forward_hooks), len(m._forward_pre_hooks))
                    for name, m in model.named_modules()],
        "params": [(name, id(p), p.data_ptr() if p.device.type != "meta" else None, value(name, p))
                   for name, p in model.named_parameters()],
        "experts_impl": [str(m.config._experts_implementation) for m in model.modules() if isinstance(m, PreTrainedModel)],
        "rope": rope,
    }


def assert_same(a: dict, b: dict) -> None:
    assert a["modules"] == b["modules"]
    assert a["experts_impl"] == b["experts_impl"]
    assert a["rope"] == b["rope"]
    assert len(a["params"]) == len(b["params"])
    for (n1, i1, ptr1, t1), (n2, i2, ptr2, t2) in zip(a["params"], b["params"]):
        assert (n1, i1, ptr1) == (n2, i2, ptr2), n1
        assert (t1 is None and t2 is None) or torch.equal(t1, t2), n1


def test_close_leaves_the_model_bitwise_its_old_self(checkpoints):
    ref = Reference(checkpoints["qwen3_moe"])
    before, want = snapshot(ref.model), ref.logits(PROMPTS)
    att = attach(ref.model, device="cpu", experts="dwdp", fused_layers=True)
    during = snapshot(ref.model)
    # it did change the model: the implementation, the kernels' layouts, the norms' forwards, the RoPE global
    assert during["experts_impl"] != before["experts_impl"] and att.experts == experts_impl.IMPL_NAME
    assert during["modules"] != before["modules"]
    assert any(getattr(f, "_dwdp_fused", False) for f in during["rope"].values())
    assert att.fused is not None and att.fused.norms > 0
    # on CPU without Triton's interpreter both kernels fall back: the same numbers
    assert torch.equal(ref.logits(PROMPTS), want)
    att.close()
    att.close()  # idempotent
    assert_same(snapshot(ref.model), before)
    assert torch.equal(ref.logits(PROMPTS), want)


def test_two_attachments_share_the_process_wide_rope_patch(checkpoints):
    """The RoPE global is one per modeling module: it stays patched while any attached model uses it."""
    a, b = Reference(checkpoints["qwen3_moe"]), Reference(checkpoints["qwen3_moe"])
    mod = importlib.import_module("transformers.models.qwen3_moe.modeling_qwen3_moe")
    original = mod.apply_rotary_pos_emb
    att_a = attach(a.model, device="cpu", experts="dwdp", fused_layers=True)
    att_b = attach(b.model, device="cpu", experts="dwdp", fused_layers=True)
    att_a.close()
    assert getattr(mod.apply_rotary_pos_emb, "_dwdp_fused", False), "b still runs on the dispatcher"
    assert b.model.config._experts_implementation == experts_impl.IMPL_NAME
    assert a.model.config._experts_implementation != experts_impl.IMPL_NAME
    att_b.close()
    assert mod.apply_rotary_pos_emb is original


def test_a_failed_attach_undoes_what_it_did(checkpoints):
    ref = Reference(checkpoints["qwen3_moe"])
    before = snapshot(ref.model)
    with pytest.raises(ValueError, match="not one of"):
        attach(ref.model, device="cpu", experts="fastest")
    assert_same(snapshot(ref.model), before)


def _two_ranks(fn, **kw):
    """``fn(rank, rendezvous, **kw)`` for the two ranks of one group, as two threads of this process."""
    from tests.runtime.group import free_port
    from tests.worker.programs import _rdzv

    port = free_port()

    def run(rank):
        with _rdzv(rank, 2, port, "attach", timeout_s=120.0) as rdzv:
            return fn(rank, rdzv, **kw)

    with cf.ThreadPoolExecutor(2) as pool:
        return [f.result(timeout=300) for f in [pool.submit(run, r) for r in (0, 1)]]


def _attach_in_a_group(rank, rdzv, *, model_dir):
    """A rank's model with its manager: attach, forward, close; the model before attach and after close."""
    from dwdp_runtime.config import DwdpConfig
    from dwdp_runtime.manager import DwdpManager
    from dwdp_worker.checkpoint.loader import load_sharded
    from dwdp_worker.model.packing import packed_logits
    from dwdp_worker.rank.engine import num_experts_of

    cfg = DwdpConfig(dwdp_size=2, num_experts=num_experts_of(model_dir), num_experts_per_worker=4,
                     num_prefetch_experts=4)
    manager = DwdpManager.create(config=cfg, rank=rank, rendezvous=rdzv, backend="host", token="tok", progress=False)
    try:
        loaded = load_sharded(model_dir, manager)
        before = snapshot(loaded.model, manager.local_range)
        att = attach(loaded.model, device="cpu", experts="auto", manager=manager, overrides=loaded.overrides)
        hooked = sum(len(m._forward_pre_hooks) for m in loaded.model.modules())
        logits = packed_logits(loaded.model, PROMPTS, "cpu")
        att.close()
        after = snapshot(loaded.model, manager.local_range)
        return before, after, hooked, len(loaded.overrides), logits
    finally:
        manager.release()


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3_moe_fp8"])
def test_close_undoes_hooks_bindings_and_quantized_forwards(arch, checkpoints, tmp_path):
    from dwdp_worker.checkpoint.synth import write_synthetic

    model_dir = checkpoints[arch] if arch in checkpoints else write_synthetic(
        "qwen3_moe", tmp_path / arch, seed=5, quant="fp8", hidden_size=256, moe_intermediate_size=192,
        intermediate_size=256, num_heads=4)
    results = _two_ranks(_attach_in_a_group, model_dir=model_dir)
    for before, after, hooked, overrides, _ in results:
        assert hooked > 0, "attach installed the DWDP hooks"
        assert (overrides > 0) == arch.endswith("fp8"), "one quantized forward per FP8 experts module"
        assert_same(after, before)
    assert torch.equal(results[0][4], results[1][4])  # both ranks: the same model's logits


def test_two_engines_in_one_process_do_not_collide(checkpoints):
    """Rank 0 and rank 1 as two engines of this process, beside a plain model: closing one changes neither
    the other nor the plain model."""
    from dwdp_worker.rank.engine import Engine, num_experts_of
    from dwdp_runtime.config import DwdpConfig

    model_dir = checkpoints["qwen3_moe"]
    plain = Reference(model_dir)
    want = plain.logits(PROMPTS)

    def build(rank, rdzv):
        cfg = DwdpConfig(dwdp_size=2, num_experts=num_experts_of(model_dir), num_experts_per_worker=4,
                         num_prefetch_experts=4)
        return Engine.build(model_dir=model_dir, config=cfg, rank=rank, rendezvous=rdzv, backend="host",
                            token="tok", progress=False)

    from tests.runtime.group import free_port
    from tests.worker.programs import _rdzv

    port = free_port()
    rdzvs = []

    def start(rank):
        rdzv = _rdzv(rank, 2, port, "engines", timeout_s=120.0)
        rdzvs.append(rdzv)
        return build(rank, rdzv)

    with cf.ThreadPoolExecutor(2) as pool:
        engines = [f.result(timeout=300) for f in [pool.submit(start, r) for r in (0, 1)]]
    try:
        for e in engines:
            assert torch.equal(e.forward(PROMPTS).logits, want)
        # a rank's close releases memory its peer imported: the peer's next forward would read it, so a group's
        # engines close together; what must hold is that closing one engine's attachment leaves the other's
        engines[0].attachment.close()
        assert torch.equal(engines[1].forward(PROMPTS).logits, want)
        assert torch.equal(plain.logits(PROMPTS), want)
        assert sum(len(m._forward_pre_hooks) for m in engines[0].model.modules()) == 0
        assert sum(len(m._forward_pre_hooks) for m in engines[1].model.modules()) > 0
    finally:
        with cf.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda e: e.close(), engines))
        for r in rdzvs:
            r.close()
    assert torch.equal(plain.logits(PROMPTS), want)
