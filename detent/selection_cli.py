"""`detent solve` and `detent tuple` (self-contained: `detent.selection_cli.main(argv)`
or `python -m detent.selection_cli solve ...`; the top-level `detent` CLI
mounts them with `add_subparsers(subparsers)`).

    detent solve --family attention --facts facts.json
    detent solve --family attention --model PATH --tp 2 [--device cuda]
    detent tuple default --model PATH -o t.json
    detent tuple check t.json --model PATH
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def _facts(args: argparse.Namespace) -> dict[str, Any]:
    from detent.selection.facts import complete, default_facts_for
    if args.facts:
        try:
            with open(args.facts) as f:
                facts = json.load(f)
        except OSError as e:
            raise SystemExit(f"error: cannot read --facts {args.facts}: {e.strerror}")
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: --facts {args.facts}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}")
        if not isinstance(facts, dict):
            raise SystemExit(f"error: --facts {args.facts} must hold a JSON object of facts")
        return complete(facts)
    if not args.model:
        raise SystemExit("error: give --facts FILE or --model PATH")
    if args.model == "embedded" or args.model.endswith(".gguf"):
        from gguf import GGUFReader
        from detent.models.gguf import embedded_gguf_path, gguf_config
        path = embedded_gguf_path() if args.model == "embedded" else args.model
        try:
            cfg = gguf_config(GGUFReader(path))
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: --model {args.model}: cannot read the GGUF metadata ({e})")
    elif not os.path.exists(args.model) and _preset_config(args.model) is not None:
        cfg = _preset_config(args.model)  # a preset name: its built-in config (as load_format="dummy")
    else:
        cfg_path = os.path.join(args.model, "config.json") if os.path.isdir(args.model) else args.model
        try:
            with open(cfg_path) as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"error: --model {args.model}: cannot read a config.json ({e})")
    cfg = cfg.get("text_config", cfg)
    max_ctx = args.max_context or int(cfg.get("max_position_embeddings", 4096))
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    return default_facts_for(cfg, device=args.device, dtype=dtype, tp=args.tp, page_size=args.page_size,
                             max_context=max_ctx, max_num_batched_tokens=args.max_num_batched_tokens,
                             max_num_seqs=args.max_num_seqs)


def _preset_config(name: str) -> dict | None:
    from detent.models.presets import preset
    p = preset(name)
    return None if p is None else dict(p["config"])


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--facts", help="deployment facts (JSON object)")
    p.add_argument("--model", help="HF model directory (config.json), a .gguf file, a preset name (llama-3.1-8b, ...), or 'embedded' "
                   "(the bundled SmolLM2) to derive facts from")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-context", "--max-model-len", dest="max_context", type=int, default=None,
                   help="the longest sequence served (the engine's max_model_len; default: the model's "
                   "max_position_embeddings)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)


def _fmt(vals: tuple, limit: int = 12) -> str:
    s = ", ".join(repr(v) for v in vals[:limit])
    return s + (f", ... ({len(vals)} in all)" if len(vals) > limit else "")


def cmd_solve(args: argparse.Namespace) -> int:
    from detent.selection import programs
    from detent.selection.facts import site_key, sites_for
    from detent.selection.compiler.solver import solve
    facts = _facts(args)
    try:
        prog = programs.load(args.family)
    except KeyError as e:
        raise SystemExit(f"error: {e.args[0]}")
    sites = sites_for(facts, args.family)
    if args.site:
        site = {}
        for part in args.site.split(","):
            k, _, v = part.partition("=")
            site[k] = int(v) if v.lstrip("-").isdigit() else v
        sites = [site]
    sites = sites or [{}]
    for site in sites:
        t0 = time.perf_counter()
        sol = solve(prog, {**facts, **site}, level=args.level, cut=not args.no_cut, cache=not args.no_cache)
        t_solve = time.perf_counter() - t0
        cands = sol.candidates
        legal = sol.legal
        default = sol.default_assignment()
        t_all = time.perf_counter() - t0
        g = sol.graph
        print(f"family {args.family}  site {site_key(site) or '-'}  ({prog.filename})")
        print(f"  graph: {g.nodes} values, {g.data_edges} data + {g.control_edges} control edges, "
              f"{g.inputs} batch-dependent inputs, {g.tainted} batch-dependent values")
        print(f"  selection points: {g.selection_points}; batch-dependent: {', '.join(g.batch_dependent_points) or 'none'}")
        print(f"  pins ({len(sol.pins)}): {', '.join(sol.pins) or 'none'}")
        for p, vals in cands.items():
            print(f"    {p}: {len(vals)} candidates: {_fmt(vals)}")
        for k, (choices, d) in sol.knobs.items():
            print(f"  knob {k}: {list(choices)} (default {d!r})")
        print(f"  assignments: {sol.num_candidates} candidate, {len(legal)} legal")
        print(f"  default: {default}")
        print(f"  time: solve {t_solve * 1e3:.1f} ms{' (JIT cache hit)' if sol.from_cache else ''}, "
              f"with VRA {t_all * 1e3:.1f} ms")
    return 0


def _knobs(items: list[str] | None) -> dict[str, dict]:
    """--knob FAMILY.NAME=VALUE (repeatable) as {family: {name: value}}; values as JSON when they
    parse (true, 64), else strings (exp2)."""
    out: dict[str, dict] = {}
    for item in items or ():
        key, eq, raw = item.partition("=")
        fam, dot, name = key.partition(".")
        if not (eq and dot and fam and name):
            raise SystemExit(f"error: --knob {item!r}: expected FAMILY.NAME=VALUE, e.g. attention.softmax=exp2")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out.setdefault(fam, {})[name] = value
    return out


def cmd_tuple(args: argparse.Namespace) -> int:
    from detent.selection.compiler.commitment import CommitmentTuple, TupleError, default_tuple
    facts = _facts(args)
    try:
        if args.action == "default":
            knobs = _knobs(args.knob)
            if args.attention:
                knobs.setdefault("attention", {})["impl"] = args.attention
            t = default_tuple(facts, knobs=knobs or None)
            if args.output:
                t.save(args.output)
                print(f"wrote {args.output} (tuple hash {t.hash[:16]}, deployment hash "
                      f"{t.to_dict()['deployment']['hash'][:16]})")
            else:
                sys.stdout.write(t.to_json())
            return 0
        if not args.path:
            raise SystemExit("error: detent tuple check needs the tuple path")
        t = CommitmentTuple.load(args.path)
        t.validate(facts)
        print(f"{args.path}: OK (tuple hash {t.hash[:16]}; families: {', '.join(sorted(t.families)) or 'none'})")
        return 0
    except TupleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def add_subparsers(subparsers) -> None:
    ps = subparsers.add_parser("solve", help="solve a family's SelIR program for a deployment")
    ps.add_argument("--family", required=True)
    ps.add_argument("--site", help="one call site's facts, e.g. n=4096,k=4096,dtype=bfloat16")
    ps.add_argument("--level", choices=("full", "fold"), default="full")
    ps.add_argument("--no-cut", action="store_true", help="pin every batch-dependent selection point")
    ps.add_argument("--no-cache", action="store_true", help="skip the JIT cache")
    _common(ps)
    ps.set_defaults(func=cmd_solve)
    pt = subparsers.add_parser("tuple", help="make or check a commitment tuple")
    pt.add_argument("action", choices=("default", "check"))
    pt.add_argument("path", nargs="?", help="the tuple to check")
    pt.add_argument("-o", "--output", help="where `default` writes the tuple (stdout if omitted)")
    pt.add_argument("--attention", choices=("triton_paged", "fa4"), default=None,
                    help="`default`: the attention implementation (knob attention.impl) for every step, on CUDA")
    pt.add_argument("--knob", action="append", metavar="FAMILY.NAME=VALUE",
                    help="`default`: set a knob for the whole family (repeatable), e.g. attention.softmax=exp2; "
                         "`detent solve --family F` lists a family's knobs and their values")
    _common(pt)
    pt.set_defaults(func=cmd_tuple)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="detent", description="Detent kernel selection (SelIR) tools")
    add_subparsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
