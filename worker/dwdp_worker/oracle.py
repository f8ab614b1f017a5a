"""The unsharded oracle: plain `transformers` on the same checkpoint, packed exactly like the engine.

``reference_logits(model_dir, sequences)`` loads the model with ``AutoModelForCausalLM.from_pretrained``
(every expert resident, no DWDP), runs one packed forward (``packing.packed_logits``) and returns the
last-position logits ``[num_sequences, vocab]`` in float32 on CPU. On the same device, dtype and thread
count the DWDP engine must match it bitwise: DWDP only changes *where* expert bytes live, never the math.
"""

from __future__ import annotations

from typing import Sequence

from .loader import load_config, resolve_dtype
from .packing import packed_logits


class Reference:
    """One unsharded model, kept for several forwards."""

    def __init__(self, model_dir, *, dtype=None, device="cpu"):
        import torch
        from transformers import AutoModelForCausalLM

        config = load_config(model_dir)
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=resolve_dtype(config, dtype))
        self.model.to(self.device).eval()

    def logits(self, sequences: Sequence[Sequence[int]]):
        return packed_logits(self.model, sequences, self.device)


def reference_logits(model_dir, sequences, dtype=None, device="cpu"):
    return Reference(model_dir, dtype=dtype, device=device).logits(sequences)
