"""The math: pure functions over static configs and pytrees (config, params, model, ops, the fusion
plan, caches, sampling): what is computed, and by which kernel. Imports gguf_blocks and pallas_kernels
only; the only layer that may name a kernel."""
