"""Tiny-model engines for the sampling tests: a dummy-weight Llama over the
real models/ code, a character tokenizer whose `raw_vocab` xgrammar reads,
and the comparator (token lists with ==, logprob tensors with torch.equal)."""
from __future__ import annotations

import string
from dataclasses import dataclass
from functools import lru_cache

import torch

from detent.engine import LLM

SPECIALS = ["<s>", "</s>"]  # BOS 0, EOS 1
CHARS = list('{}":,[] ()+-.') + list(string.digits) + list(string.ascii_lowercase) + list(string.ascii_uppercase)


def raw_vocab(vocab: int) -> list[str]:
    base = SPECIALS + CHARS  # 77 entries
    multi = ["true", "false", "null", "ab", "12", "00", "ok", '":', '",', "{\"", "\"}"]
    out = (base + multi + [f"<pad{i}>" for i in range(vocab)])[:vocab]
    assert len(set(out)) == vocab
    return out


class CharTokenizer:
    """Token id i <-> raw_vocab[i]; greedy longest-match encoding. EOS = 1."""
    eos_token_id = 1
    chat_template = None

    def __init__(self, vocab: int):
        self.raw_vocab = raw_vocab(vocab)
        self._ids = {t: i for i, t in enumerate(self.raw_vocab)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for n in (5, 4, 3, 2, 1):
                if text[i:i + n] in self._ids and not text[i:i + n].startswith("<"):
                    ids.append(self._ids[text[i:i + n]])
                    i += n
                    break
            else:
                i += 1
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(self.raw_vocab[i] for i in ids
                       if not (skip_special_tokens and (i < 2 or self.raw_vocab[i].startswith("<pad"))))


def tiny_config(vocab: int):
    from detent.models import ModelConfig
    return ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
        "eos_token_id": 1, "torch_dtype": "float32"})


@lru_cache(maxsize=4)
def tiny_model(vocab: int, seed: int = 0):
    from detent.models import load_model
    mc = tiny_config(vocab)
    model = load_model(mc, device="cpu", dtype="float32", load_format="dummy", seed=seed)
    with torch.no_grad():  # dummy logits are nearly flat: sharpen them so truncation matters
        model.lm_head.weight.mul_(LOGIT_SCALE)
    return model, mc


LOGIT_SCALE = 12.0


def tiny_llm(vocab: int = 64, selection: str = "pinned", **kw) -> LLM:
    model, mc = tiny_model(vocab)
    args = dict(device="cpu", selection=selection, max_model_len=256, num_gpu_blocks=400,
                max_num_seqs=64, max_num_batched_tokens=512, max_logprobs=64)
    args.update(kw)
    return LLM.from_model(model, mc, CharTokenizer(vocab), **args)


@dataclass(frozen=True)
class Result:
    token_ids: list[int]
    logprobs: torch.Tensor  # chosen-token logprobs
    top_ids: torch.Tensor  # per position: ids of the logprob dict (chosen first, then top-k), padded -1
    top_logprobs: torch.Tensor
    num_cached_tokens: int
    num_preemptions: int
    text: str
    finish_reason: str | None


def result_of(out, index: int = 0, k: int = 5) -> Result:
    c = out.outputs[index]
    chosen, ids, lps = [], [], []
    for tok, pos in zip(c.token_ids, c.logprobs or []):
        chosen.append(pos[tok].logprob)
        row = list(pos.items())[:k + 1]
        row += [(-1, None)] * (k + 1 - len(row))
        ids.append([i for i, _ in row])
        lps.append([float("-inf") if lp is None else lp.logprob for _, lp in row])
    return Result(list(c.token_ids), torch.tensor(chosen), torch.tensor(ids, dtype=torch.long),
                  torch.tensor(lps), out.num_cached_tokens,
                  out.metrics.num_preemptions if out.metrics else 0, c.text, c.finish_reason)


def same(a: Result, b: Result) -> bool:
    return (a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)
            and torch.equal(a.top_ids, b.top_ids) and torch.equal(a.top_logprobs, b.top_logprobs))
