"""The unsharded oracle: plain `transformers` on the same checkpoint, packed exactly like the engine.

``reference_logits(model_dir, sequences)`` loads the model with ``from_pretrained`` of its serving Auto class
(``AutoModelForCausalLM``, or the image-text-to-text class of a vision-language model)
(every expert resident, no DWDP), runs one packed forward (``packing.packed_logits``) and returns the
last-position logits ``[num_sequences, vocab]`` in float32 on CPU. On the same device, dtype and thread
count the DWDP engine must match it bitwise: DWDP only changes *where* expert bytes live, never the math.

Bitwise preconditions (all hold for real checkpoints): same thread count (GEMM reductions may split by
thread), same operand alignment modulo 16 bytes (``realign``; the composite puts every expert at
``base + e * expert_bytes``, so expert sizes must be multiples of 64 bytes, as every real model's are).
"""

from __future__ import annotations

from typing import Sequence

from ..checkpoint.loader import load_config, resolve_dtype
from ..model.attach import attach
from ..model.packing import packed_logits


def realign(model) -> None:
    """Give every parameter/buffer fresh (allocator-aligned) storage.

    ``from_pretrained`` on CPU may leave tensors inside the mmapped safetensors file at 8-byte alignment;
    CPU GEMM kernels take alignment-dependent paths (measured: operands shifted by 4 or 8 bytes change the
    last bits of float32 results, 16 bytes and more do not). The engine's tensors are freshly allocated and
    its composite experts are page-aligned at the local range, so the oracle aligns its own the same way.
    """
    import torch

    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.data = t.data.clone()
    model.tie_weights()


class Reference:
    """One unsharded model, kept for several forwards."""

    def __init__(self, model_dir, *, dtype=None, device="cpu", experts: str | None = None,
                 batch_invariant: bool = False, fused_router: bool = False):
        import torch

        from ..model.layers_impl import install_dtype_keeping_norms
        from ..model.synth_config import serving_auto_class

        config = load_config(model_dir)
        self.device = torch.device(device)
        self.model = serving_auto_class(config).from_pretrained(str(model_dir), dtype=resolve_dtype(config, dtype))
        self.model.to(self.device).eval()
        install_dtype_keeping_norms(self.model)   # as the engine's meta model: float32-kept norms cast back (5.17)
        realign(self.model)
        # e.g. experts="dwdp": the unsharded model on the same experts kernels as the engine
        self.attachment = attach(self.model, device=self.device, experts=experts, batch_invariant=batch_invariant,
                                 fused_router=fused_router)

    def logits(self, sequences: Sequence[Sequence[int]]):
        return packed_logits(self.model, sequences, self.device)


def reference_logits(model_dir, sequences, dtype=None, device="cpu"):
    return Reference(model_dir, dtype=dtype, device=device).logits(sequences)
