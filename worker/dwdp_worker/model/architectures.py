"""The model types the installed `transformers` offers with the experts interface, found in `transformers` itself.

``experts_model_types()``: every ``model_type`` of `transformers`' config registry whose modeling module
defines a class under ``@use_experts_implementation`` (found by reading the modeling sources for the
decorator, which is cheap — importing ~450 modeling modules is not), minus the sub-configs of other listed
types that `transformers` does not serve on their own (vision/audio towers, internal parts).

``probe(model_type)`` builds the tiny config (``synth_config``) and the model on the meta device and
discovers its experts layout: ``Probe(model_type, ok, auto_class, layers, reason)``. ``dwdp-worker synth
--list`` prints it; the support-matrix test serves every type whose probe is ``ok``.
"""

from __future__ import annotations

import functools
import pathlib
from dataclasses import dataclass

#: the decorator `transformers` puts on every experts class (what the source scan looks for)
EXPERTS_DECORATOR = "@use_experts_implementation"


@functools.lru_cache(maxsize=1)
def _experts_module_dirs() -> frozenset[str]:
    import transformers

    root = pathlib.Path(transformers.__file__).parent / "models"
    dirs = set()
    for path in root.glob("*/modeling_*.py"):
        try:
            if EXPERTS_DECORATOR in path.read_text(encoding="utf-8"):
                dirs.add(path.parent.name)
        except OSError:
            continue
    return frozenset(dirs)


def experts_model_types() -> list[str]:
    """Sorted model types of the installed `transformers` whose modeling code uses the experts interface.

    A sub-config of another listed type (``gemma4_vision``, ``qwen3_5_moe_text``) is kept only when
    `transformers` serves it on its own (an Auto class maps it): towers and internal parts are not models."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES, model_type_to_module_name

    from .synth_config import serving_auto_class

    dirs = _experts_module_dirs()
    classes = {}
    for model_type in CONFIG_MAPPING_NAMES:
        if model_type_to_module_name(model_type) in dirs:
            try:
                classes[model_type] = CONFIG_MAPPING[model_type]
            except Exception:  # noqa: BLE001 - a config that does not import is listed (and refused by its probe)
                classes[model_type] = None
    parts = {sub for cls in classes.values() if cls is not None
             for sub in (getattr(cls, "sub_configs", None) or {}).values() if isinstance(sub, type)}
    out = []
    for model_type, cls in classes.items():
        if cls in parts:
            try:
                serving_auto_class(cls.__new__(cls))
            except (ValueError, AttributeError):
                continue  # a part of another model, not served on its own
        out.append(model_type)
    return sorted(out)


@dataclass(frozen=True)
class Probe:
    model_type: str
    ok: bool
    auto_class: str = ""        # the Auto class serving it (AutoModelForCausalLM, AutoModelForImageTextToText)
    layers: tuple[int, ...] = ()  # decoder layers with an experts module (tiny config)
    flags: str = ""             # experts layout flags of the first experts module
    reason: str = ""            # why it is refused (ok=False)


@functools.lru_cache(maxsize=None)
def probe(model_type: str) -> Probe:
    """Can DWDP build and shard ``model_type`` tiny? (Never raises; the reason says why not. Cached per process:
    the answer depends only on the installed `transformers`.)"""
    import torch

    from .experts_discovery import UnsupportedModelError, discover
    from .synth_config import serving_auto_class, tiny_config

    try:
        config = tiny_config(model_type)
        auto = serving_auto_class(config)
        with torch.device("meta"):
            model = auto.from_config(config, dtype=torch.float32)
        layout = discover(model)
    except (ValueError, UnsupportedModelError) as exc:
        return Probe(model_type, False, reason=_one_line(exc))
    except Exception as exc:  # noqa: BLE001 - the model's own code failed to build: that is the reason
        unset = _unset_fields_the_model_reads(model_type)
        if unset and isinstance(exc, TypeError) and "NoneType" in str(exc):
            return Probe(model_type, False, reason=f"no tiny config possible: the config class leaves "
                                                   f"{', '.join(unset)} unset (None) and the modeling code needs "
                                                   f"them; a real checkpoint's config.json sets them")
        return Probe(model_type, False, reason=f"transformers cannot build it tiny ({type(exc).__name__}: "
                                               f"{_one_line(exc)})")
    if not layout.experts:
        return Probe(model_type, False, auto.__name__, reason="the tiny model has no experts module "
                                                             "(MoE switched off by its config)")
    e = layout.experts[0]
    flags = ",".join(f for f, on in (("transposed", e.is_transposed), ("gated", e.has_gate), ("bias", e.has_bias),
                                     ("interleaved", not e.is_concatenated)) if on)
    return Probe(model_type, True, auto.__name__, tuple(layout.layers), flags)


def _unset_fields_the_model_reads(model_type: str) -> list[str]:
    """Config fields the tiny config leaves None that the architecture's modeling source reads
    (``config.<field>``): the usual reason a config class cannot be instantiated usefully without a checkpoint."""
    import re

    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    from .synth_config import tiny_config

    try:
        config = tiny_config(model_type)
    except ValueError:
        return []
    module = model_type_to_module_name(model_type)
    root = pathlib.Path(transformers.__file__).parent / "models" / module
    source = "".join(f.read_text(encoding="utf-8") for f in root.glob("modeling_*.py"))
    configs = [config, *(getattr(config, n, None) for n in (getattr(config, "sub_configs", None) or {}))]
    unset = set()
    for c in configs:
        if c is None or not hasattr(c, "to_dict"):
            continue
        for field, value in c.to_dict().items():
            if value is None and not field.endswith("_token_id") and re.search(rf"config\.{re.escape(field)}\b", source):
                unset.add(field)
    return sorted(unset)


def _one_line(exc: BaseException, limit: int = 240) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


__all__ = ["EXPERTS_DECORATOR", "Probe", "experts_model_types", "probe"]
