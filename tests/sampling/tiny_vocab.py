"""A tiny raw vocabulary (48 tokens) for grammar tests without a real tokenizer."""
from __future__ import annotations

import string

import xgrammar as xgr

from detent.sampling.grammar import GrammarCompilerCache

EOS = 0
VOCAB = (["</s>"] + list(string.ascii_lowercase[:16]) + list(string.digits)
         + ["{", "}", '"', ":", ",", " ", "a1", "b2", "ab", "12", "[", "]", "x", "y", "z", "-", "\n", ".", "true", "false", "null"])
assert len(VOCAB) == 48, len(VOCAB)
V = len(VOCAB)


def tiny_info(vocab_size: int = V) -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[EOS])


def tiny_cache(vocab_size: int = V, **kw) -> GrammarCompilerCache:
    return GrammarCompilerCache(info=tiny_info(vocab_size), **kw)


def decode(ids) -> str:
    return "".join(VOCAB[i] for i in ids if i != EOS)
