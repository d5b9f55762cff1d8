"""Logits processors, strictly row-wise, on a block of rows x[B, V] float32.

Order (documented contract, tested against a float64 reference):
  allowed_token_ids / logit_bias / min_tokens / bad words  ->  penalties (repetition,
  frequency, presence)  ->  temperature  ->  top-k  ->  top-p  ->  min-p
  ->  grammar mask  ->  sample.
Truncation keeps ties: top-k keeps every token whose logit is >= the k-th
largest; top-p orders by probability descending (ties to the lower id) and keeps a
token when the probability mass strictly before it is < top_p (the smallest
prefix reaching top_p); min-p keeps x_i - x_max >= log(min_p), i.e. p_i >= min_p * p_max. If the grammar mask
leaves no token the truncation kept, the grammar's allowed set (under the
temperature-scaled distribution) is used instead, so a constrained request
never stalls; that set stays within allowed_token_ids, a mask as hard as the
grammar's (sampler._grammar_allowed).

No float cumsum (its addition order is not the same for every batch on GPU):
top-p (kernels/nucleus.py, the `top_p` family) sums probabilities as integers, exact in any
order, and finds its boundary without a sort or a device read.
"""
from __future__ import annotations

import itertools
import os
from typing import NamedTuple, Sequence

import numpy as np
import torch

from detent.sampling.grammar_limits import check_limits
from detent.sampling.params import TokenWords
from detent.sampling.rng import list_to_device, to_device
from detent.selection import ops

NEG_INF = float("-inf")


def _pad_ids(lists: Sequence[Sequence[int]], fill: int, device) -> torch.Tensor:
    """[B, longest] int64 of the rows' ids, `fill` after each row's end. Built in numpy: from a
    numpy row it is a copy, from a list one conversion (64 rows of 4,096 ids: 0.2 and 5.7 ms
    on a CPU core, against 20 ms through torch.as_tensor per row)."""
    width = max((len(l) for l in lists), default=0) or 1
    out = np.full((len(lists), width), fill, dtype=np.int64)
    for i, l in enumerate(lists):
        if len(l):
            out[i, :len(l)] = l
    return to_device(torch.from_numpy(out), device)


def token_presence(lists: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """Counts [B, V] int32 of each row's token ids (ids >= vocab are ignored)."""
    idx = _pad_ids(lists, vocab, device).clamp_(max=vocab)
    counts = torch.zeros(len(lists), vocab + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.int32))
    return counts[:, :vocab]


class MaskIds(NamedTuple):
    """A request's token ids that `apply_request_masks` writes, under one vocabulary size."""
    allowed: np.ndarray  # int64, sorted, unique: allowed_token_ids
    bias_ids: np.ndarray  # int64, unique: logit_bias's keys
    bias: np.ndarray  # float64: logit_bias's values, in bias_ids' order
    min_tokens_bans: np.ndarray  # int64: EOS and stop_token_ids (a repeat bans once)


def min_tokens_bans(params, eos_token_ids: Sequence[int]) -> np.ndarray:
    """int64 ids a request bans while its output is shorter than min_tokens: EOS and its
    stop_token_ids (a repeat bans once). The one definition, through `MaskIds.min_tokens_bans`: the
    sampler's mask reads it, and so does the engine's check that some allowed_token_ids stay
    sampleable (RequestMaskIds.check_some_token_left)."""
    return np.concatenate([np.asarray(tuple(eos_token_ids), dtype=np.int64),
                           np.asarray(params.stop_token_ids or (), dtype=np.int64)])


def build_mask_ids(params, eos_token_ids: Sequence[int], V: int) -> MaskIds:
    """`MaskIds` of one request's parameters: a pass over every id it lists."""
    allowed = np.unique(np.asarray(params.allowed_token_ids or (), dtype=np.int64))
    bias = params.logit_bias or {}
    bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
    bias_vals = np.fromiter(bias.values(), dtype=np.float64, count=len(bias))
    bans = min_tokens_bans(params, eos_token_ids)
    under = bias_ids < V
    return MaskIds(allowed[allowed < V], bias_ids[under], bias_vals[under], bans[bans < V])


class RequestMaskIds:
    """One request's `MaskIds` and bad words' index, built once and kept for the rest.

    The scheduler gives each request one (`Request.mask_ids`, passed in every
    SamplingRow): a request may list a vocabulary's worth of stop ids (banned
    under min_tokens), logit_bias or allowed ids, and building them from the
    lists at every step doubled a neighbouring request's time (49k stop ids).
    The engine builds them when the request is added (`build`), not at its
    first masked step: 100k bad words take 180 ms to index, a stall for every
    request of that step. Pickled, it carries the parameters and its key, no
    tables: a tensor-parallel rank receives it once a request and keeps it
    (engine/tp/plan.py), so it builds them once a request too. Parameters a
    server checked carry their bad words' index, and their `MaskIds` where its EOS ids are
    this request's (`checked_params`): they are taken."""

    def __init__(self, params, eos_token_ids: Sequence[int] = ()):
        self.params = params
        self.eos_token_ids = tuple(eos_token_ids)
        self.key = f"{os.getpid()}-{next(_KEYS)}"
        self._by_vocab: dict[int, MaskIds] = {}
        self._bad_words_by_vocab: dict[int, BadWords] = {}
        self.vocab_size: int | None = None  # what `build` built under, and `leaves_out` judges by
        p = params  # the masks that can leave a row no token at all (logit_bias is finite)
        self.kinds = [name for name, on in (("allowed_token_ids", p.allowed_token_ids),
                                            ("bad_words", p.bad_words_token_ids),
                                            ("min_tokens (EOS and stop_token_ids)", p.min_tokens)) if on]

    def build(self, V: int) -> "RequestMaskIds":
        """Builds now the tables its parameters will need under V; itself."""
        p = self.params
        self.vocab_size = V
        if p.allowed_token_ids or p.logit_bias or p.min_tokens:
            self.under(V)
        if p.bad_words_token_ids:
            self.bad_words(V)
        return self

    def under(self, V: int) -> MaskIds:
        ids = self._by_vocab.get(V)
        if ids is None:
            checked = self._checked(V)  # built on a server's worker (checked_params)
            ids = checked.mask_ids if checked is not None else build_mask_ids(self.params, self.eos_token_ids, V)
            self._by_vocab[V] = ids
        return ids

    def _checked(self, V: int) -> "Checked | None":
        """What `checked_params` built and checked of the params under V for this request's EOS ids, or None."""
        checked = checked_for(self.params, V)
        return checked if checked is not None and checked.eos_token_ids == self.eos_token_ids else None

    def bad_words(self, V: int) -> "BadWords":
        words = self._bad_words_by_vocab.get(V)
        if words is None:
            checked = checked_for(self.params, V)  # indexed on a server's worker (checked_params)
            words = checked.bad_words if checked is not None else None
            if words is None:
                words = BadWords(self.params.bad_words_token_ids or (), V)
            self._bad_words_by_vocab[V] = words
        return words

    def check_some_token_left(self, V: int) -> None:
        """Raise ValueError if the request's bans cover allowed_token_ids, or the whole vocabulary of
        V: every logit -inf, and the sampler took token 0 with a finite logprob (a hostile-client
        audit); the engine refuses such a request at admission. The bans are the sampler's own
        tables: one-token bad words always, and EOS and stop_token_ids while min_tokens holds.
        Bans that only a longer bad word's prefix brings fail the request where they do
        (`leaves_out`, Scheduler._none_left). Params a server's worker checked for these EOS ids
        (`checked_params`) are not checked again."""
        p = self.params
        if not (p.allowed_token_ids or p.bad_words_token_ids or p.min_tokens) or self._checked(V) is not None:
            return
        ids = self.under(V)
        what = "every allowed id" if p.allowed_token_ids else "every token of the vocabulary"
        always = self.bad_words(V).always[:, 0] if p.bad_words_token_ids else np.empty(0, np.int64)  # unique, < V
        if p.allowed_token_ids:
            left = np.setdiff1d(ids.allowed, always, assume_unique=True)
            some, some_under_min = len(left), len(np.setdiff1d(left, ids.min_tokens_bans))
        else:  # the bans are ids < V: a count tells whether they cover the vocabulary
            some, some_under_min = V - len(always), V - len(np.union1d(always, ids.min_tokens_bans))
        if not some:
            raise ValueError(f"{'allowed_token_ids' if p.allowed_token_ids else 'bad_words'}: {what} is a "
                             "one-token bad word, no token can be sampled")
        if p.min_tokens > 0 and not some_under_min:
            raise ValueError(f"min_tokens={p.min_tokens} bans EOS and stop_token_ids, and {what} is one of them "
                             "(or a one-token bad word): no token can be sampled")

    def leaves_out(self, tok: int, output_token_ids: Sequence[int]) -> bool:
        """Whether the request's own masks ban `tok` after these outputs, under the vocabulary it was
        built for (False before `build`): outside allowed_token_ids, a bad word's last token, or EOS
        or a stop id while min_tokens holds. The sampler draws such a token only from a row they
        left with no token at all (every logit -inf: it takes token 0), so the scheduler fails the
        request there rather than emit it (Scheduler._none_left)."""
        V, p = self.vocab_size, self.params
        if V is None or not self.kinds:
            return False
        ids = self.under(V) if p.allowed_token_ids or p.min_tokens else None
        if p.allowed_token_ids and not _holds(ids.allowed, tok):
            return True
        if len(output_token_ids) < p.min_tokens and tok in ids.min_tokens_bans:
            return True
        return bool(p.bad_words_token_ids) and bool((self.bad_words(V).bans(output_token_ids, False)[:, 0] == tok).any())

    def __getstate__(self):
        return {**self.__dict__, "_by_vocab": {}, "_bad_words_by_vocab": {}}


def _holds(sorted_ids: np.ndarray, tok: int) -> bool:
    i = int(np.searchsorted(sorted_ids, tok))
    return i < len(sorted_ids) and int(sorted_ids[i]) == tok


_KEYS = itertools.count()


class Checked(NamedTuple):
    """What `checked_params` leaves on a SamplingParams: the vocabulary size its checks were made
    for, its bad words' index under it (None without bad words), its spec's key() (the grammar
    cache's; None without a spec), and, given the engine's EOS ids, those ids and its `MaskIds`
    under them, the check that some token is left made (else None)."""
    vocab_size: int
    bad_words: "BadWords | None"
    spec_key: str | None = None
    eos_token_ids: tuple[int, ...] | None = None
    mask_ids: MaskIds | None = None


_CHECKED = "_checked_for_admission"  # the attribute: not a field, so equality and the record ignore it


def checked_params(params, vocab_size: int, eos_token_ids: Sequence[int] | None = None):
    """`params`, checked here as `LLMEngine.add_request` checks a request's parameters that need no
    engine state (verify_vocab, the spec's grammar limits), its bad words indexed and its spec's
    grammar-cache key made here; an engine of this vocabulary then admits it without any of them
    (`checked_for`; a replace()d copy is unchecked). Given the engine's EOS ids
    (`EngineLimits.eos_token_ids`), its mask tables are built here too and the check that they leave
    some token is made (`RequestMaskIds.check_some_token_left`); an engine with those EOS ids takes
    both. detent-serve calls this on its worker pool: its engine admits requests between two steps,
    on the step thread, where a 64 KB schema's walk (12 ms) and key (0.5 ms a sample, 69 ms for
    n = 128), a vocabulary's allowed, bias and stop ids (9 ms to check, 14 ms to build their tables
    and check them) and 100k bad words' index (33 ms) paused every running request. `params` must
    not change after."""
    if params.bad_words and params.bad_words_token_ids is None:
        raise ValueError("bad_words must be tokenized into bad_words_token_ids before the params are checked")
    params.verify_vocab(vocab_size)
    spec = params.structured_outputs
    if spec is not None:
        check_limits(spec)
    words = BadWords(params.bad_words_token_ids, vocab_size) if params.bad_words_token_ids else None
    checked = Checked(vocab_size, words, spec.key() if spec is not None else None)
    setattr(params, _CHECKED, checked)
    if eos_token_ids is not None:  # the tables take the index just left on the params
        masks = RequestMaskIds(params, eos_token_ids)
        masks.check_some_token_left(vocab_size)
        setattr(params, _CHECKED, checked._replace(eos_token_ids=masks.eos_token_ids, mask_ids=masks.under(vocab_size)))
    return params


def checked_for(params, vocab_size: int) -> Checked | None:
    """What `checked_params` checked of `params` for this vocabulary size, or None (check them)."""
    checked = getattr(params, _CHECKED, None)
    return checked if checked is not None and checked.vocab_size == vocab_size else None


class BadWords:
    """A request's bad words indexed once, under one vocabulary size: a word's last token is
    banned where the output ends with the rest of the word. One-token words are banned at every
    step; the longer ones are looked up by the output's tail, once per distinct prefix length,
    instead of a scan of every word each step (100k words took 33 ms a step, for the whole
    batch). With the output's last token pending (on the device only), a word is found by its
    prefix's earlier tokens and banned on the condition that the pending token is the prefix's
    last. Words whose last token is outside the vocabulary ban nothing. Built with numpy, a
    sort per word length: a loop over the words took 350 ms for 100k of them, a stall of
    detent-serve's step loop, which admits requests between steps."""

    def __init__(self, words: Sequence[Sequence[int]], V: int):
        packed = TokenWords.of(words)  # as the engine core receives them already (sampling/params.py)
        flat, ends, lens = packed.flat, packed.ends, packed.lens  # word i is flat[ends[i] - lens[i]:ends[i]]
        ok = flat[ends - 1] < V
        always = np.unique(flat[ends[ok & (lens == 1)] - 1])
        self.always = np.stack([always, np.full_like(always, -1)], axis=1)  # [n, 2]
        self.known: dict[int, _Table] = {}  # prefix length -> its words
        self.unsure: dict[int, _Table] = {}  # prefix length - 1 -> its words, the prefix's last pending
        for L in np.unique(lens[ok & (lens > 1)]).tolist():
            w = flat[(ends[ok & (lens == L)] - L)[:, None] + np.arange(L)]  # [m, L]: the words of L tokens
            self.known[L - 1] = _Table(w[:, :-1], np.stack([w[:, -1], np.full(len(w), -1)], axis=1))
            self.unsure[L - 2] = _Table(w[:, :-2], w[:, [-1, -2]])

    def bans(self, output_token_ids: Sequence[int], pending: bool) -> np.ndarray:
        """[n, 2] int64: (token banned, the pending token it needs or -1) at this step."""
        out, hits = output_token_ids, [self.always]
        for n, table in (self.unsure if pending else self.known).items():
            if n <= len(out):
                hit = table.find(out[len(out) - n:] if n else ())
                if len(hit):
                    hits.append(hit)
        return hits[0] if len(hits) == 1 else np.concatenate(hits)


class _Table:
    """Bans [m, 2] by keys [m, n] of token ids: those whose key is a given tail, found by a
    binary search over the keys' bytes (sorted once; the order only has to be one order)."""

    def __init__(self, keys: np.ndarray, bans: np.ndarray):
        self.n, self.keys, self.bans = keys.shape[1], None, bans
        if self.n:  # a key of no tokens: every ban applies
            k = _as_bytes(keys)
            order = np.argsort(k, kind="stable")
            self.keys, self.bans = k[order], bans[order]

    def find(self, tail: Sequence[int]) -> np.ndarray:
        if not self.n:
            return self.bans
        q = _as_bytes(np.asarray(tail, dtype=np.int64)[None])[0]
        return self.bans[np.searchsorted(self.keys, q, "left"):np.searchsorted(self.keys, q, "right")]


def _as_bytes(rows: np.ndarray) -> np.ndarray:
    """[m, n] int64 -> [m] of n * 8-byte values that compare as their rows' bytes."""
    return np.ascontiguousarray(rows, dtype=np.int64).view(np.dtype((np.void, 8 * rows.shape[1]))).ravel()


def apply_request_masks(x: torch.Tensor, rows, last: torch.Tensor | None = None) -> torch.Tensor:
    """allowed_token_ids, logit_bias, min_tokens (blocks EOS and stop_token_ids), bad words.
    Returns x itself when no row has any of them, else a masked copy (x is not modified).
    Which tokens each row masks is known on the host, one indexed write per kind for all
    rows, except where a row's last token is `pending` (on the device only, in `last`):
    a bad word whose prefix ends with it is banned when last == that token. A row's ids
    come from its `mask_ids` (built once per request), or are built for this call."""
    B, V = x.shape
    if not any(r.params.allowed_token_ids or r.params.logit_bias or r.params.bad_words_token_ids
               or len(r.output_token_ids) + r.pending < r.params.min_tokens for r in rows):
        return x
    allow_rows, allowed, biased, banned = [], [], [], []  # (row, ids) per row that has any
    bad_words = []  # (row, [n, 2] (token, the pending token it needs or -1))
    for i, r in enumerate(rows):
        p = r.params
        under_min = len(r.output_token_ids) + r.pending < p.min_tokens
        if not (p.allowed_token_ids or p.logit_bias or under_min or p.bad_words_token_ids):
            continue
        request = r.request_masks()
        if p.allowed_token_ids or p.logit_bias or under_min:
            ids = request.under(V)
            if p.allowed_token_ids:
                allow_rows.append(i)
                allowed.append((i, ids.allowed))
            if len(ids.bias_ids):
                biased.append((i, ids))
            if under_min:
                banned.append((i, ids.min_tokens_bans))
        if p.bad_words_token_ids:
            word_bans = request.bad_words(V).bans(r.output_token_ids, bool(r.pending))
            if len(word_bans):
                bad_words.append((i, word_bans))
    dev = x.device
    if allow_rows:  # a row with allowed_token_ids keeps those alone
        listed = set(allow_rows)
        unlisted = list_to_device([i not in listed for i in range(B)], torch.bool, dev)
        x = torch.where(id_mask(allowed, B, V, dev) | unlisted[:, None], x, NEG_INF)
    else:
        x = x.clone()
    if biased:  # (row, token) pairs are unique: a dict's keys per row
        at = cells([(i, ids.bias_ids) for i, ids in biased], dev)
        bias = np.concatenate([ids.bias for _, ids in biased])
        x.index_put_(at, x[at] + to_device(torch.from_numpy(bias).to(x.dtype), dev))
    ban_rows, ban_tokens = _host_cells(banned)
    if len(ban_tokens) or bad_words:
        ban = np.concatenate([np.stack([ban_rows, ban_tokens, np.full(len(ban_tokens), -1, dtype=np.int64)], axis=1)]
                             + [np.concatenate([np.full((len(b), 1), i, dtype=np.int64), b], axis=1)
                                for i, b in bad_words])
        ban = to_device(torch.from_numpy(ban), dev)  # [n, 3]
        hit = ban[:, 2] < 0
        if last is not None:
            hit = hit | (last.index_select(0, ban[:, 0]) == ban[:, 2])
        # an integer sum per cell (atomic adds, exact in any order): a cell listed twice is banned
        # if either entry hits
        hits = torch.zeros(B * V, dtype=torch.int32, device=dev).scatter_add_(0, ban[:, 0] * V + ban[:, 1],
                                                                              hit.int())
        x = x.masked_fill(hits.view(B, V) > 0, NEG_INF)
    return x


def _host_cells(parts: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """[2, n] int64 (rows, tokens) on the host: row i with each of its tokens, for each (i, tokens)."""
    if not parts:
        return np.zeros((2, 0), dtype=np.int64)
    ids = [a for _, a in parts]
    rows = np.repeat(np.asarray([i for i, _ in parts], dtype=np.int64), [len(a) for a in ids])
    return np.stack([rows, np.concatenate(ids)])


def cells(parts: list[tuple[int, np.ndarray]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """`_host_cells` as (rows, tokens) index tensors on the device."""
    both = to_device(torch.from_numpy(_host_cells(parts)), device)
    return both[0], both[1]


def id_mask(parts: list[tuple[int, np.ndarray]], n: int, V: int, device) -> torch.Tensor:
    """bool [n, V]: True at each part's (row, token ids) cells, False elsewhere (allowed_token_ids)."""
    mask = torch.zeros(n, V, dtype=torch.bool, device=device)
    at = cells(parts, device)
    if len(at[0]):
        mask.index_put_(at, torch.ones(len(at[0]), dtype=torch.bool, device=device))
    return mask


def apply_penalties(x: torch.Tensor, rows, last: torch.Tensor | None = None) -> torch.Tensor:
    """vLLM semantics: repetition over prompt+output tokens; frequency/presence over output tokens.
    A row's `pending` last token (on the device only, in `last`) is counted among its outputs."""
    B, V = x.shape
    dev = x.device
    reps = [r.params.repetition_penalty for r in rows]
    freqs = [r.params.frequency_penalty for r in rows]
    press = [r.params.presence_penalty for r in rows]
    use_rep, use_freq = any(v != 1.0 for v in reps), any(v != 0.0 for v in freqs + press)
    if not (use_rep or use_freq):
        return x  # decided on the host: no tensors
    rep, freq, pres = (list_to_device(v, x.dtype, dev)[:, None] for v in (reps, freqs, press))
    out_counts = token_presence([r.output_token_ids for r in rows], V, dev)
    pending = [r.pending for r in rows]
    if any(pending):
        out_counts.scatter_add_(1, last[:, None], list_to_device(pending, torch.int32, dev)[:, None])
    if use_rep:
        seen = (token_presence([r.prompt_token_ids for r in rows], V, dev) > 0) | (out_counts > 0)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if use_freq:
        x = x - freq * out_counts.to(x.dtype) - pres * (out_counts > 0).to(x.dtype)
    return x


def count(mask: torch.Tensor) -> torch.Tensor:
    """Per-row number of True entries, [B, 1] int32 (an exact integer sum; bool .sum() is slow on CPU)."""
    return mask.to(torch.int32).sum(dim=-1, keepdim=True)


def ordered_topk(v: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries per row, ordered by value descending, ties to the lower id.

    torch.topk's choice among tied values is unspecified, so it never sees the
    values themselves: each entry becomes one int64 key, (its value's bits in an
    order-preserving int32) * 2^32 + (V - 1 - id), so no two keys tie and the
    larger key is the larger value, or the lower id among equal values. The
    result is exact, per row, and needs no device sync (no .item(), no nonzero).
    """
    B, V = v.shape
    k = max(1, min(k, V))
    if v.dtype != torch.float32:
        raise TypeError(f"ordered_topk takes float32 rows, got {v.dtype}")
    if k == 1:  # argmax returns the first maximal index: the largest value, ties to the lower id
        ids = torch.argmax(v, dim=-1, keepdim=True)
        return v.gather(1, ids), ids
    bits = (v + 0.0).view(torch.int32).to(torch.int64)  # + 0.0: -0.0 ties with +0.0
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: flip the magnitude bits
    keys = bits * (1 << 32) + torch.arange(V - 1, -1, -1, dtype=torch.int64, device=v.device)
    ids = torch.topk(keys, k, dim=-1, sorted=True).indices
    return v.gather(1, ids), ids


def truncation_mask(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    min_p: torch.Tensor, host: tuple[list, list, list] | None = None) -> torch.Tensor:
    """keep[B, V] after top-k, top-p, min-p on temperature-scaled logits x.

    top_k: [B] long (<= 0 or >= V: disabled); top_p, min_p: [B] float64.
    `host`: the same three as host lists, so that which steps run is decided
    without reading the device (each read would make the host wait for the step).
    """
    B, V = x.shape
    if host is None:
        host = (top_k.tolist(), top_p.tolist(), min_p.tolist())
    hk, hp, hm = host
    keep = None  # every token, until a truncation runs (its [B, V] passes only where one does)
    if any(0 < v < V for v in hk):  # k.max() from the host values (disabled rows count as V)
        k = torch.where((top_k <= 0) | (top_k > V), torch.full_like(top_k, V), top_k)
        # only values: the k-th largest value is the same whichever of its tied ids topk picks, so
        # float32 topk will do (ordered_topk's int64 keys order the ids, which logprobs need)
        kvals = torch.topk(x, max((V if (v <= 0 or v > V) else v) for v in hk), dim=-1).values
        keep = x >= kvals.gather(1, (k.clamp(max=kvals.shape[1]) - 1)[:, None])
    if any(v < 1.0 for v in hp):  # rows with top_p >= 1 keep everything either way
        nucleus = ops.top_p_keep(x if keep is None else torch.where(keep, x, NEG_INF), top_p)
        keep = nucleus if keep is None else keep & nucleus
    # min-p relative to the most likely token (always kept above):
    # p_i >= min_p * p_max  <=>  x_i - x_max >= log(min_p), exact elementwise ops only
    if any(v > 0 for v in hm):
        x_max = x.max(dim=-1, keepdim=True).values
        log_min_p = torch.where(min_p > 0, torch.log(min_p), float("-inf"))
        above = (x - x_max).double() >= log_min_p[:, None]
        keep = above if keep is None else keep & above
    return torch.ones_like(x, dtype=torch.bool) if keep is None else keep


def bitmask_to_bool(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """xgrammar int32 bitmask [B, W] -> bool [B, vocab]; ids beyond 32*W are disallowed."""
    B, W = bitmask.shape
    n = min(vocab, 32 * W)
    tok = torch.arange(n, device=bitmask.device)
    words = bitmask[:, tok >> 5].to(torch.int64)
    allowed = ((words >> (tok & 31)) & 1).bool()
    if n < vocab:
        allowed = torch.cat([allowed, allowed.new_zeros(B, vocab - n)], dim=1)
    return allowed
