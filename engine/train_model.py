"""`TrainerModel`: the engine's model with gradients, for an RL trainer.

    trainer = TrainerModel(llm)                       # its own copy of the weights, trainable
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    lps = trainer([prompt + completion, ...], num_prompt_tokens=[len(prompt), ...])
    # lps[j][i] == the rollout's logprob of completion token i, bit for bit (selection="pinned")
    loss = -(lps[0] * adv).sum(); loss.backward(); opt.step()
    llm.update_weights(trainer.checkpoint_tensors())  # weights back into the engine

Every op goes through the `ops` façade with the engine's own dispatcher (same
deployment, same tuple, same pins), wrapped by `GradDispatcher`: forwards
are the engine's candidates, backwards are reference torch math in float32
(`selection/autograd.py`). Sequences are packed varlen into steps under the
engine's token budget, cut the way chunked prefill cuts prompts: a
sequence longer than the budget spans steps, its later chunks reading the
earlier chunks' KV from a scratch cache (forward) and differentiating into
the tensors it came from (`KVHistory`, backward). Logprobs are computed in
row chunks under activation checkpointing, so [tokens, vocab] float32
logits never exist for more than `logprob_chunk` rows at a time.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from detent.engine.inputs import token_id_list
from detent.engine.kv_cache import KVCacheSpec, allocate_kv_caches
from detent.engine.model_runner import ModelRunner
from detent.engine.trainer import as_sequences, check_sequences, plan_chunks, scratch_tables
from detent.scheduler.outputs import ScheduledSeq, SchedulerOutput
from detent.selection.autograd import GradDispatcher, KVHistory
from detent.selection.context import ForwardContext, forward_context


class TrainerModel(nn.Module):
    def __init__(self, llm_or_engine, *, share_weights: bool = False, checkpoint_layers: bool = False,
                 logprob_chunk: int = 1024):
        """share_weights: train the engine's own parameter tensors (colocated; the
        optimizer's in-place steps reach the engine at once; call
        `llm.reset_prefix_cache()` after each step). Otherwise a copy, pushed
        with `llm.update_weights(trainer.checkpoint_tensors())`."""
        super().__init__()
        eng = getattr(llm_or_engine, "llm_engine", llm_or_engine)
        if not isinstance(eng.runner, ModelRunner):
            raise NotImplementedError("TrainerModel needs a single-process engine (tensor_parallel_size=1); "
                                      "train at tp=1 and push weights to a tp>1 engine with update_weights")
        if logprob_chunk < 1:
            raise ValueError(f"logprob_chunk must be >= 1, got {logprob_chunk}")
        self.model = eng.runner.model if share_weights else copy.deepcopy(eng.runner.model)
        for p in self.model.parameters():
            p.requires_grad_(True)
        self._engine = [eng]  # a list: not a submodule, not in state_dict
        self.checkpoint_layers = checkpoint_layers
        self.logprob_chunk = logprob_chunk

    @property
    def engine(self):
        return self._engine[0]

    # ------------------------------------------------------------ forward
    def forward(self, sequences: Sequence[Sequence[int]],
                num_prompt_tokens: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Per sequence x with P = num_prompt_tokens[j] (default 1), a float32
        tensor [len(x) - P] whose entry i is log p(x[P + i] | x[:P + i]),
        differentiable in the parameters."""
        return self._score(sequences, num_prompt_tokens, "logprob")

    def logprobs_and_entropy(self, sequences: Sequence[Sequence[int]],
                             num_prompt_tokens: Sequence[int] | None = None
                             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """As `forward`, plus each scored position's entropy of the raw next-token
        distribution (float32, differentiable: for an entropy bonus)."""
        both = self._score(sequences, num_prompt_tokens, "entropy")  # [R, 2] each
        return [x[:, 0] for x in both], [x[:, 1] for x in both]

    def hidden_states(self, sequences: Sequence[Sequence[int]],
                      num_prompt_tokens: Sequence[int] | None = None) -> list[torch.Tensor]:
        """The final (normed) hidden state at each position `forward` scores, the
        LM head's input: [len(x) - P, hidden] in the model's dtype, differentiable
        (for a loss of one's own, e.g. a value head). Row i predicts x[P + i]."""
        return self._score(sequences, num_prompt_tokens, "hidden")

    def _score(self, sequences, num_prompt_tokens, what: str) -> list[torch.Tensor]:
        eng = self.engine
        seqs = as_sequences(sequences)
        check_sequences(seqs, eng.state.max_model_len, eng.model_config.vocab_size)
        starts = [1] * len(seqs) if num_prompt_tokens is None else token_id_list("num_prompt_tokens",
                                                                                 num_prompt_tokens, "integers")
        if len(starts) != len(seqs):
            raise ValueError(f"num_prompt_tokens has {len(starts)} entries for {len(seqs)} sequences")
        for j, (s, p) in enumerate(zip(seqs, starts)):
            if not 1 <= p < len(s):
                raise ValueError(f"num_prompt_tokens[{j}]={p}: must be in [1, {len(s) - 1}] for a "
                                 f"sequence of {len(s)} tokens")
        out: list = [None] * len(seqs)
        g = eng.config.max_num_seqs
        for i in range(0, len(seqs), g):  # a scratch KV cache per group of sequences
            out[i:i + g] = self._score_group(seqs[i:i + g], starts[i:i + g], what)
        return out

    def _score_group(self, seqs: list[list[int]], starts: list[int], what: str) -> list[torch.Tensor]:
        """The sequences prefilled in steps under the engine's token budget, cut the
        way chunked prefill cuts prompts (`plan_chunks`): a sequence longer than
        the budget spans steps, and its later chunks attend to the earlier ones' KV
        through the scratch cache (forward) and the `KVHistory` (backward)."""
        eng = self.engine
        bs, mc, dev = eng.config.block_size, eng.model_config, eng.state.device
        spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, eng.state.dtype, bs)
        num_blocks, tables = scratch_tables([len(s) for s in seqs], bs)
        caches = allocate_kv_caches(spec, num_blocks, dev)
        runner = ModelRunner(self.model, caches, bs, eng.dispatcher, dev)
        history = KVHistory()
        parts: list[list[torch.Tensor]] = [[] for _ in seqs]
        for k, step in enumerate(plan_chunks([len(s) for s in seqs], eng.config.max_num_batched_tokens)):
            planned = tuple(ScheduledSeq(str(i), tuple(seqs[i][lo:lo + n]), lo, tables[i], None)
                            for i, lo, n in step)
            batch = runner.prepare(SchedulerOutput(planned, sum(n for _, _, n in step)))
            grad = GradDispatcher(eng.dispatcher, history.step(k, tuple(i for i, _, _ in step),
                                                               tuple(lo + n < len(seqs[i]) for i, lo, n in step)))
            scope = _Scope(ForwardContext(attn=batch.attn, kv_caches=caches, dispatcher=grad))
            rows, targets, sizes, qs = [], [], [], 0
            for i, lo, n in step:  # row at position t scores token t + 1, for t in [P - 1, len - 2]
                s, first, last = seqs[i], max(lo, starts[i] - 1), min(lo + n, len(seqs[i]) - 1)
                rows += range(qs + first - lo, qs + last - lo)
                targets += s[first + 1:last + 1]
                sizes.append(max(0, last - first))
                qs += n
            with scope():  # a step with no scored rows still writes the KV later chunks read
                hidden = self._hidden(batch.input_ids, batch.positions, scope)  # [T, H]
                if not rows:
                    continue
                if what == "hidden":
                    got = hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=dev))
                else:
                    got = self._score_rows(hidden, rows, targets, scope, what == "entropy")
            for (i, _, _), piece in zip(step, got.split(sizes)):
                parts[i].append(piece)
        # [R] logprobs, [R, 2] (logprob, entropy) or [R, H]; a sequence scored in one step is its piece as is
        return [p[0] if len(p) == 1 else torch.cat(p) for p in parts]

    def _score_rows(self, hidden, rows, targets, scope: "_Scope", entropy: bool) -> torch.Tensor:
        """Chosen-token logprobs (and entropies) of `rows` of hidden, `logprob_chunk`
        rows at a time under checkpointing: [R] or [R, 2] float32."""
        dev = hidden.device
        rows_t, tgt_t = torch.tensor([rows, targets], dtype=torch.long, device=dev)  # one host-to-device copy
        score = scope.wrap(self._chosen_logprobs_entropy if entropy else self._chosen_logprobs)
        return torch.cat([checkpoint(score, hidden.index_select(0, rows_t[c:c + self.logprob_chunk]),
                                     tgt_t[c:c + self.logprob_chunk], use_reentrant=False)
                          for c in range(0, len(rows), self.logprob_chunk)])

    def _hidden(self, ids: torch.Tensor, positions: torch.Tensor, scope: "_Scope") -> torch.Tensor:
        if not self.checkpoint_layers:
            return self.model(ids, positions)
        m = self.model.model  # models.blocks.DecoderModel: embed_tokens, layers, norm
        x, residual = m.embed_tokens(ids), None
        for layer in m.layers:
            x, residual = checkpoint(scope.wrap(layer), positions, x, residual, use_reentrant=False)
        x, _ = m.norm(x, residual)
        return x

    def _log_softmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """The sampler's raw logprobs: log_softmax of the LM head's float32 logits,
        through the same ops (`sampling.sampler`). [C, V] float32."""
        from detent.selection import ops
        return ops.log_softmax(self.model.compute_logits(hidden))

    def _chosen_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._log_softmax(hidden).gather(1, targets[:, None])[:, 0]

    def _chosen_logprobs_entropy(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lp = self._log_softmax(hidden)
        return torch.stack([lp.gather(1, targets[:, None])[:, 0], -(lp.exp() * lp).sum(-1)], dim=1)

    # ------------------------------------------------------------ weights
    def checkpoint_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) for every weight, views of the parameters
        (detached): what `LLM.update_weights` takes."""
        return [(n, s.dest.detach()) for n, s in self.model.weight_sources().items()]

    def checkpoint_grads(self) -> dict[str, torch.Tensor | None]:
        """Each checkpoint tensor's gradient (a view of its parameter's .grad)."""
        out = {}
        params = list(self.model.parameters())
        for name, src in self.model.weight_sources().items():
            p = next(q for q in params if q.untyped_storage().data_ptr() == src.dest.untyped_storage().data_ptr())
            if p.grad is None:
                out[name] = None
                continue
            off = src.dest.storage_offset() - p.storage_offset()
            out[name] = p.grad.as_strided(src.dest.shape, src.dest.stride(), p.grad.storage_offset() + off)
        return out


class _Scope:
    """The trainer's dispatcher and forward context, entered for the forward
    and re-entered by checkpointed segments when they recompute in backward."""

    def __init__(self, ctx: ForwardContext):
        self.ctx = ctx  # carries the GradDispatcher

    @contextlib.contextmanager
    def __call__(self):
        with forward_context(self.ctx):
            yield

    def wrap(self, fn):
        def run(*args):
            with self():
                return fn(*args)
        return run
