"""SelIR: the surface language (docs/selir.md section 1).

A SelIR program is a Python module holding pure functions. The entry
function (``select``) takes inputs annotated ``Fact[T]`` (deployment facts),
``Runtime[T]`` (batch-dependent) or ``Unpinnable[T]`` (batch-dependent and
must keep its real value) and returns ``{selection_point: value, ...}``.
``parse_program`` checks the source against the subset and reports anything
outside it as ``SelIRSyntaxError`` with file:line:col and the construct.

The names below are also importable, so a program is a valid Python module
(editors, linters) and the reference interpreter runs it with Python's own
semantics.
"""
from __future__ import annotations

import ast
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

SELIR_VERSION = "1"


class SelIRSyntaxError(SyntaxError):
    """A construct outside SelIR; the message names it with file:line:col."""

    def __init__(self, msg: str, filename: str = "<selir>", lineno: int = 0, col: int = 0):
        super().__init__(f"{filename}:{lineno}:{col}: {msg}")
        self.filename_, self.lineno_, self.col_ = filename, lineno, col


class SelIRError(ValueError):
    """A well-formed program that cannot be analysed for these facts (missing
    fact, unbounded runtime input, no finite cut, ...)."""


class SelectionError(RuntimeError):
    """A require/assume failed for a runtime combination: the engine stops."""


class _Marker:
    def __init__(self, kind: str):
        self.kind = kind

    def __getitem__(self, item):  # Fact[int], Runtime[int, 1, 8192]
        return self


Fact = _Marker("fact")
Runtime = _Marker("runtime")
Unpinnable = _Marker("unpinnable")
INPUT_KINDS = ("fact", "runtime", "unpinnable")


class _Absent:
    """A selection point that a branch does not set (the key is left out)."""
    _inst = None

    def __new__(cls):
        if cls._inst is None:
            cls._inst = super().__new__(cls)
        return cls._inst

    def __repr__(self):
        return "ABSENT"

    def __reduce__(self):
        return (_Absent, ())


ABSENT = _Absent()


# ---- builtins: one definition shared by the interpreter and compiled selectors
def cdiv(a, b):
    """Ceiling division on integers: cdiv(7, 2) == 4."""
    return -(-a // b)


def log2(x):
    """floor(log2(x)) for a positive int; math.log2 for a float."""
    if isinstance(x, bool) or not isinstance(x, int):
        return math.log2(x)
    if x <= 0:
        raise ValueError(f"log2 of non-positive int {x}")
    return x.bit_length() - 1


def next_pow2(x):
    """Smallest power of two >= x (1 for x <= 1)."""
    x = int(x)
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def round_up(a, b):
    """a rounded up to a multiple of b."""
    return -(-a // b) * b


def neutral(x):
    """Mark a value the selected kernel's bits do not depend on (a tile shape a
    test has shown to be numerics-neutral): it may follow the batch, so taint
    stops here and it is never pinned."""
    return x


BUILTINS: dict[str, Any] = {
    "min": min, "max": max, "abs": abs, "cdiv": cdiv, "log2": log2, "next_pow2": next_pow2,
    "round_up": round_up, "int": int, "float": float, "bool": bool, "len": len, "neutral": neutral,
}


def knob(name: str, choices, default):
    """Declare a deployment setting no input determines (interpreter form:
    returns the default; `interp.run(knobs=...)` overrides)."""
    return default


def require(cond, msg: str = "") -> None:
    if not cond:
        raise SelectionError(f"require failed: {msg}")


def assume(cond, msg: str = "") -> None:
    if not cond:
        raise SelectionError(f"assume failed: {msg}")


# ---- the parsed program
@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # fact | runtime | unpinnable
    type: str  # int, float, bool, str, any
    bounds: tuple[ast.expr, ast.expr] | None  # Runtime[int, lo, hi]
    lineno: int


@dataclass
class Program:
    source: str
    filename: str
    name: str
    entry: ast.FunctionDef
    functions: dict[str, ast.FunctionDef]
    constants: dict[str, ast.expr]  # module-level NAME = expr (tuned tables)
    params: tuple[Param, ...]
    conservative: ast.FunctionDef | None = None
    hash: str = field(default="")

    @property
    def facts(self) -> list[str]:
        return [p.name for p in self.params if p.kind == "fact"]

    @property
    def runtime_inputs(self) -> list[str]:
        return [p.name for p in self.params if p.kind != "fact"]


_ALLOWED_IMPORTS = ("detent.selection", "__future__", "typing", "math")
_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_CMPOPS = (ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.In, ast.NotIn, ast.Is, ast.IsNot)
_SPECIAL_CALLS = ("knob", "require", "assume", "range")


class _Checker:
    """Walks a function body and rejects anything outside the subset."""

    def __init__(self, filename: str, functions: set[str], constants: set[str]):
        self.filename, self.functions, self.constants = filename, functions, constants

    def err(self, node: ast.AST, what: str):
        raise SelIRSyntaxError(what, self.filename, getattr(node, "lineno", 0),
                               getattr(node, "col_offset", 0))

    def stmts(self, body: list[ast.stmt], in_loop: bool = False):
        for s in body:
            self.stmt(s, in_loop)

    def stmt(self, s: ast.stmt, in_loop: bool):
        if isinstance(s, ast.Assign):
            for t in s.targets:
                self.target(t)
            self.expr(s.value)
        elif isinstance(s, ast.AugAssign):
            if not isinstance(s.target, ast.Name):
                self.err(s, "augmented assignment to a non-name is not SelIR")
            if not isinstance(s.op, _BINOPS):
                self.err(s, f"operator {type(s.op).__name__} is not SelIR")
            self.expr(s.value)
        elif isinstance(s, ast.If):
            self.expr(s.test)
            self.stmts(s.body, in_loop)
            self.stmts(s.orelse, in_loop)
        elif isinstance(s, ast.For):
            if s.orelse:
                self.err(s, "for-else is not SelIR")
            self.target(s.target)
            self.expr(s.iter, iterable=True)
            self.stmts(s.body, True)
        elif isinstance(s, ast.Return):
            if s.value is None:
                self.err(s, "a bare return is not SelIR: return a value")
            self.expr(s.value)
        elif isinstance(s, ast.Expr):
            v = s.value
            if isinstance(v, ast.Constant) and isinstance(v.value, str):
                return  # docstring / comment string
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in ("require", "assume"):
                if not 1 <= len(v.args) <= 2 or v.keywords:
                    self.err(v, f"{v.func.id}(cond, msg) takes a condition and a message")
                for a in v.args:
                    self.expr(a)
                return
            self.err(s, "expression statement is not SelIR (only require(...) / assume(...))")
        elif isinstance(s, ast.Pass):
            return
        else:
            names = {ast.While: "while loop", ast.Break: "break", ast.Continue: "continue",
                     ast.Try: "try statement", ast.With: "with statement", ast.Raise: "raise",
                     ast.Assert: "assert (use require)", ast.FunctionDef: "nested function",
                     ast.Import: "import inside a function", ast.ImportFrom: "import inside a function",
                     ast.Global: "global", ast.Nonlocal: "nonlocal", ast.Delete: "del",
                     ast.AnnAssign: "annotated assignment", ast.ClassDef: "class"}
            what = next((n for t, n in names.items() if isinstance(s, t)), type(s).__name__)
            self.err(s, f"{what} is not SelIR")

    def target(self, t: ast.expr):
        if isinstance(t, ast.Name):
            if t.id in self.functions or t.id in BUILTINS or t.id in _SPECIAL_CALLS:
                self.err(t, f"assignment to reserved name {t.id!r}")
            return
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                self.target(e)
            return
        self.err(t, f"assignment target {type(t).__name__} is not SelIR (only names and tuples of names)")

    def expr(self, e: ast.expr, iterable: bool = False):
        if isinstance(e, ast.Constant):
            if not isinstance(e.value, (int, float, str, bool, type(None))):
                self.err(e, f"constant of type {type(e.value).__name__} is not SelIR")
        elif isinstance(e, ast.Name):
            return
        elif isinstance(e, ast.BinOp):
            if not isinstance(e.op, _BINOPS):
                self.err(e, f"operator {type(e.op).__name__} is not SelIR")
            self.expr(e.left)
            self.expr(e.right)
        elif isinstance(e, ast.UnaryOp):
            if isinstance(e.op, ast.Invert):
                self.err(e, "operator ~ is not SelIR")
            self.expr(e.operand)
        elif isinstance(e, ast.BoolOp):
            for v in e.values:
                self.expr(v)
        elif isinstance(e, ast.Compare):
            for op in e.ops:
                if not isinstance(op, _CMPOPS):
                    self.err(e, f"comparison {type(op).__name__} is not SelIR")
            self.expr(e.left)
            for c in e.comparators:
                self.expr(c)
        elif isinstance(e, ast.IfExp):
            self.expr(e.test)
            self.expr(e.body)
            self.expr(e.orelse)
        elif isinstance(e, ast.Call):
            self.call(e, iterable)
        elif isinstance(e, ast.Subscript):
            if isinstance(e.slice, ast.Slice):
                self.err(e, "slicing is not SelIR (index with a single key)")
            self.expr(e.value)
            self.expr(e.slice)
        elif isinstance(e, (ast.Tuple, ast.List)):
            for v in e.elts:
                if isinstance(v, ast.Starred):
                    self.err(v, "starred expression is not SelIR")
                self.expr(v)
        elif isinstance(e, ast.Dict):
            for k, v in zip(e.keys, e.values):
                if k is None:
                    self.err(e, "dict unpacking (**) is not SelIR")
                self.expr(k)
                self.expr(v)
        elif isinstance(e, ast.Attribute) and iterable and isinstance(e.value, ast.Name):
            return
        else:
            names = {ast.Lambda: "lambda", ast.ListComp: "list comprehension",
                     ast.DictComp: "dict comprehension", ast.SetComp: "set comprehension",
                     ast.GeneratorExp: "generator expression", ast.Attribute: "attribute access",
                     ast.JoinedStr: "f-string", ast.NamedExpr: "walrus (:=)", ast.Await: "await",
                     ast.Yield: "yield", ast.Set: "set literal", ast.Starred: "starred expression"}
            what = next((n for t, n in names.items() if isinstance(e, t)), type(e).__name__)
            self.err(e, f"{what} is not SelIR")

    def call(self, e: ast.Call, iterable: bool):
        f = e.func
        if isinstance(f, ast.Attribute):
            if iterable and f.attr in ("items", "keys", "values") and not e.args and isinstance(f.value, ast.Name):
                return
            self.err(e, f"method call .{f.attr}() is not SelIR")
        if not isinstance(f, ast.Name):
            self.err(e, "call of a computed function is not SelIR")
        name = f.id
        if name in ("require", "assume"):
            self.err(e, f"{name}() must be a statement of its own")
        if name == "range" and not iterable:
            self.err(e, "range() is only allowed as a for-loop collection")
        if name not in BUILTINS and name not in self.functions and name not in ("knob", "range"):
            self.err(e, f"call of {name!r}: not a SelIR builtin or a function of this program")
        for a in e.args:
            if isinstance(a, ast.Starred):
                self.err(a, "*args is not SelIR")
            self.expr(a)
        for k in e.keywords:
            if k.arg is None:
                self.err(e, "**kwargs is not SelIR")
            self.expr(k.value)


def _param(arg: ast.arg, filename: str) -> Param:
    ann = arg.annotation
    where = (filename, arg.lineno, arg.col_offset)
    if ann is None:
        raise SelIRSyntaxError(f"input {arg.arg!r} needs an annotation Fact[T], Runtime[T] or Unpinnable[T]", *where)
    if not (isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name)
            and ann.value.id in ("Fact", "Runtime", "Unpinnable")):
        raise SelIRSyntaxError(f"input {arg.arg!r}: annotation {ast.unparse(ann)!r} is not Fact[T], "
                               "Runtime[T] or Unpinnable[T]", *where)
    kind = ann.value.id.lower()
    parts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
    t = parts[0]
    tname = t.id if isinstance(t, ast.Name) else ast.unparse(t)
    if tname not in ("int", "float", "bool", "str", "Any", "object"):
        raise SelIRSyntaxError(f"input {arg.arg!r}: type {tname!r} is not int, float, bool or str", *where)
    bounds = None
    if len(parts) == 3 and kind != "fact":
        bounds = (parts[1], parts[2])
    elif len(parts) != 1:
        raise SelIRSyntaxError(f"input {arg.arg!r}: write {ann.value.id}[T] or Runtime[T, lo, hi]", *where)
    return Param(arg.arg, kind, tname, bounds, arg.lineno)


def _check_signature(fn: ast.FunctionDef, filename: str, annotated: bool) -> None:
    a = fn.args
    where = (filename, fn.lineno, fn.col_offset)
    if a.vararg or a.kwarg or a.posonlyargs or a.kwonlyargs:
        raise SelIRSyntaxError(f"function {fn.name!r}: *args, **kwargs and keyword-only parameters are not SelIR", *where)
    if fn.decorator_list:
        raise SelIRSyntaxError(f"function {fn.name!r}: decorators are not SelIR", *where)
    if annotated and a.defaults:
        raise SelIRSyntaxError(f"function {fn.name!r}: inputs take no defaults (facts come from the deployment)", *where)


def parse_program(source: str, filename: str = "<selir>", name: str | None = None,
                  entry: str = "select") -> Program:
    """Parse and check a SelIR program. The entry function is `entry`
    (default ``select``) or the module's only function with annotated inputs."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as e:
        raise SelIRSyntaxError(f"Python syntax error: {e.msg}", filename, e.lineno or 0, e.offset or 0) from None
    functions: dict[str, ast.FunctionDef] = {}
    constants: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            if node.name in functions:
                raise SelIRSyntaxError(f"function {node.name!r} defined twice", filename, node.lineno, node.col_offset)
            functions[node.name] = node
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            constants[node.targets[0].id] = node.value
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if not (mod or "").startswith(_ALLOWED_IMPORTS):
                raise SelIRSyntaxError(f"import of {mod!r} is not SelIR (only detent.selection names)",
                                       filename, node.lineno, node.col_offset)
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            continue
        else:
            raise SelIRSyntaxError(f"module-level {type(node).__name__} is not SelIR (functions, constant "
                                   "tables and imports only)", filename, node.lineno, node.col_offset)
    if not functions:
        raise SelIRSyntaxError("no function: a SelIR program defines an entry function `select`", filename, 1, 0)
    if entry in functions:
        ent = functions[entry]
    else:
        annotated = [f for f in functions.values()
                     if f.args.args and all(a.annotation is not None for a in f.args.args) and f.name != "conservative"]
        if len(annotated) != 1:
            raise SelIRSyntaxError(f"no entry function {entry!r} (and not exactly one function with annotated inputs)",
                                   filename, 1, 0)
        ent = annotated[0]
    _check_signature(ent, filename, True)
    params = tuple(_param(a, filename) for a in ent.args.args)
    checker = _Checker(filename, set(functions), set(constants))
    for fn in functions.values():
        if fn is not ent:
            _check_signature(fn, filename, False)
        checker.stmts(fn.body)
    for cname, cexpr in constants.items():
        checker.expr(cexpr)
    cons = functions.get("conservative")
    if cons is not None:
        for a in cons.args.args:
            p = _param(a, filename)
            if p.kind != "fact":
                raise SelIRSyntaxError("conservative() reads facts only: its inputs must be Fact[T]",
                                       filename, a.lineno, a.col_offset)
    digest = hashlib.sha256(source.encode()).hexdigest()
    return Program(source=source, filename=filename, name=name or ent.name, entry=ent, functions=functions,
                   constants=constants, params=params, conservative=cons, hash=digest)


def load_program(path: str, name: str | None = None) -> Program:
    with open(path) as f:
        src = f.read()
    import os
    return parse_program(src, filename=path, name=name or os.path.splitext(os.path.basename(path))[0])
