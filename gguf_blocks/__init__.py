"""GGUF block-quantized tensors on the device: the `QTensor` pytree leaf, the block layouts and
their planar device layout (formats), bit-exact dequantizers (reference), quantize-on-load
(quantize), and the int32-word view of the planes the GPU kernels read (words).

The layer under both the kernels (pallas_kernels) and the engine (rjax): it imports neither.
"""
