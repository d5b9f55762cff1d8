"""`detent`: the command line.

    detent generate "What is the capital of France?"          # embedded SmolLM2, chat template
    detent generate --model DIR --raw --max-tokens 32 "Once upon a time"

The SelIR subcommands (`solve`, `tuple`) live in detent/selection_cli.py;
`battery` and `verify` (docs/battery.md) in detent/battery_cli.py; `tune`
(docs/tune.md) in detent/tune_cli.py.
"""
from __future__ import annotations

import argparse
import sys

from detent import __version__, battery_cli, selection_cli, tune_cli
from detent.engine.config import SELECTION_MODES


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a continuation of a prompt",
                       description="Print the model's continuation of PROMPT (greedy by default).")
    p.add_argument("prompt", nargs="+", help="the prompt (words are joined with spaces)")
    p.add_argument("--model", default=None, help="model directory, .gguf file, HF cache name or preset "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (temperature > 0)")
    p.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    p.add_argument("--selection", default="pinned", choices=SELECTION_MODES)
    p.add_argument("--tuple", default=None, help="commitment tuple (t.json)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from detent.engine import LLM, SamplingParams

    llm = LLM(model=args.model, tensor_parallel_size=args.tp, tuple=args.tuple, selection=args.selection,
              dtype=args.dtype, device=args.device, load_format=args.load_format,
              max_model_len=args.max_model_len)
    try:
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        text = " ".join(args.prompt)
        tok = llm.get_tokenizer()
        if not args.raw and tok is not None and getattr(tok, "chat_template", None):
            out = llm.chat([{"role": "user", "content": text}], params, use_tqdm=False)
        else:
            out = llm.generate([text], params, use_tqdm=False)
        print(out[0].outputs[0].text.strip())
    finally:
        llm.llm_engine.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="detent", description="Detent: batch-invariant LLM inference.")
    parser.add_argument("--version", action="version", version=f"detent {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    selection_cli.add_subparsers(sub)  # `solve`, `tuple`
    battery_cli.add_subparsers(sub)  # `battery`, `verify`
    tune_cli.add_subparsers(sub)  # `tune`
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"detent: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
