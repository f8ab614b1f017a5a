"""Train a synthesized checkpoint briefly on real text, so that agreement metrics see a model with real margins.

A random-weight model has nearly flat next-token logits: bf16 rounding alone flips its arg-maxes (measured on
H200: bf16 agrees 97.0 % with float32), so a top-1 agreement goal such as FP8's ≥ 99 % means something on a
trained model only. None can be downloaded here, so ``bench/fp8_prefill.py --train-steps N`` makes one:

  * corpus (``load_corpus``): real text already on disk — by default the ``.py`` sources of the interpreter's
    standard library (``sysconfig.get_paths()["stdlib"]``, installed packages skipped) — read as bytes,
    tokens = byte values 0–255 (ids of a larger vocabulary are never targets); files split by a CRC of their
    relative path into train (≈ 95 %) and held-out (≈ 5 %), each split one concatenated byte stream;
  * training (``train_checkpoint``): the synthesized bf16 checkpoint loaded with `transformers` in float32
    (the master weights), ``steps`` steps of next-token cross-entropy (plus the model's router load-balancing
    loss where its config has one) on random train windows, AdamW, linear warm-up then cosine decay, gradient
    clipping; bf16 autocast on CUDA, plain float32 on CPU; experts on `transformers`' eager forward (its
    ``grouped_mm`` one is not autocast-enabled and would run the float32 master weights); loss printed every
    ~10 % of the steps, held-out bits per byte before and after;
  * the trained weights saved in bf16 by ``save_pretrained``: the layout ``synth`` writes, so the quantizer,
    the dequantized reference and the engine read it unchanged; ``train.json`` beside them records the run
    (written last: it marks a complete checkpoint);
  * ``heldout_prompts``: seeded windows of the held-out stream, the agreement prompts.

Seeded throughout (batches, eval windows, prompts, torch's RNG); CPU runs repeat bitwise, CUDA runs up to the
non-deterministic reductions of the backward pass (index_add, attention).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import statistics
import sysconfig
import time
import zlib

#: the files read as the corpus, under its directory
CORPUS_GLOB = "*.py"
#: installed third-party packages sit inside the stdlib directory on most layouts: they are not the stdlib
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
#: one file in HELDOUT_EVERY is held out (≈ 5 %), chosen by the CRC-32 of its relative path: deterministic and
#: independent of the listing order and of which other files exist
HELDOUT_EVERY = 20
#: the byte vocabulary: the model must have at least these ids
BYTE_VOCAB = 256
#: train batches and torch's global RNG
TRAIN_SEED = 0
#: the held-out loss windows (the same ones before and after training)
EVAL_SEED = 1
#: held-out windows of ``seq`` bytes the held-out loss is averaged over (at 512 bytes: 32 KiB of text)
EVAL_WINDOWS = 64
#: the linear warm-up, as a fraction of the steps (at least one step)
WARMUP_FRACTION = 0.05
#: the cosine decays to this fraction of the peak learning rate
MIN_LR_FRACTION = 0.1
#: gradient-norm clipping (the usual LM value; the first steps on random weights have large gradients)
GRAD_CLIP = 1.0
#: AdamW on matrices only (norm weights and biases undecayed), the usual LM recipe
WEIGHT_DECAY = 0.1
ADAM_BETAS = (0.9, 0.95)
#: progress lines: every this fraction of the steps
LOG_FRACTION = 0.1


@dataclasses.dataclass(frozen=True)
class Corpus:
    root: str
    train: object  # torch.uint8 [bytes], the train files concatenated
    heldout: object  # torch.uint8 [bytes], the held-out files concatenated
    train_files: int
    heldout_files: int

    def describe(self) -> dict:
        return {"root": self.root, "glob": CORPUS_GLOB, "train_files": self.train_files,
                "train_bytes": int(self.train.numel()), "heldout_files": self.heldout_files,
                "heldout_bytes": int(self.heldout.numel())}


def default_corpus_dir() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: pathlib.Path) -> list[pathlib.Path]:
    """The corpus files under ``root``, sorted by relative path, installed packages skipped."""
    files = (f for f in root.rglob(CORPUS_GLOB) if f.is_file())
    return sorted((f for f in files if not SKIP_DIRS & set(f.relative_to(root).parts[:-1])),
                  key=lambda f: f.relative_to(root).as_posix())


def is_heldout(relative_path: str) -> bool:
    return zlib.crc32(relative_path.encode()) % HELDOUT_EVERY == 0


def load_corpus(root=None) -> Corpus:
    """Read the corpus under ``root`` (default: the stdlib) and split it (see the module docstring)."""
    import torch

    root = (pathlib.Path(root) if root else default_corpus_dir()).resolve()
    files = corpus_files(root)
    held = [f for f in files if is_heldout(f.relative_to(root).as_posix())]
    if not held and len(files) >= 2:  # a small corpus whose CRCs missed: hold out its last file
        held = files[-1:]
    held_set = set(held)
    train = [f for f in files if f not in held_set]
    if not train or not held:
        raise ValueError(f"corpus {root}: {len(files)} {CORPUS_GLOB} file(s); need at least 2 (train and held-out)")

    def stream(fs):
        return torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in fs)), dtype=torch.uint8)

    return Corpus(str(root), stream(train), stream(held), len(train), len(held))


def windows(data, n: int, length: int, gen):
    """``n`` windows of ``length`` bytes at seeded random offsets of ``data``: int64 ``[n, length]``."""
    import torch

    if data.numel() < length:
        raise ValueError(f"a corpus split has {data.numel()} bytes, fewer than a window of {length}")
    starts = torch.randint(0, data.numel() - length + 1, (n, 1), generator=gen)
    return data[starts + torch.arange(length)].long()


def heldout_prompts(corpus: Corpus, n: int, length: int, *, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` byte tokens, seeded windows of the held-out stream."""
    import torch

    return windows(corpus.heldout, n, length, torch.Generator().manual_seed(seed)).tolist()


def lr_factor(step: int, steps: int) -> float:
    """The learning rate of step ``step`` (0-based) ÷ the peak: linear warm-up, then cosine to MIN_LR_FRACTION."""
    warmup = max(1, round(WARMUP_FRACTION * steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))


def _autocast(device):
    import torch

    if torch.device(device).type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _losses(model, window, device):
    """(next-token cross-entropy in nats, the loss to optimise) of a batch of windows ``[B, seq + 1]``."""
    import torch

    window = window.to(device, non_blocking=True)
    coef = getattr(model.config, "router_aux_loss_coef", None)
    extra = {"output_router_logits": True} if coef else {}
    with _autocast(device):
        out = model(input_ids=window[:, :-1], use_cache=False, **extra)
    ce = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), window[:, 1:].flatten())
    aux = getattr(out, "aux_loss", None)
    return ce, (ce + coef * aux.float() if coef and aux is not None else ce)


def heldout_bits_per_byte(model, corpus: Corpus, *, seq: int, batch: int, device) -> float:
    """Mean next-byte cross-entropy over EVAL_WINDOWS seeded held-out windows, in bits per byte."""
    import torch

    data = windows(corpus.heldout, EVAL_WINDOWS, seq + 1, torch.Generator().manual_seed(EVAL_SEED))
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, len(data), batch):
            chunk = data[i:i + batch]
            total += float(_losses(model, chunk, device)[0]) * len(chunk)
    model.train(was_training)
    return total / len(data) / math.log(2)


def _optimizer(model, lr: float, device):
    import torch

    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=ADAM_BETAS, fused=torch.device(device).type == "cuda")


def _load_for_training(src, device):
    """The checkpoint in float32 (the master weights) on ``device``, trainable, experts on the eager forward."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).to(device)
    for p in model.parameters():
        p.requires_grad_(True)
    model.set_experts_implementation("eager")  # a training copy, not a served model: no DWDP attachment
    model.train()
    return model


def _train_steps(model, corpus: Corpus, *, steps: int, batch: int, seq: int, lr: float, device) -> list[dict]:
    """The optimisation loop; returns the progress records it printed."""
    import torch

    opt = _optimizer(model, lr, device)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps))
    gen = torch.Generator().manual_seed(TRAIN_SEED)
    every = max(1, round(LOG_FRACTION * steps))
    log, window_losses, t0 = [], [], time.perf_counter()
    for step in range(steps):
        ce, loss = _losses(model, windows(corpus.train, batch, seq + 1, gen), device)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        lr_used = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        window_losses.append(float(ce.detach()))  # a host sync per step: negligible next to a step's work
        if (step + 1) % every == 0 or step + 1 == steps or step == 0:
            rec = {"step": step + 1, "train_bits_per_byte": statistics.fmean(window_losses) / math.log(2),
                   "lr": lr_used, "elapsed_s": time.perf_counter() - t0}
            log.append(rec)
            print(f"  step {rec['step']:>5}/{steps}: train loss {rec['train_bits_per_byte']:.3f} bits/byte "
                  f"(mean of the last {len(window_losses)}), lr {rec['lr']:.2e}, {rec['elapsed_s']:.1f} s", flush=True)
            window_losses = []
    return log


def train_checkpoint(src, dst, corpus: Corpus, *, steps: int, batch: int, seq: int, lr: float, device) -> dict:
    """Train checkpoint ``src`` on ``corpus`` (see the module docstring), save it in bf16 to ``dst`` with its
    ``train.json`` summary, and return the summary."""
    import torch

    torch.manual_seed(TRAIN_SEED)
    model = _load_for_training(src, device)
    vocab = model.config.get_text_config().vocab_size
    if vocab < BYTE_VOCAB:
        raise ValueError(f"vocab_size {vocab} < {BYTE_VOCAB}: byte tokens need at least {BYTE_VOCAB} ids")
    before = heldout_bits_per_byte(model, corpus, seq=seq, batch=batch, device=device)
    print(f"training {steps} steps x {batch} x {seq} bytes on {corpus.root} ({corpus.train.numel() / 1e6:.1f} MB "
          f"train, {corpus.heldout.numel() / 1e6:.2f} MB held out), lr {lr:g}, on {device}; held-out "
          f"{before:.3f} bits/byte before", flush=True)
    t0 = time.perf_counter()
    log = _train_steps(model, corpus, steps=steps, batch=batch, seq=seq, lr=lr, device=device)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    train_s = time.perf_counter() - t0
    after = heldout_bits_per_byte(model, corpus, seq=seq, batch=batch, device=device)
    print(f"held-out {after:.3f} bits/byte after {steps} steps ({train_s:.1f} s, "
          f"{steps * batch * seq / train_s:,.0f} tokens/s)", flush=True)
    summary = {"steps": steps, "batch": batch, "seq": seq, "lr": lr, "device": str(device),
               "heldout_bits_per_byte_before": before, "heldout_bits_per_byte": after, "train_s": train_s,
               "tokens_per_s": steps * batch * seq / train_s, "log": log, "corpus": corpus.describe()}
    _save_bf16(model, dst)
    (pathlib.Path(dst) / "train.json").write_text(json.dumps(summary, indent=1) + "\n")
    del model
    _release(device)
    return summary


def _release(device) -> None:
    """Give the training memory back to the device before the bench's ranks start (the parent keeps running)."""
    import gc

    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _save_bf16(model, dst) -> None:
    import torch

    model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(str(dst), safe_serialization=True)
