"""Detent's side of benchmarks/compare_vllm.py: one process, one weights load
(benchmarks/gpu_engine.build: load_format="dummy", i.e. norms 1, biases 0,
matrices N(0, 0.02)), then per selection mode (gpu_engine.set_mode, decode
CUDA graphs recaptured on the GPU) the parts of one group, measured by
benchmarks/common_side.py through LLM.generate. The prefix cache is reset
at every mode switch: no mode sees KV another mode computed.

    python3 benchmarks/detent_side.py SPEC_JSON     (started by compare_vllm.py)
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common_side as cs  # noqa: E402
from compare_vllm import record  # noqa: E402


class DetentSide:
    def __init__(self, llm):
        from detent.engine import SamplingParams
        self.llm, self.SP = llm, SamplingParams

    def generate(self, prompts, max_tokens, logprobs):
        sp = self.SP(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def main(spec: dict) -> None:
    import torch
    from gpu_engine import build, set_mode

    cuda = spec["device"] == "cuda"
    args = spec["engine_args"]
    llm, _, info = build(spec["model"], hf_config=spec["hf_config"], device=spec["device"],
                          dtype=torch.bfloat16 if cuda else torch.float32, seed=0, **args)
    meta = {"device_name": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "weights": "gpu_engine.build load_format=dummy: norms 1, biases 0, matrices N(0, 0.02)",
            "weight_bytes": info["weight_bytes"], "kv_pool_tokens": info["kv_pool_tokens"]}
    print(json.dumps({"info": info}), flush=True)
    side = DetentSide(llm)
    for mode in spec["modes"]:
        mode_info = set_mode(llm, mode, graphs=spec.get("graphs", "decode") if cuda else False)
        if not llm.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache refused: requests still hold blocks")
        print(f"[detent {mode}] {mode_info}", flush=True)
        m = {**meta, "mode_info": mode_info}
        log = lambda s, mode=mode: print(f"[detent {mode}] {s}", flush=True)  # noqa: E731
        for part in spec["parts"]:
            r = cs.measure_part(side, spec, part, log=log)
            record(spec, mode, part, r, m)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
