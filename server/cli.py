"""`detent-serve`: build the engine, then serve it with uvicorn on uvloop.

The engine (model load, tuple validation) is built before the socket is
bound, so an illegal or mismatched commitment tuple refuses startup with
its validation message and exit status 2. uvicorn handles SIGTERM/SIGINT:
it stops accepting, lets requests finish (up to `--graceful-timeout`),
then the lifespan stops the engine thread and the process exits 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from detent.engine import MIXED_GRAPH_MAX_TOKENS, MIXED_GRAPH_MIN_TOKENS, SELECTION_MODES
from detent.server.vllm_flags import add_vllm_flags, expand_config, resolve_model, server_tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser("detent-serve", description="OpenAI-compatible server for the Detent engine")
    p.add_argument("--model", default=None,
                   help="model directory, HF cache name or preset (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("-tp", "--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--tuple", default=None, help="commitment tuple t.json (default: the default tuple)")
    p.add_argument("--selection", choices=SELECTION_MODES, default="pinned")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-mixed-batched-tokens", type=int, default=None,
                   help="a step that carries decodes takes at most this many tokens, so prompts never stall "
                        "generating requests behind one long step (default 2048; 0: the whole "
                        "--max-num-batched-tokens)")
    p.add_argument("--mixed-token-align", type=int, default=None,
                   help="a step that carries decodes and passes this many tokens ends on a multiple of it, "
                        "its last prompt chunk leaving the rest to the next step (a chunk another prompt "
                        "follows is taken whole; GEMM shapes; no bits change; default 1024; 0: off)")
    p.add_argument("--mixed-graph-max-tokens", type=int, default=None,
                   help="GPU: steps with prompt tokens of up to this many tokens (16 to 2048) replay one "
                        "whole-step CUDA graph, attention inside, as vLLM's full graphs do up to 512 (no bits "
                        "change; default 2048; 0: off, those steps replay the piecewise graphs)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core in its own process, so HTTP work never holds the GIL the step "
                        "loop needs (default: on)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan and launch the next step while the device runs the current one "
                        "(default: on for CUDA; same output bits either way)")
    p.add_argument("--warm-start", action=argparse.BooleanOptionalAction, default=None,
                   help="before serving, run every kernel configuration the tuple can select, so no request "
                        "waits for a compile (default: on for CUDA; same output bits either way)")
    p.add_argument("--api-key", default=os.environ.get("DETENT_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $DETENT_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) the API accepts in `model` (default: the --model argument)")
    p.add_argument("--max-queue-len", type=int, default=256,
                   help="refuse new requests with 503 while this many are waiting")
    p.add_argument("--max-queued-grammar-compiles", type=int, default=64,
                   help="refuse a structured-output request with a new spec with 503 while this many grammar "
                        "compiles wait in its lane (small or large specs); a spec already compiling or compiled "
                        "is served; 0: no bound (default 64)")
    p.add_argument("--graceful-timeout", type=float, default=5.0)
    p.add_argument("--rl", action="store_true",
                   help="RL sampling contract: every request must carry a seed and temperature > 0")
    p.add_argument("--allowed-weight-dir", action="append", default=[],
                   help="allow POST /v1/update_weights to read safetensors inside DIR (repeatable; "
                        "default: weight updates refused)")
    p.add_argument("--request-log", default=None, metavar="PATH",
                   help="append one JSON line per finished request to PATH (prompt ids, sampling parameters "
                        "with the seed, hashes, tokens, logprobs), for `detent verify` (docs/verify.md)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    _limit_flags(p)
    add_vllm_flags(p)
    a = p.parse_args(expand_config(p, sys.argv[1:] if argv is None else list(argv)))
    resolve_model(p, a)
    if a.request_log is not None:
        try:
            open(a.request_log, "ab").close()
        except OSError as e:
            p.error(f"--request-log {a.request_log!r} cannot be opened for appending: {e.strerror}")
    for d in a.allowed_weight_dir:
        if not os.path.isdir(d):
            p.error(f"--allowed-weight-dir {d!r} is not a directory")
    if a.mixed_token_align is not None and a.mixed_token_align < 0:
        p.error(f"--mixed-token-align must be >= 0, got {a.mixed_token_align}")
    if a.mixed_graph_max_tokens and not MIXED_GRAPH_MIN_TOKENS <= a.mixed_graph_max_tokens <= MIXED_GRAPH_MAX_TOKENS:
        p.error(f"--mixed-graph-max-tokens must be 0 (off) or {MIXED_GRAPH_MIN_TOKENS} to {MIXED_GRAPH_MAX_TOKENS}, "
                f"got {a.mixed_graph_max_tokens}")
    if a.max_mixed_batched_tokens is not None and a.max_mixed_batched_tokens < 0:
        p.error(f"--max-mixed-batched-tokens must be >= 0, got {a.max_mixed_batched_tokens}")
    for name in ("tp", "max_queue_len", "max_queued_grammar_compiles", "port"):
        if getattr(a, name) < (0 if name in ("max_queue_len", "max_queued_grammar_compiles") else 1):
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name)}")
    try:
        a.limits = limits_from_args(a)
    except ValueError as e:
        p.error(str(e))
    a.profiler = None
    if a.profiler_config is not None:
        from detent.engine import ProfilerConfig
        try:
            a.profiler = ProfilerConfig.from_json(a.profiler_config)
        except ValueError as e:
            p.error(str(e))
    return a


# flag -> ServerLimits field (server/limits.py says what each bounds)
LIMIT_FLAGS = {
    "--max-request-bytes": ("max_request_bytes", int, "refuse larger request bodies with 413"),
    "--request-timeout": ("request_timeout_s", float, "seconds to receive a request body, else 408"),
    "--max-prompts-per-request": ("max_prompts", int, "prompts in one completion request"),
    "--max-n": ("max_n", int, "samples per prompt (n, best_of)"),
    "--max-sequences-per-request": ("max_sequences", int, "prompts x n in one request"),
    "--max-logprob-entries": ("max_logprob_entries", int,
                              "logprob values one response may hold (tokens x (top-k + 1), prompt and output)"),
    "--max-chars-per-token": ("chars_per_token", int,
                              "a prompt over max-model-len x this many characters is refused before tokenizing"),
    "--chat-template-timeout": ("chat_template_timeout_s", float, "seconds to render one conversation"),
    "--preprocess-workers": ("preprocess_workers", int, "threads that tokenize and render chat templates"),
    "--max-verify-records": ("max_verify_records", int, "request records in one POST /v1/verify body"),
}


def _limit_flags(p: argparse.ArgumentParser) -> None:
    from detent.server.limits import ServerLimits
    d = ServerLimits()
    for flag, (name, typ, doc) in LIMIT_FLAGS.items():
        p.add_argument(flag, dest=name, type=typ, default=getattr(d, name), help=f"{doc} (default {getattr(d, name)})")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat template in the request (chat_template, chat_template_kwargs.chat_template); "
                        "off by default: a template is code, and a client's can loop for as long as it likes")


def limits_from_args(a: argparse.Namespace):
    from detent.server.limits import ServerLimits
    kw = {name: getattr(a, name) for name, _, _ in LIMIT_FLAGS.values()}
    return ServerLimits(trust_request_chat_template=a.trust_request_chat_template, **kw)


def engine_kwargs(a: argparse.Namespace) -> dict:
    kw = dict(model=a.model, tensor_parallel_size=a.tp, tuple=a.tuple, selection=a.selection, dtype=a.dtype,
              device=a.device, enable_prefix_caching=a.enable_prefix_caching, load_format=a.load_format,
              seed=a.seed, max_model_len=a.max_model_len, async_scheduling=a.async_scheduling, rl=a.rl,
              gpu_memory_utilization=a.gpu_memory_utilization, enforce_eager=a.enforce_eager,
              warmup=a.warm_start, attention_backend=a.attention_backend, tokenizer=a.tokenizer)
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_mixed_batched_tokens", "mixed_token_align",
                 "mixed_graph_max_tokens", "block_size"):
        if getattr(a, name) is not None:
            kw[name] = getattr(a, name)
    if a.max_logprobs is not None:
        kw["max_logprobs"] = a.max_logprobs
    if a.num_gpu_blocks_override is not None:
        kw["num_gpu_blocks"] = a.num_gpu_blocks_override
    for name in ("max_mixed_batched_tokens", "mixed_token_align"):  # 0: off
        if getattr(a, name) == 0:
            kw[name] = None
    kw["max_queued_grammar_compiles"] = a.max_queued_grammar_compiles or None  # 0: no bound
    return kw


def build_state(a: argparse.Namespace):
    """The engine (in its own process unless --no-engine-process), the tokenizer, the server state."""
    import functools

    from detent.engine import LLM, CoreProcess, build_engine, load_tokenizer
    from detent.server.async_engine import AsyncCoreEngine, AsyncEngine
    from detent.server.serving import ServerState

    kw = engine_kwargs(a)
    if a.engine_process:
        core = CoreProcess(functools.partial(build_engine, **kw))
        try:
            info = core.wait_ready()
            tok, defaults = server_tokenizer(load_tokenizer(a.model, a.load_format, a.tokenizer), a)
        except BaseException:
            core.stop(10)
            raise
        engine = AsyncCoreEngine(core, max_queue_len=a.max_queue_len)
        fp, limits = info.fingerprint, info.limits
    else:
        llm = LLM(**kw)
        try:
            tok, defaults = server_tokenizer(llm.get_tokenizer(), a)
        except BaseException:
            llm.shutdown()
            raise
        engine = AsyncEngine(llm.llm_engine, max_queue_len=a.max_queue_len)
        fp, limits = llm.llm_engine.fingerprint(), llm.llm_engine.limits()
    print(f"detent-serve: KV cache {limits.kv_cache_tokens:,} tokens in blocks of {limits.block_size}; maximum "
          f"concurrency for {limits.max_model_len:,} tokens per request: "
          f"{limits.kv_cache_tokens / limits.max_model_len:.2f}x", file=sys.stderr, flush=True)
    if defaults:
        print(f"detent-serve: default sampling parameters from --generation-config {a.generation_config}: "
              f"{defaults} (a request's own values win)", file=sys.stderr, flush=True)
    names = a.served_model_name or [a.model or "smollm2-135m-instruct"]
    request_log = None
    if a.request_log is not None:
        import time

        from detent import __version__
        from detent.engine import server_record
        from detent.server.request_log import RequestLog
        request_log = RequestLog(a.request_log, server_record(fp, names[0], time.time(), __version__))
    return ServerState(
        engine=engine, tokenizer=tok, served_model_names=names,
        model_root=a.model or "embedded:SmolLM2-135M-Instruct",
        max_model_len=limits.max_model_len, vocab_size=limits.vocab_size, eos_token_ids=limits.eos_token_ids,
        block_size=limits.block_size,
        tuple_hash=fp.tuple_hash, deployment_hash=fp.deployment_hash,
        selection=a.selection, api_key=a.api_key or None, limits=a.limits,
        allowed_weight_dirs=tuple(a.allowed_weight_dir), log_requests=a.enable_log_requests, max_log_len=a.max_log_len,
        log_stats=not a.disable_log_stats, engine_fingerprint=fp, request_log=request_log,
        sampling_defaults=defaults, profiler_config=a.profiler, cache_config=cache_config(a, limits),
        reasoning_parser=a.reasoning_parser, tool_parser=a.tool_call_parser if a.enable_auto_tool_choice else None,
        return_tokens_as_token_ids=a.return_tokens_as_token_ids, force_include_usage=a.enable_force_include_usage,
        **app_options(a))


def app_options(a: argparse.Namespace) -> dict[str, Any]:
    """The ServerState fields that shape the HTTP app (server/app.py)."""
    return dict(root_path=a.root_path, openapi=not a.disable_fastapi_docs,
                cors=dict(allow_origins=a.allowed_origins, allow_methods=a.allowed_methods,
                          allow_headers=a.allowed_headers, allow_credentials=a.allow_credentials))


def cache_config(a: argparse.Namespace, limits) -> dict[str, str]:
    """vLLM's cache_config_info labels that Detent has: the KV cache's settings as strings."""
    return {"block_size": str(limits.block_size), "cache_dtype": "auto",
            "enable_prefix_caching": str(a.enable_prefix_caching),
            "gpu_memory_utilization": str(a.gpu_memory_utilization),
            "num_gpu_blocks": str(limits.kv_cache_tokens // limits.block_size + 1)}  # the null block too


def uvicorn_options(a: argparse.Namespace) -> dict[str, Any]:
    """uvicorn.Config's arguments from the flags, the app aside."""
    level = a.uvicorn_log_level or a.log_level
    return dict(host=a.host, port=a.port, log_level=level,
                access_log=not a.disable_uvicorn_access_log,  # its lines are INFO: shown at info and debug
                timeout_graceful_shutdown=a.graceful_timeout, ssl_keyfile=a.ssl_keyfile,
                ssl_certfile=a.ssl_certfile, ssl_ca_certs=a.ssl_ca_certs, ssl_cert_reqs=a.ssl_cert_reqs)


def check_tls(options: dict[str, Any]) -> None:
    """Loads the TLS certificate and key as uvicorn will, so that a bad one refuses startup
    before the model loads, not after."""
    import uvicorn
    from uvicorn.config import create_ssl_context

    c = uvicorn.Config(None, **options)
    if c.is_ssl:
        create_ssl_context(certfile=c.ssl_certfile, keyfile=c.ssl_keyfile, password=c.ssl_keyfile_password,
                           ssl_version=c.ssl_version, cert_reqs=c.ssl_cert_reqs, ca_certs=c.ssl_ca_certs,
                           ciphers=c.ssl_ciphers)


def serve(state, options: dict[str, Any]) -> None:
    """Serves `state` with uvicorn under `options` (uvicorn_options) until SIGTERM/SIGINT."""
    import uvicorn

    from detent.server.app import build_app

    graceful_timeout = options["timeout_graceful_shutdown"]

    class Server(uvicorn.Server):
        draining = False

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after its graceful shutdown, so the
            # process would die by it; a clean SIGTERM shutdown exits 0 instead
            self._captured_signals.clear()
            loop = state.engine._loop
            if not self.draining and loop is not None:
                # streams get until shortly before --graceful-timeout to finish; then each
                # ends with an error event and [DONE] instead of being cut by uvicorn
                self.draining = True
                grace = max(0.0, graceful_timeout - min(1.0, graceful_timeout / 2))
                loop.call_soon_threadsafe(loop.call_later, grace, state.engine.end_streams,
                                          "the server is shutting down (SIGTERM): this stream was ended before "
                                          "it finished")

    config = uvicorn.Config(build_app(state), loop="uvloop", lifespan="on", log_config=_uvicorn_log_config(),
                            **options)
    server = Server(config)
    # The engine thread runs Python between torch calls; with the default 5 ms
    # GIL switch interval every event-loop wake-up (accept, read, write) can
    # wait that long behind it, and at 64 streams requests queued for seconds
    # before their handler ran (benchmarks/serve.py, docs/performance.md).
    sys.setswitchinterval(0.001)
    print(f"detent-serve: serving {state.model_name!r} on {'https' if config.is_ssl else 'http'}://"
          f"{config.host}:{config.port} "
          f"(tuple {state.tuple_hash[:16]}, deployment {state.deployment_hash[:16]}, {state.selection})",
          file=sys.stderr, flush=True)
    server.run()
    if not server.started:
        sys.exit(1)  # e.g. the port is taken; uvicorn logged why


LOG_DATEFMT = "%m-%d %H:%M:%S"


def _uvicorn_log_config() -> dict:
    """uvicorn's own logging config with a timestamp on every line, as ours has."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    for f in cfg.get("formatters", {}).values():
        if "fmt" in f:
            f["fmt"] = "%(asctime)s " + f["fmt"]
            f["datefmt"] = LOG_DATEFMT
    return cfg


def main(argv: list[str] | None = None) -> None:
    try:
        a = parse_args(argv)
    except ImportError as e:  # a partial install: the flags' own modules (tool-call parsers) need it
        print(f"detent-serve: refusing to start: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt=LOG_DATEFMT)
    if a.enable_log_requests:  # asked for by name: shown even under a quieter --log-level (and the prompts at debug)
        logging.getLogger("detent.server.requests").setLevel(min(logging.INFO, logging.getLogger().level))
    try:
        if not a.disable_log_stats:
            from detent.server.stats_log import interval_s
            interval_s()  # a bad $DETENT_LOG_STATS_INTERVAL refuses startup, not the first tick
        # the HTTP side's imports before the engine: a missing dependency refuses in seconds, not
        # after the model loaded and the kernels warmed
        import uvicorn  # noqa: F401

        import detent.server.app  # noqa: F401
        options = uvicorn_options(a)
        check_tls(options)
        state = build_state(a)
    except Exception as e:  # a bad tuple, model, flag or install: say why and refuse to start
        print(f"detent-serve: refusing to start: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    from detent.engine import freeze_startup_heap
    freeze_startup_heap()  # the API process's startup heap, as the core freezes its own
    try:
        serve(state, options)
    except BaseException:
        # the engine core is a child process this one waits for at exit: stop it, or a failure
        # here leaves the server alive and unable to serve
        state.engine.shutdown()
        raise
    print("detent-serve: stopped", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
