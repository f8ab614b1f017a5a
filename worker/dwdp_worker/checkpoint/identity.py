"""A checkpoint's identity, cheap enough to take before loading: what a replacement rank must match to join a
running elastic group (``dwdp_runtime.elastic.records.GroupFingerprint``'s ``checkpoint`` part).

The digest covers ``config.json`` (the architecture and its quantization), ``hf_quant_config.json`` when present,
and per safetensors file its name, size, header (tensor names, dtypes, shapes, offsets) and the first and last
``SAMPLE_BYTES`` of its data — so another model, another quantization or another fine-tune of the same shapes
differs, while reading kilobytes per file, not gigabytes (a replacement must not re-read what it is about to load).

Invariant: the same files give the same digest on every host (paths do not enter it, only names under the
directory), so pods mounting one checkpoint at different paths agree.
"""

from __future__ import annotations

import hashlib
import pathlib
import struct

#: data bytes sampled at each end of every safetensors file: enough to tell two trainings of the same shapes apart
SAMPLE_BYTES = 64 << 10
#: the json files whose whole text is part of the identity
JSON_FILES = ("config.json", "hf_quant_config.json")
_HEADER_LEN = struct.Struct("<Q")


def checkpoint_digest(model_dir) -> str:
    """Hex digest of the checkpoint in ``model_dir`` (module docstring)."""
    root = pathlib.Path(model_dir)
    h = hashlib.sha256()
    for name in JSON_FILES:
        path = root / name
        if path.exists():
            h.update(f"{name}\0".encode() + path.read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            (n,) = _HEADER_LEN.unpack(f.read(_HEADER_LEN.size))
            h.update(f.read(min(n, max(0, size - _HEADER_LEN.size))))
            data = _HEADER_LEN.size + n
            f.seek(data)
            h.update(f.read(SAMPLE_BYTES))
            f.seek(max(data, size - SAMPLE_BYTES))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()[:32]
