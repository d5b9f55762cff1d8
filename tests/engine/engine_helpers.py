"""Shared pieces of the engine tests: the three test models, an LLM over an
already loaded model, a target request and how its result is compared.

Comparator (stated): token ids with `==` on lists;
chosen-token logprobs, top-5 ids and top-5 logprobs with `torch.equal` on
tensors. Never a metric that can be 0 for unequal values."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from detent.engine import LLM, SamplingParams

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 160,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "eos_token_id": 1,
              "torch_dtype": "float32"}
TINY_QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 160,
                  "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                  "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "eos_token_id": 1,
                  "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "norm_topk_prob": True, "torch_dtype": "float32"}


@dataclass(frozen=True)
class Bundle:
    name: str
    model: torch.nn.Module
    config: object
    tokenizer: object


def tiny_bundle(name: str) -> Bundle:
    from detent.models import ModelConfig, load_model
    raw = {"llama": TINY_LLAMA, "qwen3_moe": TINY_QWEN3_MOE}[name]
    mc = ModelConfig.from_hf(raw)
    return Bundle(name, load_model(mc, device="cpu", dtype="float32", load_format="dummy", seed=0), mc, None)


def smollm2_bundle() -> Bundle:
    llm = LLM(device="cpu", max_model_len=256, num_gpu_blocks=17)
    eng = llm.llm_engine
    return Bundle("smollm2", eng.runner.model, eng.model_config, eng.tokenizer)


_BUNDLES: dict[str, Bundle] = {}


def bundle(name: str) -> Bundle:
    """The test model `name` ("llama", "qwen3_moe", "smollm2"), loaded once per session."""
    if name not in _BUNDLES:
        _BUNDLES[name] = smollm2_bundle() if name == "smollm2" else tiny_bundle(name)
    return _BUNDLES[name]


def make_llm(b: Bundle, selection: str = "pinned", **kw) -> LLM:
    args = dict(device="cpu", selection=selection, max_model_len=256, num_gpu_blocks=200,
                max_num_seqs=64, max_num_batched_tokens=512)
    args.update(kw)
    return LLM.from_model(b.model, b.config, b.tokenizer, **args)


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(2, vocab) for _ in range(n)]


def target_params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True)


@dataclass(frozen=True)
class Result:
    token_ids: list[int]
    logprobs: torch.Tensor  # [16] chosen-token logprob
    top_ids: torch.Tensor  # [16, 6]: the chosen token, then the top-5 (padded with -1)
    top_logprobs: torch.Tensor  # [16, 6] (padded with -inf)
    num_cached_tokens: int = 0
    num_preemptions: int = 0


def result_of(out) -> Result:
    """Chosen logprobs, and per position the logprob dict (chosen token first,
    then the top-5) as padded tensors of ids and logprobs."""
    c = out.outputs[0]
    chosen, ids, lps = [], [], []
    for tok, pos in zip(c.token_ids, c.logprobs):
        chosen.append(pos[tok].logprob)
        row = list(pos.items())[:6]
        row += [(-1, None)] * (6 - len(row))
        ids.append([i for i, _ in row])
        lps.append([float("-inf") if lp is None else lp.logprob for _, lp in row])
    return Result(list(c.token_ids), torch.tensor(chosen), torch.tensor(ids), torch.tensor(lps),
                  out.num_cached_tokens, out.metrics.num_preemptions if out.metrics else 0)


def same(a: Result, b: Result) -> bool:
    return (a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)
            and torch.equal(a.top_ids, b.top_ids) and torch.equal(a.top_logprobs, b.top_logprobs))


def generate_target(llm: LLM, target: list[int], others: list[list[int]] = (), row: int | None = None,
                    other_max_tokens: list[int] | None = None) -> Result:
    """Run `target` with `others` added around it (the target is the `row`-th
    request added; default last) and return the target's result."""
    others = list(others)
    row = len(others) if row is None else row
    prompts = others[:row] + [target] + others[row:]
    mts = other_max_tokens or [4 + (7 * i) % 17 for i in range(len(others))]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in mts]
    params = params[:row] + [target_params()] + params[row:]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return result_of(outs[row])


def summary(out) -> tuple:
    """A request's whole output, comparable with `==`: per completion its token ids,
    finish and stop reasons, text and logprobs (id, float32 value as a Python float,
    rank), then its prompt logprobs and error."""
    rows = []
    for c in out.outputs:
        lps = None if c.logprobs is None else [sorted((t, lp.logprob, lp.rank) for t, lp in d.items())
                                              for d in c.logprobs]
        rows.append((c.token_ids, c.finish_reason, c.stop_reason, c.text, lps))
    plps = None if out.prompt_logprobs is None else [
        None if d is None else sorted((t, lp.logprob, lp.rank) for t, lp in d.items()) for d in out.prompt_logprobs]
    return rows, plps, out.error


class ByteTokenizer:
    """Token i <-> chr(32 + i); ids 0, 1 are special (BOS, EOS). Enough for stop strings."""

    eos_token_id = 1
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [min(max(ord(c) - 32, 2), 159) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(32 + i) for i in ids if not (skip_special_tokens and i < 2))


def text_llm(selection: str = "pinned", **kw) -> LLM:
    """The tiny Llama with the byte tokenizer (text prompts, stop strings)."""
    b = bundle("llama")
    return make_llm(Bundle("llama", b.model, b.config, ByteTokenizer()), selection, **kw)


def failing_launch(runner, at: int, error: BaseException):
    """A stand-in for `runner.launch` that raises `error` at its `at`-th call (1-based) and
    launches as the runner does otherwise: set it with monkeypatch."""
    real, calls = runner.launch, [0]

    def launch(plan, prev=None):
        calls[0] += 1
        if calls[0] == at:
            raise error
        return real(plan, prev)
    return launch
