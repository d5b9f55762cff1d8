"""`LLM`: the offline API, with vLLM's names.

    from detent.engine import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any, Sequence

from detent.engine.config import EngineConfig
from detent.engine.inputs import text_content
from detent.engine.llm_engine import LLMEngine
from detent.engine.outputs import RequestOutput
from detent.engine.vllm_args import refuse_vllm_only
from detent.models.tokenizer import cut_at_final_message, open_final_message
from detent.sampling.params import SamplingParams

PromptType = str | dict


class LLM:
    def __init__(self, model: str | None = None, tensor_parallel_size: int = 1, tuple: str | None = None,
                 selection: str = "pinned", dtype: str = "auto", device: str = "auto",
                 enable_prefix_caching: bool = True, max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, block_size: int = 16,
                 load_format: str = "auto", seed: int = 0, **kwargs: Any):
        """Extra keyword arguments: tokenizer, gpu_memory_utilization, kv_cache_memory_bytes,
        num_gpu_blocks, max_logprobs, enforce_eager, async_scheduling, freeze_gc, warmup, rl (see EngineConfig).
        vLLM-only ones (attention_config, compilation_config, ...) are a ValueError saying what
        Detent uses instead (engine/vllm_args.py)."""
        refuse_vllm_only(kwargs)
        config = EngineConfig(model=model, tensor_parallel_size=tensor_parallel_size, tuple=tuple,
                              selection=selection, dtype=dtype, device=device,
                              enable_prefix_caching=enable_prefix_caching, max_model_len=max_model_len,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              block_size=block_size, load_format=load_format, seed=seed, **kwargs)
        self.llm_engine = LLMEngine(config)
        self._counter = itertools.count()

    @classmethod
    def from_model(cls, model, model_config, tokenizer=None, **kwargs: Any) -> "LLM":
        """An LLM over an already built model (tests, custom modules). The
        model must follow the contract in docs/architecture.md."""
        refuse_vllm_only(kwargs)
        self = cls.__new__(cls)
        self.llm_engine = LLMEngine(EngineConfig(**kwargs), model=model, model_config=model_config,
                                    tokenizer=tokenizer)
        self._counter = itertools.count()
        return self

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def update_weights(self, named_tensors) -> int:
        """New weights, in the checkpoint's names: an iterable of (name, tensor)
        or a state dict. All are checked before any is copied (in place, each
        rank its shard); the prefix cache is reset. Returns the number copied;
        raises WeightUpdateError (nothing changed) on an unknown name, a wrong
        shape or dtype, a non-finite value, a meta tensor, or while requests are running."""
        self._check_open()
        return self.llm_engine.update_weights(named_tensors)

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel ranks and grammar workers. Idempotent; the
        LLM serves no more requests afterwards."""
        self._shut_down = True
        self.llm_engine.shutdown()

    def reset_prefix_cache(self) -> bool:
        self._check_open()
        return self.llm_engine.reset_prefix_cache()

    def _check_open(self) -> None:
        if getattr(self, "_shut_down", False):
            raise RuntimeError("this LLM was shut down (LLM.shutdown()); make a new one")

    # ------------------------------------------------------------ generation
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """A prompt is a string or {"prompt_token_ids": [...]} (optionally
        with "prompt"); `sampling_params` is one for all or one per prompt.
        Returns the finished outputs in prompt order."""
        self._check_open()
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (str, bytes, Mapping)) or not isinstance(sampling_params, Iterable):
            raise TypeError("sampling_params must be a SamplingParams or a list of them (one per prompt), "
                            f"got {type(sampling_params).__name__}")
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params")
        for i, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(sp).__name__}")
        ids = []
        try:
            for p, sp in zip(prompts, params):
                text, token_ids = self._tokenize(p)
                rid = str(next(self._counter))
                self.llm_engine.add_request(rid, token_ids, sp, prompt=text)
                ids.append(rid)
        except BaseException:  # a prompt refused: the batch's earlier ones must not run on, unseen (as vLLM)
            self.llm_engine.withdraw_requests(ids)
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None, *, chat_template: str | None = None,
             continue_final_message: bool = False, tools: list[dict] | None = None) -> list[RequestOutput]:
        """Render one conversation (a list of {"role", "content"}) or a list
        of them with the model's chat template (or `chat_template`), then generate.
        vLLM's arguments: `tools` are passed to the template; `continue_final_message`
        leaves the last (assistant) message open for the model to continue (no generation
        prompt), as detent-serve's field does."""
        self._check_open()
        tok = self.get_tokenizer()
        if tok is None or not hasattr(tok, "apply_chat_template"):
            raise ValueError("chat needs a tokenizer with a chat template")
        convs = _conversations(messages)
        prompts = []
        for conv in convs:
            final = None
            if continue_final_message:
                conv, final = open_final_message(conv)
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt and not
                                           continue_final_message, tools=tools,
                                           chat_template=chat_template, **(chat_template_kwargs or {}))
            if final is not None:
                text = cut_at_final_message(text, final)
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _tokenize(self, p: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(p, str):
            tok = self.get_tokenizer()
            if tok is None:
                raise ValueError("a text prompt needs a tokenizer; pass {'prompt_token_ids': [...]}")
            return p, tok.encode(p)
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                return p.get("prompt"), p["prompt_token_ids"]  # checked by add_request
            if "prompt" in p:
                return self._tokenize(p["prompt"])
        raise ValueError(f"a prompt is a str or a dict with 'prompt_token_ids' or 'prompt', got {type(p).__name__}")

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        eng = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        want = set(ids)
        in_toks = out_toks = 0
        try:
            while eng.has_unfinished_requests() and not want <= done.keys():
                outs = eng.step()
                eng.pause_if_idle(outs)
                for out in outs:
                    if out.finished and out.request_id in want:
                        done[out.request_id] = out
                        if bar is not None:  # as vLLM's bar: token throughput since the start
                            in_toks += len(out.prompt_token_ids) * len(out.outputs)
                            out_toks += sum(len(c.token_ids) for c in out.outputs)
                            elapsed = max(bar.format_dict["elapsed"], 1e-9)
                            bar.set_postfix_str(f"est. speed input: {in_toks / elapsed:.2f} toks/s, "
                                                f"output: {out_toks / elapsed:.2f} toks/s", refresh=False)
                            bar.update(1)
        except BaseException:  # an engine error or Ctrl-C: this call's unfinished requests must not
            eng.withdraw_requests([i for i in ids if i not in done])  # run on unseen (as vLLM)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]


def _conversations(messages: Any) -> list[list[dict]]:
    """`LLM.chat`'s messages as a list of conversations, or a TypeError naming the argument:
    one conversation (a list of message dicts) or a list of them. A message's content becomes
    the template's string as on the server's chat route (OpenAI's text parts joined, None as
    ""); a part that is not text is a ValueError naming it."""
    want = "messages must be a list of message dicts ({'role': ..., 'content': ...}) or a list of such lists"
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"{want}, got {type(messages).__name__}")
    convs = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
    out = []
    for i, conv in enumerate(convs):
        if isinstance(conv, (str, bytes, Mapping)) or not isinstance(conv, Sequence):
            raise TypeError(f"{want}; messages[{i}] is a {type(conv).__name__}")
        msgs = []
        for j, m in enumerate(conv):
            where = f"messages[{j}]" if conv is messages else f"messages[{i}][{j}]"
            if not isinstance(m, Mapping):
                raise TypeError(f"{want}; {where} is a {type(m).__name__}")
            msgs.append({**m, "content": text_content(m["content"], f"{where}.content")} if "content" in m else m)
        out.append(msgs)
    return out
