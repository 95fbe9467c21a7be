"""Lower a Pallas-Triton kernel on CPU for sm_90 and write its Triton IR (TTIR) per pallas_call."""
import sys, warnings
from unittest import mock
import jax, jax.numpy as jnp
from jax._src.pallas.triton import gpu_info, lowering
sys.path.insert(0, ".")
out_prefix = sys.argv[1]
captured = []
orig = lowering.lower_jaxpr_to_triton_module
def capture(*a, **k):
    r = orig(*a, **k)
    captured.append(r.module.operation.get_asm(enable_debug_info=False))
    return r
lowering.lower_jaxpr_to_triton_module = capture
from gguf import GGMLQuantizationType as QType
from pallas_kernels.quant_matmul import int8_gemv, gemv
from pallas_kernels.int8_activations import QuantizedX
from rjax.quant.reference import q4_k_chunks
from pallas_kernels.quant_matmul.testing import random_qtensor
h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
n, k = (int(v) for v in sys.argv[2].split("x")) if len(sys.argv) > 2 else (14336, 4096)
w = random_qtensor(QType.Q4_K, 1, k)
w = q4_k_chunks(jax.tree.map(jnp.asarray, w))
w = type(w)(jax.tree.map(lambda a: jax.ShapeDtypeStruct((n,) + a.shape[1:], a.dtype), w.planes), QType.Q4_K, (n, k))
cfg = gemv.default_int8_config(QType.Q4_K, 1, n, k)
xq = jax.eval_shape(lambda x: int8_gemv.quantize_x(x), jax.ShapeDtypeStruct((1, k), jnp.bfloat16))
with warnings.catch_warnings(), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
    warnings.simplefilter("ignore")
    jax.jit(int8_gemv.int8_gemv, static_argnames=("cfg", "interpret")).trace(xq, w, cfg).lower(lowering_platforms=("cuda",))
for i, m in enumerate(captured):
    open(f"{out_prefix}{i}.ttir", "w").write(m)
print(cfg, len(captured), "modules")
