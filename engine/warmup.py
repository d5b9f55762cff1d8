"""Warm start: run every kernel configuration the deployment can select
before the first request, so no request waits for a compile.

Triton compiles a kernel the first time it meets a new configuration (tile
sizes, warps, stages) or a new specialization of its integer arguments (a
value of 1, or divisible by 16). On a fresh H200 the first batch-64 pass
took 14.85 ms per token against 7.93 warm (Llama-3.1-8B) while kernels
compiled. CUDA-graph capture warms only the shapes it captures: decode
batches, and the non-attention pieces of steps with prefill tokens. Eager
attention in prefill and mixed steps, and steps beyond the pieces, met
their configurations at the first request that reached them.

The set is finite and SelIR knows it. For every (family, call site) the
dispatcher has a selector; `selection.compiler.reach.reachable` evaluates it
over the program's runtime domain (the VRA's points) and returns each
selection it can reach with a runtime point that reaches it. Here each such
(site, selection) is a target, twice where the domain allows: once with a
token count divisible by 16 and once not (Triton's specialization). A target
becomes a synthetic step (`StepShape`: query and KV lengths per sequence)
whose runtime values reach it, and a few steps cover them all; the forward
runs on scratch KV blocks the scheduler has not handed out yet (it writes
their slots before it reads them). Targets no step can realize are listed,
not hidden (`WarmPlan.uncovered`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from detent.engine.model_runner import PROMPT_LOGPROBS_ROWS
from detent.selection.context import AttentionMetadata, ForwardContext, forward_context

log = logging.getLogger("detent.engine.warmup")

RUNTIME_KEYS = ("num_tokens", "num_seqs", "max_seqlen_q", "max_seqlen_k", "total_kv")
VARIANT_FAMILIES = ("attention", "moe")  # whose candidates may declare step variants (`probe_variants`)


@dataclass(frozen=True)
class StepShape:
    """A synthetic step: query length and KV length (after the step) per sequence."""
    query_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def runtime(self, num_tokens: int | None = None) -> dict[str, int]:
        """What `ForwardContext.runtime` gives a selector during this step."""
        return {"num_tokens": self.num_tokens if num_tokens is None else num_tokens,
                "num_seqs": len(self.query_lens), "max_seqlen_q": max(self.query_lens),
                "max_seqlen_k": max(self.kv_lens), "total_kv": sum(self.kv_lens)}


@dataclass(frozen=True)
class Limits:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int


def shape_for(point: dict[str, int], lim: Limits) -> StepShape | None:
    """A step whose runtime values equal `point`'s (only the keys it has), or None.

    Sequence 0 carries the longest query and the longest KV; the others share
    the remaining tokens (each at least 1, at most the longest), and their KV
    lengths are raised from their query lengths toward the longest until the
    KV total matches."""
    nt = point.get("num_tokens")
    ns = point.get("num_seqs")
    mq, mk, tkv = point.get("max_seqlen_q"), point.get("max_seqlen_k"), point.get("total_kv")
    if nt is None:
        nt = (mq or 1) + (ns or 1) - 1  # the others decode one token each
    if mq is None:
        mq = min(nt, lim.max_model_len) if ns is None else nt - (ns - 1)
    if ns is None:
        ns = 1 + -(-(nt - mq) // mq) if mq > 0 else 1  # as few sequences as the tokens need
    if not (1 <= ns <= lim.max_num_seqs and 1 <= nt <= lim.max_num_batched_tokens and 1 <= mq <= nt):
        return None
    rest = nt - mq
    if not (ns - 1 <= rest <= (ns - 1) * mq):
        return None
    q = [mq] + _spread(rest, ns - 1)
    mk = mq if mk is None else mk
    if not (mq <= mk <= lim.max_model_len):
        return None
    kv = [mk] + q[1:]
    if tkv is not None:
        extra = tkv - sum(kv)
        if extra < 0:
            return None
        for i in range(1, ns):
            add = min(extra, mk - kv[i])
            kv[i] += add
            extra -= add
        if extra:
            return None
    return StepShape(tuple(q), tuple(kv))


def _spread(total: int, n: int) -> list[int]:
    base, extra = divmod(total, n) if n else (0, 0)
    return [base + (1 if i < extra else 0) for i in range(n)]


@dataclass
class WarmPlan:
    shapes: list[StepShape] = field(default_factory=list)  # model forwards
    logit_rows: list[int] = field(default_factory=list)  # row counts for logits, log-softmax and the draw
    targets: int = 0
    uncovered: list[str] = field(default_factory=list)  # targets no step could realize


def plan_warmup(dispatcher, facts: dict[str, Any], lim: Limits, logit_sites: set) -> WarmPlan:
    """Steps that reach every selection SelIR finds reachable at every known site.

    `logit_sites`: the (family, site) pairs called on the rows that compute
    logits (their num_tokens is a row count, not the step's token count)."""
    from detent.selection import programs
    from detent.selection.compiler.reach import reachable, selection_key
    from detent.selection.compiler.solver import solve

    plan = WarmPlan()
    chosen: dict[StepShape, None] = {}
    rows: dict[int, None] = {}
    pending: list[tuple[str, tuple, tuple, bool, list[dict]]] = []
    selectors = dispatcher.built()
    for family, site in sorted(selectors, key=repr):
        selector = selectors[(family, site)]
        sol = solve(programs.load(family), {**facts, **dict(site)})
        if not set(sol.vra.inputs) <= set(RUNTIME_KEYS):  # e.g. all-reduce message sizes
            plan.uncovered.append(f"{family} {dict(site)}: reads {sorted(set(sol.vra.inputs) - set(RUNTIME_KEYS))}")
            continue
        for key, points in reachable(sol, selector).items():
            points = [p for p in points if p.get("num_tokens", 1) >= 1]  # no step has 0 tokens
            if not points:
                continue
            classes = {(p.get("num_tokens", 1) % 16 == 0) for p in points} if "num_tokens" in sol.vra.inputs \
                else {None}
            for cls in classes:
                pts = [p for p in points if cls is None or (p["num_tokens"] % 16 == 0) == cls]
                pending.append((family, site, key, (family, site) in logit_sites, pts))
    plan.targets = len(pending)
    for family, site, key, is_logits, points in pending:
        selector = selectors[(family, site)]
        if is_logits:  # rows that compute logits: sampled rows, or one chunk of prompt rows
            reach = min(max(lim.max_num_seqs, PROMPT_LOGPROBS_ROWS), lim.max_model_len)
            fits = [p.get("num_tokens", 1) for p in points if 1 <= p.get("num_tokens", 1) <= reach]
            if fits:
                rows[fits[0]] = None
            continue
        if any(selection_key(selector(**s.runtime())) == key and _same_class(s, points) for s in chosen):
            continue
        for p in points:
            s = shape_for(p, lim)
            if s is not None and selection_key(selector(**s.runtime())) == key:
                chosen[s] = None
                break
        else:
            plan.uncovered.append(f"{family} {dict(site)} -> {dict(key)}")
    for s in probe_variants(selectors, facts, lim, list(chosen)):
        chosen.setdefault(s)
    plan.shapes = sorted(chosen, key=lambda s: (s.num_tokens, len(s.query_lens)))
    plan.logit_rows = sorted(rows)
    return plan


def probe_shapes(lim: Limits) -> list[StepShape]:
    """Steps a loaded server makes, for `probe_variants`: one to three prompt chunks of
    2 to 2,048 tokens beside 0 to 255 decodes, at short and long KV; and decode-only steps
    at short and long KV, which the decode graphs replay but an eager engine
    (`--enforce-eager`, or graphs that failed to capture) launches itself: one KV split
    launches otherwise than several (lease 15's battery engine compiled two while serving)."""
    out = []
    for d in (1, 2, 4, 8, 16, 17, 32, 33, 64, 127, 128, 255, 256, 511, 512, 1023, 1024):
        for k in (2, min(1000, lim.max_model_len), lim.max_model_len):
            if d <= min(lim.max_num_seqs, lim.max_num_batched_tokens):
                out.append(StepShape((1,) * d, (k,) * d))
    for q in (2, 3, 4, 8, 16, 17, 64, 127, 128, 247, 512, 1024, 2048):
        for n in (1, 2, 3):
            for d in (0, 1, 4, 16, 40, 64, 128, 255):
                for k in (q, min(q + 1000, lim.max_model_len), lim.max_model_len):
                    if n + d <= lim.max_num_seqs and n * q + d <= lim.max_num_batched_tokens and \
                            q <= k <= lim.max_model_len:
                        out.append(StepShape((q,) * n + (1,) * d, (k,) * n + (k,) * d))
    return out


def probe_variants(selectors: dict, facts: dict[str, Any], lim: Limits, shapes: list[StepShape]) -> list[StepShape]:
    """More steps, for the compiles a selection leaves to the step.

    A selection fixes a candidate's parameters, not every kernel it launches:
    the Triton attention decides from the step itself whether a decode-only
    launch, a short launch for a chunk's decodes, or the split combine runs
    (`Candidate.variants`, kernels/attention_triton.py), each its own compile;
    the fused MoE sizes its alignment's launch by the step's tokens
    (kernels/moe_triton.py). Lease 6 saw five attention compiles while
    serving, lease 31's tune one alignment (docs/performance.md). Here every
    probe step whose variants the planned steps miss is added, greedily,
    until no probe adds one."""
    from detent.selection import ops

    added: list[StepShape] = []
    for (family, site), selector in sorted(selectors.items(), key=repr):
        step = {**dict(site), "num_sms": facts.get("num_sms")}
        if family not in VARIANT_FAMILIES or None in step.values():
            continue
        first = StepShape((1,), (1,))  # one implementation per deployment: does it declare variants?
        if ops.launch_variants(family, selector(**first.runtime()), query_lens=first.query_lens,
                               kv_lens=first.kv_lens, **step) is None:
            continue

        def variants(s: StepShape):
            return ops.launch_variants(family, selector(**s.runtime()), query_lens=s.query_lens,
                                       kv_lens=s.kv_lens, **step) or set()
        covered = set().union(*(variants(s) for s in shapes + added))
        for s in probe_shapes(lim):
            new = variants(s) - covered
            if new:
                added.append(s)
                covered |= new
    return added


def _same_class(s: StepShape, points: list[dict]) -> bool:
    """Does `s` have the num_tokens divisibility (by 16) these points were grouped by?"""
    if not points or "num_tokens" not in points[0]:
        return True
    return (s.num_tokens % 16 == 0) == (points[0]["num_tokens"] % 16 == 0)


def _metadata(shape: StepShape, block_size: int, num_blocks: int, device) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata over scratch blocks (sequences may share them: the values are never read back)."""
    ns = len(shape.query_lens)
    nb = [-(-k // block_size) for k in shape.kv_lens]
    width = max(nb)
    tables = torch.tensor([[(i * width + j) % num_blocks for j in range(width)] for i in range(ns)],
                          dtype=torch.int32)
    pos, slots, qsl = [], [], [0]
    for i, (q, k) in enumerate(zip(shape.query_lens, shape.kv_lens)):
        p = torch.arange(k - q, k)
        pos.append(p)
        slots.append(tables[i, p // block_size].long() * block_size + p % block_size)
        qsl.append(qsl[-1] + q)
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, **i32), seq_lens=torch.tensor(shape.kv_lens, **i32),
        block_tables=tables.to(device), slot_mapping=torch.cat(slots).to(device), num_seqs=ns,
        num_tokens=shape.num_tokens, max_seqlen_q=max(shape.query_lens), max_seqlen_k=max(shape.kv_lens),
        block_size=block_size, query_start_loc_cpu=tuple(qsl), seq_lens_cpu=shape.kv_lens)
    return meta, torch.cat(pos).to(device)


@torch.inference_mode()
def run_step(runner, shape: StepShape, logit_rows: int = 0) -> None:
    """One eager forward of `shape` (and logits + log-softmax over `logit_rows` rows)."""
    from detent.selection import ops

    num_blocks = runner.kv_caches[0].shape[1]
    meta, positions = _metadata(shape, runner.block_size, num_blocks, runner.device)
    ids = torch.zeros(shape.num_tokens, dtype=torch.long, device=runner.device)
    ctx = ForwardContext(attn=meta, kv_caches=runner.kv_caches, dispatcher=runner.dispatcher)
    with forward_context(ctx):
        hidden = runner.model(ids, positions)
        if logit_rows:  # what a sampling step runs on them: log-softmax, top-p's mask and the keyed draw
            logits = runner.model.compute_logits(hidden[:logit_rows])
            ops.log_softmax(logits)
            ops.top_p_keep(logits.float(), torch.full((logit_rows,), 0.9, dtype=torch.float64, device=logits.device))
            zeros = [0] * logit_rows
            ops.gumbel_argmax(logits, zeros, zeros, zeros, 0)


def _discover(runner) -> set:
    """Run one small step with logits, recording which sites see the row count."""
    d = runner.dispatcher
    prev = d.calls, d.record_calls  # someone else's recording (the tuner's profile) is kept
    d.calls, d.record_calls = {}, True
    try:
        run_step(runner, StepShape((3, 2), (3, 2)), logit_rows=2)  # 5 tokens, 2 logit rows
        sites = {(fam, site) for (fam, site, rt) in d.calls if dict(rt)["num_tokens"] == 2}
    finally:
        d.calls, d.record_calls = prev
    return sites


def warm_up(runner, facts: dict[str, Any], lim: Limits, *, progress: bool = True) -> WarmPlan:
    """Plan and run the warm-up steps on `runner` (before it serves)."""
    t0 = time.perf_counter()
    logit_sites = _discover(runner)
    plan = plan_warmup(runner.dispatcher, facts, lim, logit_sites)
    work = [(s, 0) for s in plan.shapes] + [(StepShape((r,), (r,)), r) for r in plan.logit_rows]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(work), desc="Warming kernels", unit="step", dynamic_ncols=True)
    for shape, rows in work:
        run_step(runner, shape, rows)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    log.info("warm start: %d selections over %d steps + %d logit sizes in %.1f s%s", plan.targets,
             len(plan.shapes), len(plan.logit_rows), time.perf_counter() - t0,
             f"; not reachable by a synthetic step: {plan.uncovered}" if plan.uncovered else "")
    return plan
