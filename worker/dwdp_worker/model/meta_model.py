"""The model of a checkpoint's config on the meta device: the shape of every tensor, no storage.

One builder for the loader (which then fills in this rank's tensors), the model registry (which
discovers the experts layout from it) and the FP8 checkpoint writer. Its own module so that the
registry and the loader both import it without importing each other.
"""

from __future__ import annotations


def build_meta_model(config, dtype):
    """The model on the meta device with the kernels ``from_pretrained`` would select."""
    import torch

    from .layers_impl import install_dtype_keeping_norms
    from .synth_config import serving_auto_class

    with torch.device("meta"):
        model = serving_auto_class(config).from_config(config, dtype=dtype)
    model.eval()
    install_dtype_keeping_norms(model)   # float32-kept norms cast back to the model's dtype (transformers 5.17)
    return model
