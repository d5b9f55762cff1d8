"""On-policy RL on Detent (docs/rl.md).

`grpo`: GRPO on a verifiable arithmetic task, engine and trainer colocated
on one device (the KV pool sized to leave room for training), once per
selection mode. Per step: reward mean, the fraction of completion tokens
whose trainer logprob == the rollout's, max |diff|, and the time split.
Writes JSON and a PNG (reward and match rate per step, pinned vs stock).

    python benchmarks/rl.py grpo --steps 200 --out results/rl_grpo.json
    python benchmarks/rl.py grpo --steps 3 --device cpu --dtype float32 --max-tokens 8 --out /tmp/rl.json

`shapes`: Llama-3.1-8B shapes with dummy weights (one H200): rollout time
per generated token pinned vs stock, and the trainer's forward + backward
per token against transformers' forward + backward on the same weights.

    python benchmarks/rl.py shapes --model llama-3.1-8b --out results/rl_shapes.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ------------------------------------------------------------------ grpo
def run_grpo(a) -> dict:
    from detent.engine import LLM
    from detent.rl import ArithmeticTask, GRPOConfig, train_grpo

    cfg = GRPOConfig(steps=a.steps, prompts_per_step=a.prompts_per_step, group_size=a.group_size,
                     max_tokens=a.max_tokens, temperature=a.temperature, lr=a.lr, kl_coef=a.kl_coef, seed=a.seed,
                     checkpoint_layers=a.checkpoint_layers)
    out = {"config": {**cfg.__dict__, "model": a.model or "embedded:SmolLM2-135M-Instruct", "dtype": a.dtype,
                      "device": a.device, "kv_cache_gb": a.kv_cache_gb}, "runs": {}}
    for sel in a.selections:
        llm = LLM(model=a.model, selection=sel, rl=True, dtype=a.dtype, device=a.device, max_model_len=512,
                  max_num_batched_tokens=4096, max_num_seqs=256, kv_cache_memory_bytes=int(a.kv_cache_gb * 2**30),
                  mixed_graph_max_tokens=a.mixed_graph_max_tokens)
        task = ArithmeticTask(llm.get_tokenizer(), max_operand=a.max_operand)

        out["runs"][sel] = {"steps": []}

        def show(log, sel=sel):
            out["runs"][sel]["steps"].append(log.as_dict())
            _write(out, a.out)  # after every step: a run cut short by a time limit keeps its log
            print(f"{sel:7s} step {log.step:4d} reward {log.reward_mean:.3f} match {log.match_rate:.4f} "
                  f"max|d| {log.max_abs_diff:.2e} tokens {log.num_tokens} rollout {log.rollout_s:.2f}s "
                  f"train {log.trainer_s:.2f}s sync {log.sync_s * 1e3:.1f}ms", flush=True)
        train_grpo(llm, task, cfg, on_step=show)
        logs = out["runs"][sel]["steps"]
        n = max(1, min(20, len(logs) // 4))
        out["runs"][sel].update({
            "every_step_matched": all(s["match_rate"] == 1.0 for s in logs),
            "min_match_rate": min(s["match_rate"] for s in logs),
            "mean_match_rate": statistics.mean(s["match_rate"] for s in logs),
            "reward_first": statistics.mean(s["reward_mean"] for s in logs[:n]),
            "reward_last": statistics.mean(s["reward_mean"] for s in logs[-n:]),
            "median_s": {k: statistics.median(s[k] for s in logs) for k in ("rollout_s", "trainer_s", "sync_s")},
        })
        print(json.dumps({k: v for k, v in out["runs"][sel].items() if k != "steps"}), flush=True)
        llm.llm_engine.shutdown()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def _write(out: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, indent=1)
    os.replace(tmp, path)


def plot_grpo(out: dict, path: str) -> None:
    import matplotlib  # a bench/test extra: imported only here
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for sel, run in out["runs"].items():
        steps = [s["step"] for s in run["steps"]]
        ax1.plot(steps, [s["reward_mean"] for s in run["steps"]], label=sel)
        ax2.plot(steps, [s["match_rate"] for s in run["steps"]], label=sel)
    ax1.set_ylabel("reward mean")
    ax2.set_ylabel("trainer == rollout\n(fraction of tokens)")
    ax2.set_xlabel("GRPO step")
    ax1.legend()
    ax1.set_title(f"GRPO on {out['config']['model']} ({out['config']['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------ shapes
def rollout_time_per_token(llm, vocab: int, batch: int, prompt_len: int, max_tokens: int) -> float:
    from detent.sampling.params import SamplingParams
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(2, vocab, (prompt_len,), generator=g).tolist()}
               for _ in range(batch)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
              for i in range(batch)]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm up
    llm.reset_prefix_cache()
    _sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync()
    return (time.perf_counter() - t) / sum(len(o.outputs[0].token_ids) for o in outs)


def _timed(fn, reps: int = 3) -> float:
    fn()  # warm up
    ts = []
    for _ in range(reps):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def run_shapes(a) -> dict:
    from gpu_engine import build, set_mode

    from detent.engine.train_model import TrainerModel
    from detent.models.presets import preset

    hf_config = json.load(open(a.config_json)) if a.config_json else preset(a.model)["config"]
    cuda = a.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    llm, mc, info = build(a.model, max_model_len=8192, max_num_seqs=128, max_num_batched_tokens=a.max_num_batched_tokens,
                          gpu_memory_utilization=a.gpu_memory_utilization, hf_config=hf_config, device=a.device,
                          dtype=dtype)
    out = {"engine": info, "rollout_s_per_token": {}}
    for mode in ("stock", "pinned"):
        set_mode(llm, mode, graphs=cuda)
        out["rollout_s_per_token"][mode] = rollout_time_per_token(llm, mc.vocab_size, a.rollout_batch, a.prompt_len, a.gen_len)
        print(mode, "rollout s/token", out["rollout_s_per_token"][mode], flush=True)
    out["rollout_pinned_over_stock"] = out["rollout_s_per_token"]["pinned"] / out["rollout_s_per_token"]["stock"]

    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(2, mc.vocab_size, (a.train_len,), generator=g).tolist() for _ in range(a.train_seqs)]
    trainer = TrainerModel(llm, share_weights=True, checkpoint_layers=True, logprob_chunk=1024)

    def detent_step():
        trainer.zero_grad(set_to_none=True)
        sum(lp.sum() for lp in trainer(seqs)).backward()
    out["trainer_fwd_bwd_s"] = _timed(detent_step)
    out["trainer_peak_bytes"] = torch.cuda.max_memory_allocated() if cuda else None
    trainer.zero_grad(set_to_none=True)
    ref = _hf_model(hf_config, trainer, a.device, dtype)
    ids = torch.tensor(seqs, device=a.device)

    def hf_step():
        ref.zero_grad(set_to_none=True)
        logits = ref(ids).logits[:, :-1].float()
        torch.log_softmax(logits, -1).gather(2, ids[:, 1:, None]).sum().backward()
    out["transformers_fwd_bwd_s"] = _timed(hf_step)
    out["tokens"] = tokens = a.train_seqs * a.train_len
    out["max_num_batched_tokens"] = a.max_num_batched_tokens
    out["trainer_s_per_token"] = out["trainer_fwd_bwd_s"] / tokens
    out["transformers_s_per_token"] = out["transformers_fwd_bwd_s"] / tokens
    out["trainer_over_transformers"] = out["trainer_fwd_bwd_s"] / out["transformers_fwd_bwd_s"]
    print(json.dumps({k: v for k, v in out.items() if k != "engine"}), flush=True)
    return out


def _hf_model(hf_config: dict, trainer, device: str, dtype: torch.dtype):
    """transformers' model on the trainer's weights (gradient checkpointing, sdpa attention)."""
    import transformers as tf
    cfg = tf.AutoConfig.for_model(**{k: v for k, v in hf_config.items() if k != "architectures"})
    with torch.device(device):
        ref = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    missing, unexpected = ref.load_state_dict(dict(trainer.checkpoint_tensors()), strict=False)
    if unexpected or [m for m in missing if not m.startswith("lm_head")]:
        raise RuntimeError(f"transformers model does not take the trainer's weights: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    ref.gradient_checkpointing_enable()
    ref.train()
    return ref


def main(argv=None) -> None:
    p = argparse.ArgumentParser("benchmarks/rl.py")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grpo")
    g.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    g.add_argument("--selections", nargs="+", default=["pinned", "stock"])
    g.add_argument("--steps", type=int, default=200)
    g.add_argument("--prompts-per-step", type=int, default=16)
    g.add_argument("--group-size", type=int, default=8)
    g.add_argument("--max-tokens", type=int, default=12)
    g.add_argument("--max-operand", type=int, default=10)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--lr", type=float, default=1e-5)
    g.add_argument("--kl-coef", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--device", default="auto")
    g.add_argument("--kv-cache-gb", type=float, default=4.0, help="the engine's KV pool (the rest trains)")
    g.add_argument("--checkpoint-layers", action="store_true")
    g.add_argument("--mixed-graph-max-tokens", type=int, default=2048,
                   help="the engine's whole-step graphs (0: off; lease 14's H200 run used 0, docs/rl.md)")
    g.add_argument("--out", required=True)
    pl = sub.add_parser("plot", help="redraw a grpo run's PNG from its JSON (e.g. one a time limit cut short)")
    pl.add_argument("--out", required=True, help="the grpo run's JSON")
    s = sub.add_parser("shapes")
    s.add_argument("--model", default="llama-3.1-8b")
    s.add_argument("--rollout-batch", type=int, default=64)
    s.add_argument("--prompt-len", type=int, default=512)
    s.add_argument("--gen-len", type=int, default=128)
    s.add_argument("--train-seqs", type=int, default=2)
    s.add_argument("--train-len", type=int, default=4096)
    s.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="the engine's token budget; below --train-len the trainer scores each sequence in chunks")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.35)
    s.add_argument("--device", default="cuda")
    s.add_argument("--config-json", default=None, help="an HF config.json instead of the preset's (smoke runs)")
    s.add_argument("--out", required=True)
    a = p.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    if a.cmd == "plot":
        plot_grpo(json.load(open(a.out)), os.path.splitext(a.out)[0] + ".png")
        return
    if a.cmd == "grpo":
        out = run_grpo(a)
        _write(out, a.out)
        plot_grpo(out, os.path.splitext(a.out)[0] + ".png")
    else:
        out = run_shapes(a)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    print("wrote", a.out, flush=True)


if __name__ == "__main__":
    main()
