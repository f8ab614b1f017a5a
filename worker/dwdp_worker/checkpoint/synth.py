"""Synthetic checkpoints: seeded random tiny MoE causal LMs, written exactly as ``save_pretrained`` writes them.

``write_synthetic(model_type, out_dir, seed=…)`` builds a real `transformers` model of **any** architecture
from a tiny config — hand-sized presets for ``SUPPORTED_ARCHS`` (the GPU oracle's three, sizes adjustable),
any other model type from its own config class (``synth_config.tiny_config``) — fills every parameter from
one ``torch.Generator(seed)`` (O(1) activations: weights
``randn / sqrt(fan_in)``, norms ``1 + 0.1·randn``, DeepSeek-V3's score-correction bias ``0.1·randn`` so
that it matters), and calls ``save_pretrained`` (``config.json`` + ``model.safetensors``; per-expert tensors
in the checkpoint's original layout). With ``tokenizer=True`` a small word-level `tokenizers` tokenizer,
built offline, is saved beside it.

Invariants: same (model type, seed, sizes, dtype, transformers version) → byte-identical tensors; defaults
are CPU-fast (a forward of a few hundred tokens takes milliseconds); the presets have at least one dense
(non-MoE) layer except Mixtral (which has none by design). ``dwdp-worker synth --list`` prints every model
type the installed `transformers` offers with the experts interface and whether it builds tiny.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

from dwdp_runtime.contract import ModelDtype

from ..model.registry import SUPPORTED_ARCHS

DTYPES = tuple(d.value for d in ModelDtype)  # the dtypes a worker loads (dwdp_runtime.contract)
#: checkpoint quantizations synth can write (None = unquantized); see dwdp_runtime.quant
QUANTS = (None, "fp8", "mxfp4", "nvfp4", "fp4-ue8m0")


def _config(arch: str, *, num_experts: int, num_layers: int, hidden_size: int, vocab_size: int,
            intermediate_size: int | None, moe_intermediate_size: int | None, num_heads: int | None,
            max_positions: int, top_k: int) -> Any:
    import transformers as tf

    h = hidden_size
    heads = num_heads or max(2, h // 16)
    if h % heads:
        raise ValueError(f"hidden_size={h} must be a multiple of the number of heads ({heads})")
    head_dim = h // heads
    moe_i = moe_intermediate_size or max(8, h // 2)
    dense_i = intermediate_size or 2 * h
    common = dict(vocab_size=vocab_size, hidden_size=h, num_hidden_layers=num_layers, num_attention_heads=heads,
                  max_position_embeddings=max_positions, num_experts_per_tok=min(top_k, num_experts),
                  tie_word_embeddings=False, rms_norm_eps=1e-6)
    if arch == "qwen3_moe":
        kv = max(1, heads // 2)
        return tf.Qwen3MoeConfig(**common, num_key_value_heads=kv, head_dim=head_dim, intermediate_size=dense_i,
                                 moe_intermediate_size=moe_i, num_experts=num_experts, norm_topk_prob=True,
                                 decoder_sparse_step=1, mlp_only_layers=[1] if num_layers >= 3 else [])
    if arch == "mixtral":
        kv = max(1, heads // 2)
        return tf.MixtralConfig(**common, num_key_value_heads=kv, head_dim=head_dim, intermediate_size=moe_i,
                                num_local_experts=num_experts, sliding_window=None)
    if arch == "deepseek_v3":
        n_group = 2 if num_experts % 2 == 0 and num_experts >= 4 else 1
        rope = max(2, (head_dim // 2) & ~1)
        return tf.DeepseekV3Config(**common, num_key_value_heads=heads, intermediate_size=dense_i,
                                   moe_intermediate_size=moe_i, n_routed_experts=num_experts, n_shared_experts=1,
                                   n_group=n_group, topk_group=1 if n_group > 1 else 1,
                                   first_k_dense_replace=1 if num_layers >= 2 else 0, q_lora_rank=h // 2,
                                   kv_lora_rank=h // 2, qk_rope_head_dim=rope, qk_nope_head_dim=head_dim,
                                   v_head_dim=head_dim, routed_scaling_factor=2.5, norm_topk_prob=True)
    raise ValueError(f"unknown architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")


_DEFAULTS = dict(num_experts=8, num_layers=3, hidden_size=32, vocab_size=256)


def write_synthetic(arch: str, out_dir, *, seed: int = 0, num_experts: int | None = None,
                    num_layers: int | None = None, hidden_size: int | None = None, vocab_size: int | None = None,
                    dtype: str = "float32", tokenizer: bool = False, intermediate_size: int | None = None,
                    moe_intermediate_size: int | None = None, num_heads: int | None = None,
                    max_positions: int = 4096, top_k: int = 2, quant: str | None = None,
                    fused_experts: bool = False, config_overrides: dict | None = None) -> pathlib.Path:
    """Write a seeded random tiny checkpoint of ``arch`` to ``out_dir`` and return its path.

    ``quant="fp8"``: then quantized from those seeded weights as a fine-grained FP8 checkpoint
    (``fp8_checkpoint.quantize_checkpoint``; ``fused_experts`` stores the experts as fused 3-D tensors);
    ``quant="mxfp4"`` / ``"nvfp4"`` / ``"fp4-ue8m0"``: as gpt-oss / ModelOpt / DeepSeek-V4 write FP4 experts
    (``checkpoint.fp4``)."""
    import torch
    import transformers as tf

    if quant not in QUANTS:
        raise ValueError(f"quant {quant!r}: must be one of {', '.join(q for q in QUANTS if q)} (or none)")
    if fused_experts and quant != "fp8":
        raise ValueError("fused_experts applies to an FP8 checkpoint (--quant fp8; MXFP4 experts are always fused, "
                         "NVFP4 ones per expert, as the released checkpoints store them)")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: must be one of {', '.join(DTYPES)}")
    if arch not in SUPPORTED_ARCHS:
        given = {k: v for k, v in dict(num_experts=num_experts, num_layers=num_layers, hidden_size=hidden_size,
                                       vocab_size=vocab_size, intermediate_size=intermediate_size,
                                       moe_intermediate_size=moe_intermediate_size, num_heads=num_heads).items()
                 if v is not None}
        if given:
            raise ValueError(f"{arch}: sizes {sorted(given)} are adjustable for {', '.join(SUPPORTED_ARCHS)} only; "
                             f"other model types use synth_config.TINY")
        return _write_from_config_class(arch, pathlib.Path(out_dir), seed=seed, dtype=dtype, tokenizer=tokenizer,
                                        quant=quant, fused_experts=fused_experts, overrides=config_overrides)
    if config_overrides:
        raise ValueError(f"{arch}: config_overrides apply to non-preset model types; use the size arguments")
    sizes = dict(num_experts=num_experts, num_layers=num_layers, hidden_size=hidden_size, vocab_size=vocab_size)
    sizes = {k: (_DEFAULTS[k] if v is None else int(v)) for k, v in sizes.items()}
    for k, v in sizes.items():
        if v < 1:
            raise ValueError(f"{k}={v} must be >= 1")
    if sizes["num_experts"] < 2:
        raise ValueError("num_experts must be >= 2 (DWDP shards experts over at least 2 ranks)")
    config = _config(arch, intermediate_size=intermediate_size, moe_intermediate_size=moe_intermediate_size,
                     num_heads=num_heads, max_positions=max_positions, top_k=top_k, **sizes)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _fill_seeded(model, seed, dtype)
    model.config.dtype = dtype
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer:
        write_tokenizer(out, vocab_size=sizes["vocab_size"], max_positions=max_positions)
    _quantize(out, quant, fused_experts)
    return out


def _quantize(out: pathlib.Path, quant: str | None, fused_experts: bool) -> None:
    if quant == "fp8":
        from .fp8 import quantize_checkpoint

        quantize_checkpoint(out, fused_experts=fused_experts)
    elif quant is not None:
        from dwdp_runtime.quant.fp4 import MXFP4_GROUP, NVFP4_GROUP

        from . import fp4

        try:
            fp4.quantize_checkpoint(out, quant)
        except ValueError as exc:
            group = NVFP4_GROUP if quant == "nvfp4" else MXFP4_GROUP
            raise ValueError(f"{exc}: {quant} needs every projection's input size a multiple of {group} "
                             f"(--hidden-size, --moe-intermediate-size, --intermediate-size)") from None


def _fill_seeded(model, seed: int, dtype: str) -> None:
    """Every parameter (sorted by name) from one generator; score-correction biases non-zero (routing uses
    them); meta buffers (none are saved except those) empty."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.dim() <= 1:
                value = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            elif name.endswith("embed_tokens.weight"):
                value = torch.randn(p.shape, generator=gen)
            else:
                value = torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5
            _set(model, name, torch.nn.Parameter(value.to(getattr(torch, dtype)), requires_grad=False))
        for name, b in list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                value = 0.1 * torch.randn(b.shape, generator=gen)
            elif b.device.type == "meta":
                value = torch.empty(b.shape, dtype=b.dtype)
            else:
                continue
            _set(model, name, value.to(b.dtype), buffer=True)
        # non-persistent buffers (rotary inv_freq) are not saved; nothing else stays on meta


def _write_from_config_class(model_type: str, out: pathlib.Path, *, seed: int, dtype: str, tokenizer: bool,
                             quant: str | None = None, fused_experts: bool = False, overrides: dict | None = None):
    """Any architecture: its config class made tiny, built on CPU (buffers get the model's own init, under
    ``torch.manual_seed(seed)``), parameters from the seeded generator, ``save_pretrained``."""
    import torch

    from ..model.experts_discovery import discover
    from ..model.synth_config import TINY_VOCAB, serving_auto_class, tiny_config

    config = tiny_config(model_type, seed_overrides=overrides)
    auto = serving_auto_class(config)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=torch.float32)
    if not discover(model).experts:
        raise ValueError(f"{model_type}: the model has no experts module under transformers' experts interface, "
                         f"nothing for DWDP to shard (dwdp-worker synth --list shows the MoE model types)")
    _fill_seeded(model, seed, dtype)
    model.config.dtype = dtype
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer:
        write_tokenizer(out, vocab_size=TINY_VOCAB, max_positions=getattr(config.get_text_config(),
                                                                            "max_position_embeddings", 4096))
    _quantize(out, quant, fused_experts)
    return out


def _set(model, name: str, value, *, buffer: bool = False) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if buffer:
        mod._buffers[attr] = value
    else:
        mod._parameters[attr] = value


_WORDS = ("the a an of to and in is it that for on with as was by at be this are from or have not but what all "
          "were when we there can your which their said if do will each about how up out them then she many "
          "some so these would other into has more her two like him see time could no make than first been "
          "its who now people my made over did down only way find use may water long little very after words "
          "called just where most know hello world model expert layer prefill token weight group rank system user "
          "assistant").split()

# A minimal chat template in the shape real ones have (turn markers, roles, a generation prompt), written
# in words of the tokenizer above so every rendered token is a real id: chat tests and the demo run it.
CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<s> assistant {% endif %}")


def write_tokenizer(out_dir, *, vocab_size: int, max_positions: int = 4096) -> None:
    """A word-level tokenizer (whitespace split, ``[UNK]`` for unknown words) with exactly ``vocab_size`` ids
    and ``CHAT_TEMPLATE`` as its chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["[UNK]", "[PAD]", "<s>", "</s>"]
    if vocab_size < len(specials) + 1:
        raise ValueError(f"vocab_size={vocab_size} is too small for a tokenizer (need >= {len(specials) + 1})")
    words = list(dict.fromkeys(_WORDS))
    vocab_words = specials + words + [f"w{i}" for i in range(max(0, vocab_size - len(specials) - len(words)))]
    vocab = {w: i for i, w in enumerate(vocab_words[:vocab_size])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", bos_token="<s>",
                                   eos_token="</s>", model_max_length=max_positions)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


# -- CLI delegation (the `dwdp-worker synth` subcommand is owned by the CLI module) ----------------------------
def add_synth_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("arch", nargs="?", metavar="MODEL_TYPE",
                        help=f"any transformers model_type with MoE experts (see --list); presets with adjustable "
                             f"sizes: {', '.join(SUPPORTED_ARCHS)}")
    parser.add_argument("--list", action="store_true", help="list the model types it can build and why others not")
    parser.add_argument("--out", help="output directory (created)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed → same bytes; default 0)")
    parser.add_argument("--num-experts", type=int, default=None, help=f"default {_DEFAULTS['num_experts']}")
    parser.add_argument("--num-layers", type=int, default=None, help=f"default {_DEFAULTS['num_layers']}")
    parser.add_argument("--hidden-size", type=int, default=None, help=f"default {_DEFAULTS['hidden_size']}")
    parser.add_argument("--vocab-size", type=int, default=None, help=f"default {_DEFAULTS['vocab_size']}")
    parser.add_argument("--moe-intermediate-size", type=int, default=None, help="default hidden_size/2")
    parser.add_argument("--intermediate-size", type=int, default=None, help="dense MLP size, default 2*hidden")
    parser.add_argument("--num-heads", type=int, default=None, help="default max(2, hidden/16)")
    parser.add_argument("--max-positions", type=int, default=4096, help="max_position_embeddings (default 4096)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weight dtype (default float32)")
    parser.add_argument("--tokenizer", action="store_true", help="also write a small word-level tokenizer with a chat template")
    parser.add_argument("--quant", choices=[q for q in QUANTS if q], default=None,
                        help="quantize the seeded weights: fp8 = e4m3 with 128x128 block scales (DeepSeek-V3 format); "
                             "mxfp4 = E2M1 experts with E8M0 scales per 32 (gpt-oss format); nvfp4 = E2M1 with "
                             "E4M3 scales per 16 and an fp32 global scale (ModelOpt format); fp4-ue8m0 = FP4 experts "
                             "with E8M0 scales per 32 and FP8 dense linears with E8M0 block scales (DeepSeek-V4 "
                             "format)")
    parser.add_argument("--fused-experts", action="store_true",
                        help="with --quant fp8: store experts as fused gate_up_proj/down_proj (+ _scale_inv) tensors")


def synth_main(args: argparse.Namespace) -> int:
    import sys

    if args.list:
        return _print_list()
    if not args.arch or not args.out:
        print("dwdp-worker synth: error: give MODEL_TYPE and --out DIR (or --list)", file=sys.stderr)
        return 2
    try:
        path = write_synthetic(args.arch, args.out, seed=args.seed, num_experts=args.num_experts,
                               num_layers=args.num_layers, hidden_size=args.hidden_size, vocab_size=args.vocab_size,
                               dtype=args.dtype, tokenizer=args.tokenizer, intermediate_size=args.intermediate_size,
                               moe_intermediate_size=args.moe_intermediate_size, num_heads=args.num_heads,
                               max_positions=args.max_positions, top_k=args.top_k,
                               quant=getattr(args, "quant", None), fused_experts=getattr(args, "fused_experts", False))
    except (ValueError, OSError) as exc:
        print(f"dwdp-worker synth: error: {exc}", file=sys.stderr)
        return 2
    cfg = json.loads((path / "config.json").read_text())
    print(f"wrote {args.arch} checkpoint to {path} (layers={cfg.get('num_hidden_layers')}, "
          f"hidden={cfg.get('hidden_size')}, vocab={cfg.get('vocab_size')}, dtype={args.dtype}"
          f"{', quant=' + args.quant if getattr(args, 'quant', None) else ''})")
    return 0


def _print_list() -> int:
    from ..model.architectures import experts_model_types, probe

    probes = [probe(t) for t in experts_model_types()]
    width = max(len(p.model_type) for p in probes)
    for p in probes:
        detail = (f"{p.auto_class}, experts in layers {list(p.layers)}{', ' + p.flags if p.flags else ''}" if p.ok
                  else f"refused: {p.reason}")
        print(f"{p.model_type:<{width}}  {'ok' if p.ok else '--'}  {detail}")
    print(f"{sum(p.ok for p in probes)} of {len(probes)} model types build tiny")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dwdp_worker.checkpoint.synth", description=__doc__.splitlines()[0])
    add_synth_arguments(parser)
    return synth_main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
