"""What DWDP does to a `transformers` model: expert discovery and layout, the kernels bound into it, packing. README.md."""
