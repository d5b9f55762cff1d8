"""Kernel candidates, one module per family, each registered by name.

Importing this package registers every candidate that can run here: the
torch candidates always, the Triton ones when triton and a CUDA device (or
TRITON_INTERPRET=1) are available. Only selection/ imports kernels/.
"""
from detent.kernels import act, allreduce, attention, embedding, gemm, logsoftmax, moe, norm, rope  # noqa: F401
