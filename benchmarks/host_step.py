"""Host time of one engine step, without the model: what the scheduler, the
runner's input preparation, the sampler's host side, the output processor
and the engine core's delta encoding cost per step at a given batch.

On the GPU these run while the device computes the previous step (async
scheduling); once they take longer than a device step, the device waits.
Under load at batch 128 the H200 profile showed 8.3 ms of host time per
decode step against a device step of about 9 ms (docs/performance.md,
"Serving under load"), so they set the pace there.

The model here does no work (`NullModel`: zeros for hidden states, fixed
logits), so the time measured is the engine's own. CPU time of this process
(`time.process_time`), so other load on the machine counts less. Writes JSON.

    python benchmarks/host_step.py --batch 128 --prompt 1024 --steps 100 --out host_step.json
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pickle
import pstats
import time

import torch


class NullModel(torch.nn.Module):
    """Follows the model contract (docs/architecture.md, "Model") and computes nothing."""

    def __init__(self, vocab: int, hidden: int = 8):
        super().__init__()
        self.hidden = hidden
        self.logits = torch.nn.Parameter(torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)),
                                         requires_grad=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], self.hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits.expand(hidden.shape[0], -1).contiguous()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, 1, 8)


def _room(args) -> int:
    """Tokens a request may generate: the measured steps plus those it decodes while the others'
    prompts fill (one budget of prompt tokens per step), so that the batch stays whole throughout."""
    return args.steps + args.batch * args.prompt // max(8192, args.prompt) + 64


def build(args):
    from detent.engine import LLM
    from detent.models import ModelConfig
    room = _room(args)
    mc = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                              "vocab_size": args.vocab, "hidden_size": 8, "intermediate_size": 16,
                              "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
                              "head_dim": 8, "max_position_embeddings": args.prompt + room,
                              "eos_token_id": 1, "torch_dtype": "float32"})
    blocks = args.batch * ((args.prompt + room) // 16 + 2)
    return LLM.from_model(NullModel(args.vocab), mc, None, device="cpu", max_model_len=args.prompt + room,
                          num_gpu_blocks=blocks, max_num_seqs=max(args.batch, 1),
                          max_num_batched_tokens=max(8192, args.prompt)).llm_engine


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--logprobs", type=int, default=None)
    ap.add_argument("--no-freeze", action="store_true",
                    help="leave the startup heap in the garbage collector's scans (the core freezes it)")
    ap.add_argument("--profile", type=int, default=0, help="print the N functions with the most own time")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from detent.engine import SamplingParams
    from detent.engine.core_process import DeltaEncoder

    eng = build(args)
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=_room(args), ignore_eos=True,
                            logprobs=args.logprobs)
    for i in range(args.batch):
        eng.add_request(f"r{i}", [2 + (i * 131 + j) % (args.vocab - 2) for j in range(args.prompt)], params)
    while any(r.is_prefill for r in eng.scheduler.requests.values()) or not eng.scheduler.running:
        eng.step()
    eng.outputs.share_lists = True  # as in the engine core: each step's outputs are encoded before the next
    if not args.no_freeze:
        from detent.engine.core_process import freeze_startup_heap
        freeze_startup_heap()  # as the engine core does once it is built
    enc = DeltaEncoder()
    step_s = encode_s = 0.0
    host0 = eng.host_time()  # the step loop's own split of its time
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    for _ in range(args.steps):
        assert len(eng.scheduler.running) == args.batch, "a request finished while measured"
        t0 = time.process_time()
        outs = eng.step()
        t1 = time.process_time()
        pickle.dumps([enc.encode(o) for o in outs], protocol=pickle.HIGHEST_PROTOCOL)
        t2 = time.process_time()
        step_s += t1 - t0
        encode_s += t2 - t1
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
    res = {"batch": args.batch, "prompt": args.prompt, "steps": args.steps, "logprobs": args.logprobs,
           "frozen_heap": not args.no_freeze,
           "engine_step_ms": 1e3 * step_s / args.steps, "encode_ms": 1e3 * encode_s / args.steps,
           "host_ms_per_step": {k: 1e3 * (v - host0[k]) / args.steps for k, v in eng.host_time().items()}}
    print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
