"""SamplingParams and StructuredOutputs, with vLLM's names, validated at construction.

Every invalid value raises ValueError naming the field and the allowed range.
Token-id fields can only be checked against a vocabulary by the engine:
`SamplingParams.verify_vocab(vocab_size)`.

Semantics (documented in sampling/README.md-style here, tested in tests/sampling):
- greedy: temperature < 1e-5 (vLLM's epsilon) -> argmax, ties to the lowest id.
- top_k <= 0 disables top-k (vLLM accepts -1 and 0); top_k < -1 is an error.
- logprobs_mode "raw" (default): log_softmax of the model's logits;
  "processed": log_softmax of the logits actually sampled from (after
  penalties, temperature, top-k/top-p/min-p and the grammar mask);
  "raw_logits" / "processed_logits" report those logits themselves (vLLM's
  modes; "raw_logprobs" / "processed_logprobs" are accepted as aliases).
- golden_token_ids (Detent extension): the first len(golden_token_ids)
  output tokens are these ids whatever the model says (teacher forcing); the
  reported logprobs are the model's along that continuation. At most
  max_tokens of them: the ids past it could never be emitted, so a longer
  list is an error rather than silently cut.
- seed: any int in [-2**63, 2**64); negative seeds are taken mod 2**64.

Every numeric field has an upper bound as well as a lower one, so nothing a
request sends can overflow a tensor (a top_k of 2**70 overflowed an int64 in
the sampler and failed every request of the step) or leave float32's range
(a temperature of 1e39 is inf there, and -inf / inf is NaN). The bounds are
wide: no useful value is refused.
"""
from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator, Sequence

import numpy as np

SAMPLING_EPS = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)
MAX_INT32 = 2**31 - 1  # top_k, token ids, token counts: any vocabulary and context is smaller
MAX_TEMPERATURE = 1e4  # logits / temperature stays finite and normal in float32 down to SAMPLING_EPS
REPETITION_PENALTY_RANGE = (1e-4, 1e4)  # logits x or / the penalty stays finite in float32
_LOGPROBS_MODES = {"raw": "raw", "processed": "processed", "raw_logprobs": "raw",
                   "processed_logprobs": "processed", "raw_logits": "raw_logits",
                   "processed_logits": "processed_logits"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int_field(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> None:
    rng = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
    if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name} must be an integer in {rng}, got {v!r}")


def _float_field(name: str, v: Any, rng: str, ok) -> None:
    if not _is_num(v) or not ok(v):
        raise ValueError(f"{name} must be a finite number in {rng}, got {v!r}")


def _token_list(name: str, v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
        raise ValueError(f"{name} must be a list of token ids (integers >= 0), got {v!r}")
    out = list(v)
    for t in out:
        if not _is_int(t) or not 0 <= t <= MAX_INT32:
            raise ValueError(f"{name} must be a list of token ids (integers in [0, {MAX_INT32}]), got element {t!r}")
    return out


def tokenize_bad_words(words: Sequence[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """vLLM's tokenization of bad words (`encode` adds no special tokens): each word as
    written, leading spaces dropped, and again after a space when that gives as many
    tokens starting with a different one (the word's form inside a sentence)."""
    out = []
    for i, word in enumerate(words):
        bare = encode(word.lstrip())
        if not bare:
            raise ValueError(f"bad_words[{i}] has no tokens: {word!r}")
        out.append(bare)
        spaced = encode(" " + word.lstrip())
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    return out


_OPTIONS = ("any_whitespace", "start_after_token_ids")  # StructuredOutputs fields that are not the constraint


@dataclass
class StructuredOutputs:
    """One constraint on the output: exactly one of json / json_object / regex / grammar / choice.

    json: a JSON Schema (dict or JSON string), checked against its meta-schema.
    json_object: True for any JSON object. regex: must compile (Python `re`).
    grammar: EBNF (GBNF dialect, root rule "root"), parsed at construction.
    choice: a non-empty list of non-empty strings; the output is one of them.
    any_whitespace=False (default) makes JSON use fixed separators, so a
    random-ish model cannot loop on whitespace.
    start_after_token_ids: the constraint binds only once the output ends
    with these ids; before that every token is free (vLLM's structured
    output after a reasoning block: `</think>`'s ids).
    """
    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    any_whitespace: bool = False
    start_after_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        given = [f.name for f in fields(self) if f.name not in _OPTIONS
                 and getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, json_object, regex, "
                             f"grammar, choice; got {given or 'none'}")
        if not isinstance(self.any_whitespace, bool):
            raise ValueError(f"structured_outputs.any_whitespace must be a bool, got {self.any_whitespace!r}")
        after = self.start_after_token_ids
        if after is not None:
            if isinstance(after, (str, bytes)) or not isinstance(after, (list, tuple)) or not after or \
                    not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in after):
                raise ValueError("structured_outputs.start_after_token_ids must be a non-empty list of token ids, "
                                 f"got {after!r}")
            self.start_after_token_ids = list(after)
        kind = given[0]
        if kind == "json":
            self.json = _check_schema(self.json)
        elif kind == "json_object" and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be True, got {self.json_object!r}")
        elif kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError(f"structured_outputs.regex must be a non-empty string, got {self.regex!r}")
            try:
                re.compile(self.regex)
            except (re.error, OverflowError, RecursionError) as e:  # a{4294967295}; groups nested 1,000 deep
                raise ValueError(f"structured_outputs.regex does not compile: {e}") from None
        elif kind == "grammar":
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ValueError("structured_outputs.grammar must be a non-empty EBNF string")
            import xgrammar as xgr
            try:
                xgr.Grammar.from_ebnf(self.grammar)
            except Exception as e:  # xgrammar raises RuntimeError with the parser's message
                raise ValueError(f"structured_outputs.grammar is not valid EBNF: {_short(e)}") from None
        elif kind == "choice":
            ch = self.choice
            if isinstance(ch, str) or not isinstance(ch, (list, tuple)) or not ch or \
                    not all(isinstance(c, str) and c for c in ch):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {ch!r}")
            self.choice = list(ch)

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if f.name not in _OPTIONS
                    and getattr(self, f.name) not in (None, False))

    def key(self) -> str:
        """A canonical string for caching compiled grammars (where it starts binding compiles nothing)."""
        value = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.any_whitespace], sort_keys=True, ensure_ascii=False)


# xgrammar's C++ errors begin "[11:12:51] /project/cpp/regex_converter.cc:94: ": a time and the
# source file of its build, nothing a client can act on. A compile worker's error comes back with
# the exception's type before it ("RuntimeError: [11:12:51] ..."), which goes too.
_XGRAMMAR_PREFIX = re.compile(r"(?:\w+: )?\[[0-9:]+\] \S+: ")


def _short(e: Exception) -> str:
    """An xgrammar error's reason alone: "Regex parsing error at position 3: Lookbehind is not supported yet"."""
    return _XGRAMMAR_PREFIX.sub("", str(e).strip())


def _check_schema(schema: Any) -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        except RecursionError:  # JSON text in a string: the body's depth bound never saw its nesting
            raise ValueError("structured_outputs.json is nested too deeply to parse") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured_outputs.json must be a JSON Schema object, got {type(schema).__name__}")
    import jsonschema
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as e:
        where = "/".join(str(p) for p in e.path) or "(root)"
        raise ValueError(f"structured_outputs.json is not a valid JSON Schema at {where}: {e.message}") from None
    except RecursionError:
        raise ValueError("structured_outputs.json is nested too deeply to check against its meta-schema") from None
    if isinstance(schema, bool):
        raise ValueError("structured_outputs.json must be a JSON Schema object, got a boolean schema")
    return schema


class TokenWords(Sequence):
    """`bad_words_token_ids` as it crosses a process boundary: every word's ids in one int64
    array, and where each word ends. A request may list 100k bad words, and unpickling them as
    100k lists held detent-serve's engine core 43-190 ms between two steps (the garbage
    collector walked them as they came), a stall of every running request; two arrays
    unpickle in under a millisecond. `SamplingParams` pickles its words this way, and the
    bad-words index (sampling/processors.py) reads the arrays as they are. A read-only sequence
    of lists of ints, equal to the lists it holds."""

    __slots__ = ("flat", "ends")

    def __init__(self, flat: np.ndarray, ends: np.ndarray):
        self.flat, self.ends = flat, ends

    @classmethod
    def of(cls, words: Sequence[Sequence[int]]) -> "TokenWords":
        if isinstance(words, TokenWords):
            return words
        lens = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
        flat = np.fromiter(itertools.chain.from_iterable(words), dtype=np.int64, count=int(lens.sum()))
        return cls(flat, np.cumsum(lens))

    @property
    def lens(self) -> np.ndarray:
        return np.diff(self.ends, prepend=0)

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # negative indices, and IndexError
        return self.flat[(self.ends[i - 1] if i else 0):self.ends[i]].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return (w.tolist() for w in (np.split(self.flat, self.ends[:-1]) if len(self) else ()))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenWords):
            return np.array_equal(self.flat, other.flat) and np.array_equal(self.ends, other.ends)
        return isinstance(other, (list, tuple)) and list(self) == [list(w) for w in other]

    __hash__ = None  # a sequence of lists: unhashable, as they are

    def __repr__(self) -> str:
        return f"TokenWords({list(self)!r})"

    def __reduce__(self):
        return TokenWords, (self.flat, self.ends)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logprobs_mode: str = "raw"
    golden_token_ids: list[int] | None = None
    structured_outputs: Any = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # vLLM's bad words, tokenized: a one-token word is never sampled; a longer one's
    # last token is banned right after the output ends with the rest of it
    bad_words_token_ids: list[list[int]] | None = None
    bad_words: list[str] | None = None  # vLLM's; the engine tokenizes them into bad_words_token_ids
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _int_field("n", self.n, 1, 1024)
        _float_field("temperature", self.temperature, f"[0, {MAX_TEMPERATURE:g}]",
                     lambda v: 0 <= v <= MAX_TEMPERATURE)
        _int_field("top_k", self.top_k, -1, MAX_INT32)
        _float_field("top_p", self.top_p, "(0, 1]", lambda v: 0 < v <= 1)
        _float_field("min_p", self.min_p, "[0, 1]", lambda v: 0 <= v <= 1)
        _float_field("presence_penalty", self.presence_penalty, "[-2, 2]", lambda v: -2 <= v <= 2)
        _float_field("frequency_penalty", self.frequency_penalty, "[-2, 2]", lambda v: -2 <= v <= 2)
        lo, hi = REPETITION_PENALTY_RANGE
        _float_field("repetition_penalty", self.repetition_penalty, f"[{lo:g}, {hi:g}]", lambda v: lo <= v <= hi)
        if self.seed is not None:
            _int_field("seed", self.seed, -(2**63), 2**64 - 1)
        if self.max_tokens is not None:
            _int_field("max_tokens", self.max_tokens, 1, MAX_INT32)
        _int_field("min_tokens", self.min_tokens, 0, MAX_INT32 if self.max_tokens is None else self.max_tokens)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):  # a dict's keys, say: never stops
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {type(self.stop).__name__}")
        self.stop = list(self.stop or [])
        bad = next((i for i, s in enumerate(self.stop) if not (isinstance(s, str) and s)), None)
        if bad is not None:  # named by index: the whole list in the message made a 22 MB error body
            raise ValueError(f"stop must be a string or a list of non-empty strings, got stop[{bad}] = "
                             f"{self.stop[bad]!r:.80}")
        self.stop_token_ids = _token_list("stop_token_ids", self.stop_token_ids)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            _int_field("logprobs", self.logprobs, 0, MAX_INT32)  # the engine caps it at its max_logprobs
        if self.prompt_logprobs is not None:
            _int_field("prompt_logprobs", self.prompt_logprobs, 0, MAX_INT32)
        if self.logprobs_mode not in _LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {sorted(_LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        self.logprobs_mode = _LOGPROBS_MODES[self.logprobs_mode]
        if self.golden_token_ids is not None:
            self.golden_token_ids = _token_list("golden_token_ids", self.golden_token_ids)
            if self.max_tokens is not None and len(self.golden_token_ids) > self.max_tokens:
                raise ValueError(f"golden_token_ids has {len(self.golden_token_ids)} ids, more than max_tokens="
                                 f"{self.max_tokens}: the output ends at max_tokens, so the ids after it would "
                                 "never be used; send at most max_tokens of them")
        if isinstance(self.structured_outputs, dict):
            unknown = sorted(map(str, self.structured_outputs.keys() - {f.name for f in fields(StructuredOutputs)}))
            if unknown:  # not Python's "__init__() got an unexpected keyword argument"
                raise ValueError(f"structured_outputs.{unknown[0]:.80} is not a structured-output field (json, "
                                 "json_object, regex, grammar, choice, any_whitespace, start_after_token_ids)")
            self.structured_outputs = StructuredOutputs(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError("structured_outputs must be a StructuredOutputs or a dict, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict token id -> bias, got {self.logit_bias!r}")
            bias = {}
            for k, v in self.logit_bias.items():
                tid = int(k) if isinstance(k, str) and k.isdigit() else k
                if not _is_int(tid) or not 0 <= tid <= MAX_INT32:
                    raise ValueError(f"logit_bias keys must be token ids (integers in [0, {MAX_INT32}]), got {k!r}")
                _float_field(f"logit_bias[{tid}]", v, "[-100, 100]", lambda x: -100 <= x <= 100)
                bias[tid] = float(v)
            self.logit_bias = bias
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list when given")
        if self.bad_words is not None and not (isinstance(self.bad_words, list)
                                               and all(isinstance(w, str) for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
        if self.bad_words_token_ids is not None:
            words = [_token_list("bad_words_token_ids", w) for w in self.bad_words_token_ids]
            if not all(words):
                raise ValueError("bad_words_token_ids must hold non-empty lists of token ids")
            self.bad_words_token_ids = words

    def __getstate__(self) -> dict[str, Any]:
        """The fields, with the bad words as `TokenWords` (to the engine core, and to
        tensor-parallel ranks)."""
        state = dict(self.__dict__)
        if state.get("bad_words_token_ids"):
            state["bad_words_token_ids"] = TokenWords.of(state["bad_words_token_ids"])
        return state

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def seed64(self) -> int | None:
        """The seed as an unsigned 64-bit key (negative seeds taken mod 2**64)."""
        return None if self.seed is None else self.seed % 2**64

    def verify_vocab(self, vocab_size: int) -> None:
        """Raise ValueError if a token-id field names an id outside [0, vocab_size)."""
        lists = {"stop_token_ids": self.stop_token_ids, "golden_token_ids": self.golden_token_ids,
                 "allowed_token_ids": self.allowed_token_ids,
                 "logit_bias": list(self.logit_bias or {}),
                 "bad_words": TokenWords.of(self.bad_words_token_ids or ()).flat,
                 "structured_outputs.start_after_token_ids":
                     self.structured_outputs.start_after_token_ids if self.structured_outputs else None}
        for name, ids in lists.items():
            ids = np.asarray(ids if ids is not None else (), dtype=np.int64)
            over = np.flatnonzero(ids >= vocab_size)
            if len(over):
                raise ValueError(f"{name} contains token id {int(ids[over[0]])}, outside the vocabulary "
                                 f"[0, {vocab_size})")
