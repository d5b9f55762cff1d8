"""All-reduce: engines pick the algorithm by message bytes and world size
(vLLM/SGLang custom all-reduce: one-shot for small messages, two-shot for
larger ones, within the custom buffer). Detent's algorithms all sum in a
fixed rank order; pinning the algorithm makes the choice batch-invariant.
On CPU the stock path is the library all-reduce (`native`).
"""
from detent.selection.compiler.lang import Fact, Runtime, assume, require  # noqa: F401

ONE_SHOT_MAX = {2: 512 * 1024, 4: 256 * 1024, 8: 128 * 1024}
BUFFER_BYTES = 512 * 1024 * 1024  # kernels/allreduce.py _MAX_WORKSPACE (DETENT_SYMM_MEM_MAX_BYTES default)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def select(device: Fact[str], stock_kernels: Fact[bool], world_size: Fact[int], dtype: Fact[str],
           hidden: Fact[int], max_num_batched_tokens: Fact[int], message_bytes: Runtime[int]):
    assume(0 <= message_bytes <= max_num_batched_tokens * hidden * DTYPE_BYTES[dtype],
           "a message larger than max_num_batched_tokens rows of hidden")
    if device == "cpu":
        if stock_kernels:
            return {"impl": "native"}
        return {"impl": "ordered_gather"}
    limit = ONE_SHOT_MAX[world_size] if world_size in ONE_SHOT_MAX else 0
    algo = "one_shot" if message_bytes <= limit else "two_shot"
    require(message_bytes <= BUFFER_BYTES, "message exceeds the custom all-reduce buffer")
    return {"impl": algo}


def conservative(device: Fact[str]):
    if device == "cpu":
        return {"impl": "ordered_gather"}
    return {"impl": "two_shot"}
