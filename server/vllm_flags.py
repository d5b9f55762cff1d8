"""The `vllm serve` flags Detent accepts beside its own (docs/server.md).

A vLLM command line pasted onto `detent-serve` either does what it does
under vLLM or stops at startup saying why: `--trust-remote-code` is refused
(Detent implements every architecture it serves, so it runs no code from a
checkpoint), and an unknown flag is argparse's usual error.
"""
from __future__ import annotations

import argparse
import codecs
import json
import os
import ssl
from typing import Any

from detent.server.reasoning import PARSERS as REASONING_PARSERS

REMOTE_CODE = ("--trust-remote-code: Detent runs no remote code; it implements each architecture it serves "
               "(Llama, Qwen3, Qwen3-MoE) in detent.models and loads only weights, config and tokenizer files "
               "from a checkpoint. Drop the flag.")


class _RefuseRemoteCode(argparse.Action):
    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=False, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(REMOTE_CODE)


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    from detent import __version__
    p.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                   help="the model, as `vllm serve MODEL` takes it (same as --model)")
    p.add_argument("--version", action="version", version=f"detent-serve {__version__}")
    p.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="read flags from a YAML file whose keys are flag names (dashes or underscores) and values "
                        "their arguments (true/false for switches); flags on the command line win")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory the engine may use, KV cache included (default 0.9)")
    p.add_argument("--enforce-eager", action="store_true", help="GPU: run every step eagerly, no CUDA graphs")
    from detent.engine import ATTENTION_BACKENDS
    p.add_argument("--attention-backend", default=None, choices=tuple(ATTENTION_BACKENDS),
                   help="the default tuple's attention: triton_paged (the default; split-KV decode) or fa4 "
                        "(FlashAttention-4, pip install \"detent[fa4]\": faster prompts, no split-KV decode); vLLM's "
                        "TRITON_ATTN and FLASH_ATTN name them. Not with --tuple (it names its own). Which is "
                        "faster depends on the traffic: docs/server.md")
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens per KV-cache block, the page attention reads (default 16); the tuple is made for "
                        "it: one made at another page size is refused")
    p.add_argument("--max-logprobs", type=int, default=None,
                   help="the most logprobs (top-k and prompt) a request may ask for (default 20)")
    p.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="this many KV-cache blocks, whatever the memory budget gives")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="only 'auto': the KV cache is kept in the model's dtype")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="on, always: long prompts are chunked by --max-num-batched-tokens, and the bits do not "
                        "depend on the chunking")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of shared prompt prefixes (default: on; same output bits either way)")
    p.add_argument("--uvicorn-log-level", default=None,
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="uvicorn's own log level (default: --log-level)")
    p.add_argument("--root-path", default="",
                   help="the path prefix a path-based proxy serves this server under (FastAPI's root_path); routes "
                        "answer with it or without it")
    p.add_argument("--allowed-origins", type=json_list, default=["*"], metavar="JSON",
                   help='CORS: the origins a browser page may call from, a JSON list (default ["*"])')
    p.add_argument("--allowed-methods", type=json_list, default=["*"], metavar="JSON",
                   help='CORS: the methods such a page may use (default ["*"])')
    p.add_argument("--allowed-headers", type=json_list, default=["*"], metavar="JSON",
                   help='CORS: the request headers such a page may send (default ["*"])')
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS: such a page may send credentials (cookies, HTTP authentication)")
    p.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no GET /openapi.json, /docs or /redoc")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access-log line per request (uvicorn writes one at INFO by default, as in vLLM)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate chain (PEM)")
    p.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM), if not in --ssl-certfile")
    p.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify client certificates with")
    p.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=(0, 1, 2),
                   help="client certificates: 0 not asked for (default), 1 optional, 2 required (ssl.CERT_*)")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log one line per request at INFO: id, endpoint, prompt tokens, sampling parameters (and "
                        "at --log-level debug each prompt)")
    p.add_argument("--max-log-len", type=int, default=None,
                   help="with --enable-log-requests at --log-level debug, where each prompt is logged: at most this "
                        "many of its characters and token ids (default: all)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line (throughput, requests, KV usage, prefix-cache hits; every "
                        "$DETENT_LOG_STATS_INTERVAL s, default 10)")
    p.add_argument("--profiler-config", default=None, metavar="JSON",
                   help="turn on POST /start_profile and /stop_profile: a torch profiler window over engine "
                        "steps, e.g. '{\"profiler\": \"torch\", \"torch_profiler_dir\": \"/tmp/prof\", "
                        "\"delay_iterations\": 300, \"max_iterations\": 200}' (vLLM's keys)")
    p.add_argument("--trust-remote-code", action=_RefuseRemoteCode, help="refused: Detent runs no remote code")
    p.add_argument("--tokenizer", default=None,
                   help="load the tokenizer, and its chat template, from this directory or HF cache name instead of "
                        "the model's")
    p.add_argument("--generation-config", default="auto",
                   help="default sampling parameters: 'auto' (the model's generation_config.json), 'vllm' "
                        "(none) or a directory holding a generation_config.json")
    p.add_argument("--chat-template", default=None,
                   help="the chat template: a file, or the template itself (default: the model's)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split chat output at <think>...</think> into `reasoning` and `content` (qwen3: none "
                        "when chat_template_kwargs.enable_thinking is false)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name each token 'token_id:ID', unless a request sets return_tokens_as_token_ids")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream carries usage, in each chunk and a last usage chunk, whatever its "
                        "stream_options say")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice 'auto' (the default with tools): the model may write tool calls in its text, "
                        "read by --tool-call-parser")
    # here, not at the top: the parsers need the HTTP side's dependencies, and a missing one
    # must refuse startup by name (server/cli.py main), not fail importing the CLI
    from detent.server.tool_parsers import PARSERS as TOOL_PARSERS
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSERS,
                   help="how tool calls are written: hermes (<tool_call>{...}</tool_call>: Qwen2.5, Qwen3), "
                        "llama3_json (Llama 3.1/3.2's JSON calls) or qwen3_coder (<tool_call><function=NAME>"
                        "<parameter=NAME>...: Qwen3-Coder, Qwen3.5; values typed by the request's tool schemas)")


def load_chat_template(value: str) -> str:
    """A file's text, or `value` itself when it reads as a template (it holds `{`, `}` or a
    newline; in ASCII input escapes such as \\n are decoded, as vLLM does); checked to parse."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            source = f.read()
    elif not any(c in value for c in "{}\n"):
        raise ValueError(f"--chat-template {value!r} looks like a file path, but there is no such file")
    else:
        # vLLM decodes escapes; only ASCII input, which the codec cannot mangle
        source = codecs.decode(value, "unicode_escape") if value.isascii() else value
    import jinja2
    try:
        jinja2.Environment().parse(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template does not parse as a Jinja template: {e}") from None
    return source


def server_tokenizer(tok, a: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The server's tokenizer, rendering with --chat-template when given, and the
    --generation-config sampling defaults (server/generation_config.py)."""
    from detent.engine import model_directory
    from detent.server.generation_config import sampling_defaults
    if a.chat_template is not None:
        if tok is None:
            raise ValueError("--chat-template: this model has no tokenizer to render chats with (give one with "
                             "--tokenizer)")
        tok.chat_template = a.chat_template
    model_dir = model_directory(a.model, a.load_format) if a.generation_config == "auto" else None
    return tok, sampling_defaults(a.generation_config, model_dir)


def json_list(text: str) -> list[str]:
    """A JSON list of strings: the CORS flags' argument, as vLLM takes it."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"give a JSON list of strings, such as '[\"*\"]', not {text!r}")
    return value


def expand_config(p: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`argv` with `--config FILE`'s flags put in, after a leading MODEL and before the
    rest, so that the command line's own flags win (vLLM's order)."""
    at = [i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    if not at:
        return argv
    if len(at) > 1:
        p.error("--config is given more than once")
    i = at[0]
    if argv[i] == "--config":
        if i + 1 == len(argv):
            p.error("argument --config: expected one argument")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    else:
        path, rest = argv[i].partition("=")[2], argv[:i] + argv[i + 1:]
    flags = config_flags(p, path)
    head = 1 if rest and not rest[0].startswith("-") else 0
    if head:
        flags.pop("model", None)  # MODEL on the command line wins over the file's
    return rest[:head] + [arg for args in flags.values() for arg in args] + rest[head:]


# the flags whose argument is JSON: a YAML list or mapping under their key is given as its JSON text
JSON_FLAGS = ("--allowed-origins", "--allowed-methods", "--allowed-headers", "--profiler-config")


def config_flags(p: argparse.ArgumentParser, path: str) -> dict[str, list[str]]:
    """A YAML config file's keys as the command-line arguments they stand for, by flag dest
    (`true` is the switch, `false` its `--no-` form where there is one, a list the
    arguments of a flag that takes several or a JSON flag's JSON text); a key that names
    no flag, or a value its flag cannot take, is an argparse error naming it."""
    import yaml
    if not path.endswith((".yaml", ".yml")):
        p.error(f"--config {path!r}: the config file must be YAML (.yaml or .yml)")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = yaml.safe_load(f)
    except OSError as e:
        p.error(f"--config {path!r}: {e.strerror}")
    except yaml.YAMLError as e:
        p.error(f"--config {path!r} is not valid YAML: {e}")
    if cfg is None:
        cfg = {}
    if not isinstance(cfg, dict):
        p.error(f"--config {path!r}: the file must map flag names to values, not be a {type(cfg).__name__}")
    actions = p._option_string_actions
    out: dict[str, list[str]] = {}
    for key, value in cfg.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or flag == "--config":
            p.error(f"--config {path!r}: unknown key {key!r} (there is no flag {flag})")
        if value is None:
            p.error(f"--config {path!r}: key {key!r} has no value")
        if action.nargs == 0:
            if not isinstance(value, bool):
                p.error(f"--config {path!r}: {key!r} is a switch: give true or false, not {value!r}")
            no = "--no-" + flag[2:]
            args = [flag] if value else [no] if no in actions else []
        elif isinstance(value, bool):
            p.error(f"--config {path!r}: {key!r} takes a value, not {str(value).lower()}")
        elif isinstance(value, list) and action.nargs in ("+", "*"):
            args = [flag, *map(str, value)] if value else []
        elif isinstance(value, (list, dict)):
            if flag not in JSON_FLAGS:
                kind = "list" if isinstance(value, list) else "mapping"
                p.error(f"--config {path!r}: {key!r} takes one value, not a {kind}")
            args = [f"{flag}={json.dumps(value)}"]
        else:
            args = [f"{flag}={value}"]
        out[action.dest] = args
    return out


def resolve_model(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """MODEL and --model name the same thing: either may be given, both only when they agree."""
    pos = a.__dict__.pop("model_positional")
    if pos is not None and a.model is not None and pos != a.model:
        p.error(f"the model is given twice and differs: MODEL {pos!r} and --model {a.model!r}; give one")
    if a.model is None:
        a.model = pos
    if a.generation_config not in ("auto", "vllm") and not os.path.isdir(a.generation_config):
        p.error(f"--generation-config {a.generation_config!r} is not a directory (give a directory, 'auto' or 'vllm')")
    if a.chat_template is not None:
        try:
            a.chat_template = load_chat_template(a.chat_template)
        except ValueError as e:
            p.error(str(e))
    if not 0.0 < a.gpu_memory_utilization <= 1.0:
        p.error(f"--gpu-memory-utilization must be in (0, 1], got {a.gpu_memory_utilization}")
    if a.kv_cache_dtype != "auto":
        p.error(f"--kv-cache-dtype {a.kv_cache_dtype}: Detent keeps the KV cache in the model's dtype; only "
                "'auto' is taken")
    if a.enable_auto_tool_choice and a.tool_call_parser is None:
        from detent.server.tool_parsers import PARSERS as TOOL_PARSERS  # imported by add_vllm_flags already
        p.error(f"--enable-auto-tool-choice needs --tool-call-parser ({' | '.join(TOOL_PARSERS)}): how the model "
                "writes its calls")
    if not a.enable_chunked_prefill:
        p.error("--no-enable-chunked-prefill: Detent always chunks long prompts (--max-num-batched-tokens), and a "
                "request's bits are the same however its prompt is chunked; drop the flag")
    if a.config is not None:  # an abbreviation (--conf FILE) that expand_config did not see
        p.error(f"--config: spell the flag out in full (got {a.config!r})")
    if a.root_path and (not a.root_path.startswith("/") or a.root_path.endswith("/")):
        p.error(f"--root-path {a.root_path!r}: give the proxy's path prefix, starting with / and not ending with "
                "one (e.g. /llm)")
    for name in ("ssl_keyfile", "ssl_ca_certs", "ssl_cert_reqs"):
        if getattr(a, name) and not a.ssl_certfile:
            p.error(f"--{name.replace('_', '-')} needs --ssl-certfile (without it the server speaks plain HTTP)")
    for name, least in (("block_size", 1), ("num_gpu_blocks_override", 1), ("max_logprobs", 0), ("max_log_len", 0)):
        v = getattr(a, name)
        if v is not None and v < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}, got {v}")
