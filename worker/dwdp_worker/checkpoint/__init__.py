"""Checkpoints: safetensors indexes, tensor names, a rank's share loaded onto the meta model, synthetic writers. README.md."""
