"""Kernel candidates, one module per family, each registered by name.

Importing this package registers every candidate that can run here: the
torch candidates always, the Triton ones when triton and a CUDA device (or
TRITON_INTERPRET=1) are available, FlashAttention-4 (`attention_fa4`) when the
`fa4` extra is installed on an sm90+ GPU, DeepGEMM's bf16 GEMM (`gemm_deepgemm`) when the
`deepgemm` extra is installed on an sm90 GPU. Only selection/ imports kernels/ (and every
module here imports nothing of ours but kernels/registry.py and its siblings).
"""
from detent.kernels import (act, allreduce, attention, embedding, gemm, gumbel, logsoftmax, moe, norm,  # noqa: F401
                            nucleus, rope)
from detent.kernels import attention_fa4  # noqa: F401  (registers `fa4` only where it runs; else says why)
from detent.kernels import gemm_deepgemm  # noqa: F401  (registers `deepgemm` only where it runs; else says why)

try:  # Triton candidates: registered whenever triton imports (run on CUDA, or CPU under TRITON_INTERPRET=1)
    import triton as _triton  # noqa: F401
except ImportError:
    _triton = None
if _triton is not None:
    from detent.kernels import (attention_triton, gemm_triton, gumbel_triton, moe_triton,  # noqa: F401
                                nucleus_triton, rowwise_triton)
