"""The engine: the jitted device programs (prefill, decode loops, slot batches, speculative rounds),
their compilation, and what they need of the device's memory and bandwidth. Imports rjax.loading,
rjax.math and gguf_blocks."""
