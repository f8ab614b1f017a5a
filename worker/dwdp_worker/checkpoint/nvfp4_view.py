"""An NVFP4 checkpoint of another producer read as ModelOpt's: compressed-tensors' names and inverse global
scale translated at the index, so the rest of the loader knows one NVFP4 layout.

``modelopt_view(index, qc)`` returns ``index`` itself for every checkpoint but an NVFP4 one whose names are not
ModelOpt's (``QuantConfig.nvfp4``, ``dwdp_runtime.quant.nvfp4_checkpoint``); for those (compressed-tensors) a
``ModeloptView`` with the index's interface (``entries``, ``in``, ``shape``, ``get``, ``read_rows``,
``reopened``) under ModelOpt's names:

  * ``m.weight_packed``        → ``m.weight``          (uint8 E2M1 codes, the same bytes)
  * ``m.weight_scale``         → ``m.weight_scale``    (e4m3 group scales, the same bytes)
  * ``m.weight_global_scale``  → ``m.weight_scale_2``  read as ``fl32(1 / g)`` (``quant.fp4.nvfp4_inverse_global``)
  * every other key as stored (unquantized ``m.weight`` of ignored modules, norms, routers, ``input_global_scale``
    — not read, as ModelOpt's ``input_scale``).

Everything downstream — ``names.CheckpointMap`` (`transformers`' renaming and expert merging), ``fp4_layout``,
the dense NVFP4 dequantization, the experts reader of the loader and its reload after a lost rank (issue #30)
— runs unchanged on ModelOpt's names. A read goes to the same bytes of the same file: experts ``[a, b)`` of a
rank are the only expert bytes it reads (the global scale, 4 bytes per projection, is read into a float32
staging tensor and inverted there).

A checkpoint error raised downstream names a tensor by its ModelOpt name (``m.weight_scale_2`` for the stored
``m.weight_global_scale``; ``stored_key`` maps back).

Refused here (``CheckpointError``): a key that two stored keys would both become (``m.weight`` stored beside
``m.weight_packed``), a quantized tensor of a module the config's ``ignore`` lists (the checkpoint contradicts
its own config), a global scale with no finite inverse (zero).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from dwdp_runtime.quant import MODELOPT_NVFP4, Nvfp4Checkpoint, Nvfp4Part, QuantConfig, fp4

from .safetensors_index import CheckpointError


@dataclass(frozen=True)
class _Alias:
    key: str          # the stored key
    inverted: bool    # read as 1 / stored (a DIVISOR global scale under ModelOpt's MULTIPLIER name)


def _aliases(stored, conv: Nvfp4Checkpoint) -> dict[str, _Alias]:
    """ModelOpt name → stored key, for every stored key (module docstring)."""
    src, dst = conv.names, MODELOPT_NVFP4
    out: dict[str, _Alias] = {}
    for key in stored:
        module, dot, leaf = key.rpartition(".")
        part = src.part_of(leaf)
        if part is None:
            name, inverted = key, False
        else:
            name = f"{module}{dot}{dst.leaf(part)}"
            inverted = part is Nvfp4Part.GLOBAL_SCALE and src.global_kind is not dst.global_kind
            if part is Nvfp4Part.WEIGHT and (hit := conv.ignore.matches(module)) is not None:
                raise CheckpointError(f"{key}: stored as {src.producer} NVFP4, but quantization_config.ignore "
                                      f"lists {module} ({hit!r}): the checkpoint contradicts its config")
        if name in out:
            raise CheckpointError(f"{key} and {out[name].key} are both {name} under ModelOpt's NVFP4 names "
                                  f"({src.producer} checkpoint)")
        out[name] = _Alias(key, inverted)
    return out


class ModeloptView:
    """A ``SafetensorsIndex`` under ModelOpt's NVFP4 names and convention (module docstring)."""

    def __init__(self, index, conv: Nvfp4Checkpoint):
        self.index = index
        self.conv = conv
        self._alias = _aliases(index.entries, conv)
        self.entries = {name: index.entries[a.key] for name, a in self._alias.items()}

    def __contains__(self, key: str) -> bool:
        return key in self._alias

    def stored_key(self, key: str) -> str:
        """The checkpoint's own name of ``key`` (a ModelOpt name)."""
        return self._alias[key].key

    def shape(self, key: str) -> tuple[int, ...]:
        return self.index.shape(self._alias[key].key)

    def _invert(self, key: str, value):
        try:
            return fp4.nvfp4_inverse_global(value)
        except ValueError as exc:
            raise CheckpointError(f"{self._alias[key].key}: {self.conv.names.producer} NVFP4 {exc}") from None

    def read_rows(self, key: str, begin: int, end: int, dst) -> None:
        """The index's ``read_rows`` of the stored tensor; an inverted global scale through a float32 staging tensor."""
        import torch

        alias = self._alias[key]
        if not alias.inverted:
            self.index.read_rows(alias.key, begin, end, dst)
            return
        staging = torch.empty(tuple(dst.shape), dtype=self.index.entries[alias.key].dtype)
        self.index.read_rows(alias.key, begin, end, staging)
        dst.copy_(self._invert(key, staging))

    def get(self, key: str, device=None):
        alias = self._alias[key]
        value = self.index.get(alias.key, device)
        return self._invert(key, value) if alias.inverted else value

    @property
    def bytes_read(self) -> int:
        return self.index.bytes_read

    @contextlib.contextmanager
    def reopened(self):
        """The index's ``reopened`` (issue #30's reload), yielding this view."""
        with self.index.reopened():
            yield self


def modelopt_view(index, qc: QuantConfig):
    """``index`` under ModelOpt's NVFP4 names: itself unless ``qc`` is NVFP4 stored under other names."""
    conv = qc.nvfp4
    if conv is None or conv.names == MODELOPT_NVFP4:
        return index
    return ModeloptView(index, conv)


__all__ = ["ModeloptView", "modelopt_view"]
