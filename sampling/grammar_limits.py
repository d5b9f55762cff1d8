"""Bounds on what a request may ask a grammar compiler to do.

xgrammar's compile time and memory grow with a schema's size: two
3,000-property schemas kept compile workers busy for minutes. A spec over a
limit is refused before anything compiles, with a ValueError that names the
field, the limit and its value (a 400 at the server). The defaults follow
the published limits of hosted structured outputs (OpenAI: 5,000 properties,
10 levels of nesting, 1,000 enum values) scaled down to what compiles in a
few seconds for a 50k-token vocabulary; the compile timeout bounds the rest.

`max_queued_compiles` bounds what all requests together ask: the compile
jobs waiting in one lane (grammar_workers.py). Each may run to the compile
timeout, so a request behind N of them waits up to N timeouts; past the
bound a request with a new spec is refused at once (CompileQueueFull), and
one whose spec is already compiling or compiled is not. None (the default,
and the offline LLM's: its caller waits for its own specs, as vLLM's) is no
bound; detent-serve sets 64 (EngineConfig.max_queued_grammar_compiles,
--max-queued-grammar-compiles) and answers the refusal 503.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from detent.sampling.params import StructuredOutputs


@dataclass(frozen=True)
class GrammarLimits:
    max_spec_bytes: int = 64 * 1024  # the schema / regex / EBNF / choices, as UTF-8 JSON text
    max_schema_properties: int = 1000  # object properties summed over the whole schema
    max_schema_depth: int = 16  # nesting of JSON objects and arrays in the schema
    max_enum_values: int = 1000  # enum + const values summed over the whole schema
    max_choices: int = 1000
    # compile jobs waiting in one lane, the one compiling aside (a spec already compiling or
    # compiled adds none); None: no bound
    max_queued_compiles: int | None = None

    def __post_init__(self):
        for name, v in self.__dict__.items():
            if name == "max_queued_compiles" and v is None:
                continue
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"GrammarLimits.{name} must be a positive int, got {v!r}")


def _over(field: str, what: str, name: str, limit: int) -> ValueError:
    return ValueError(f"{field} {what}; the limit is {name} = {limit}")


def check_spec_size(kind: str, value: Any, limits: GrammarLimits = GrammarLimits(), field: str | None = None) -> None:
    """Raise ValueError naming the limit if a spec's value (`kind`: json, regex, grammar, choice, ...)
    is over max_spec_bytes. Checked before the value is validated, too (a server does so
    for a request's spec): checking a 5 MB schema against its meta-schema took 18 s. `field`: the
    name the message opens with (default structured_outputs.KIND; a server names the field the
    client sent, response_format.json_schema.schema or guided_json)."""
    size = len(json.dumps([kind, value], sort_keys=True, ensure_ascii=False).encode())
    if size > limits.max_spec_bytes:
        raise _over(field or f"structured_outputs.{kind}", f"is {size} bytes", "max_spec_bytes", limits.max_spec_bytes)


def check_limits(spec: StructuredOutputs, limits: GrammarLimits = GrammarLimits(), field: str | None = None) -> None:
    """Raise ValueError naming the limit if `spec` is larger than `limits` allow (`field`: as
    check_spec_size's)."""
    kind = spec.kind
    field = field or f"structured_outputs.{kind}"
    check_spec_size(kind, getattr(spec, kind), limits, field)
    if kind == "choice" and len(spec.choice) > limits.max_choices:
        raise _over(field, f"has {len(spec.choice)} choices", "max_choices", limits.max_choices)
    if kind != "json":
        return
    schema = spec.json if not isinstance(spec.json, str) else json.loads(spec.json)
    props = enums = 0
    stack = [(schema, 1)]
    while stack:  # iterative: a deep schema must not reach Python's recursion limit here
        node, depth = stack.pop()
        if depth > limits.max_schema_depth:
            raise _over(field, f"nests deeper than {limits.max_schema_depth} levels", "max_schema_depth",
                        limits.max_schema_depth)
        if isinstance(node, dict):
            p = node.get("properties")
            if isinstance(p, dict):
                props += len(p)
            e = node.get("enum")
            enums += (len(e) if isinstance(e, list) else 0) + ("const" in node)
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):  # the compiler read it as any value
                raise ValueError(f"{field}: $ref {ref[:200]!r} names another document; only "
                                 "references inside the schema (#/...) are resolved, nothing is fetched")
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
        if props > limits.max_schema_properties:
            raise _over(field, f"has more than {limits.max_schema_properties} properties (over the whole schema)",
                        "max_schema_properties", limits.max_schema_properties)
        if enums > limits.max_enum_values:
            raise _over(field, f"has more than {limits.max_enum_values} enum and const values",
                        "max_enum_values", limits.max_enum_values)
