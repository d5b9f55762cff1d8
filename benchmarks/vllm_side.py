"""vLLM's side of benchmarks/compare_vllm.py: one process per (mode, part
group), because vLLM cannot share the GPU with Detent or with a second vLLM
engine in one process. Imports vllm only here, never Detent.

    PYTHONPATH=/tmp/vsite python3 benchmarks/vllm_side.py SPEC_JSON   (started by compare_vllm.py)

As the vLLM peer bundle's bench.py and cells.py: VLLM_ENABLE_V1_MULTIPROCESSING=0,
VLLM_USE_FLASHINFER_SAMPLER=0, mode "bi" sets VLLM_BATCH_INVARIANT=1 before
vllm is imported; the model is a config.json written from Detent's preset
(same shapes, rope and vocabulary as Detent's), load_format="dummy",
skip_tokenizer_init, bf16, seed 0. vLLM's dummy weights (uniform +-1e-3) are
then re-initialised in place with `llm.apply_model(reinit)` — every 1-D
parameter (the norms; these models have no biases) to 1, every other
parameter (projections, embeddings, lm_head, router, stacked experts) to
N(0, 0.02) — before anything is measured, timing runs included.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common_side as cs  # noqa: E402
from compare_vllm import record  # noqa: E402


def reinit(model) -> int:
    """cells.py's re-initialisation: norms 1, matrices N(0, 0.02)."""
    import torch
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return sum(p.numel() for p in model.parameters())


def write_model_dir(model: str, hf_config: dict) -> str:
    d = f"/tmp/detent_cmp_vllm/{model}"
    os.makedirs(d, exist_ok=True)
    cfg = dict(hf_config)
    cfg.setdefault("hidden_act", "silu")
    with open(f"{d}/config.json", "w") as f:
        json.dump(cfg, f, indent=1)
    return d


class VllmSide:
    def __init__(self, llm, sampling_params):
        self.llm, self.SP = llm, sampling_params

    def generate(self, prompts, max_tokens, logprobs):
        sp = self.SP(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, logprobs=logprobs)
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def main(spec: dict) -> None:
    (mode,) = spec["modes"]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if mode == "bi":
        os.environ["VLLM_BATCH_INVARIANT"] = "1"
    else:
        os.environ.pop("VLLM_BATCH_INVARIANT", None)
    d = write_model_dir(spec["model"], spec["hf_config"])
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
              **spec["engine_args"])
    init_s = time.time() - t0
    n = llm.apply_model(reinit)
    print(f"[vllm {mode}] init {init_s:.0f} s; re-initialised {n} parameters (norms 1, N(0, 0.02))", flush=True)
    meta = {"device_name": torch.cuda.get_device_name(), "torch": torch.__version__, "vllm": vllm.__version__,
            "init_s": init_s, "reinit_params": n,
            "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
            "weights": "load_format=dummy, then apply_model(reinit): 1-D params 1, others N(0, 0.02)"}
    side = VllmSide(llm, SamplingParams)
    log = lambda s: print(f"[vllm {mode}] {s}", flush=True)  # noqa: E731
    for part in spec["parts"]:
        r = cs.measure_part(side, spec, part, log=log)
        record(spec, mode, part, r, meta)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
