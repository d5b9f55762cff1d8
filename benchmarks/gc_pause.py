"""The Python collector's pauses during generation, with and without
`EngineConfig.freeze_gc` (CPU is enough: the pause is host work).

One process per setting (the freeze is process-wide): the embedded SmolLM2,
64 requests of 32 prompt tokens and 48 new tokens; every collection's
generation and duration from `gc.callbacks`.

    python3 benchmarks/gc_pause.py          # both settings, one line each
"""
from __future__ import annotations

import gc
import json
import subprocess
import sys
import time


def run(freeze: bool) -> dict:
    from detent.engine import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", freeze_gc=freeze, max_num_seqs=64)
    pauses, t0 = [], [0.0]

    def on_gc(phase, info):
        if phase == "start":
            t0[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], (time.perf_counter() - t0[0]) * 1e3))
    gc.callbacks.append(on_gc)
    llm.generate([{"prompt_token_ids": [1 + i, 2, 3, 4] * 8} for i in range(64)],
                 SamplingParams(max_tokens=48, ignore_eos=True, logprobs=1), use_tqdm=False)
    full = [ms for g, ms in pauses if g == 2]
    return {"freeze_gc": freeze, "frozen_objects": gc.get_freeze_count(), "collections": len(pauses),
            "gc_ms": round(sum(ms for _, ms in pauses), 1), "full_collections_ms": [round(ms, 1) for ms in full]}


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(run(sys.argv[1] == "1")))
    else:
        for flag in ("0", "1"):
            out = subprocess.run([sys.executable, __file__, flag], capture_output=True, text=True, check=True).stdout
            print(out.strip().splitlines()[-1])
