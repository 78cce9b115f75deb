"""GGUF files without llama.cpp: the header reader, model info and VRAM plans, router weights,
and the synthetic model writer (presets, random quantized tensors) used for fixtures."""
