"""Every import points down (docs/architecture.md, "Folders" and "Floors").

The module graph is read from the source with `ast`, lazy imports inside
functions included, with the folder -> `detent.*` mapping taken from
pyproject.toml's package-dir. Floors, bottom up:

    kernels/registry.py        imports nothing of ours
    kernels/                   nothing of ours outside kernels/
    selection/                 kernels/registry.py only (candidates by name);
                               ops, context and dispatch reach no selection/compiler/
    models/, sampling/         selection/ (the `ops` façade) and themselves
    scheduler/                 sampling/; never engine/
    engine/                    everything below; never kernels/
    server/                    engine's public API (`detent.engine`) and the
                               request types (`detent.sampling.params`)
    detent/ (cli)              anything
"""
import ast
import pathlib
import tomllib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _package_dirs() -> dict[str, pathlib.Path]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {pkg: ROOT / folder for pkg, folder in cfg["package-dir"].items()}


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the installed package, by dotted name."""
    mods = {}
    for pkg, folder in _package_dirs().items():
        for path in folder.glob("*.py"):
            mods[pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"] = path
    return mods


def _imported(tree: ast.AST, name: str, is_package: bool, known) -> set[str]:
    """The modules of ours `tree` imports (at any depth), each resolved to the
    most specific module it names: `from detent.selection import ops` -> ops."""
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph(mods: dict[str, pathlib.Path]) -> nx.DiGraph:
    g = nx.DiGraph()
    for name, path in mods.items():
        g.add_node(name)
        tree = ast.parse(path.read_text(), filename=str(path))
        for target in _imported(tree, name, path.stem == "__init__", mods):
            g.add_edge(name, target)
    return g


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS else "detent"


# folder -> the modules of ours it may import: a module, or "pkg.*" for pkg and everything under it
FLOORS = {
    "kernels": ("detent.kernels.*",),
    "selection": ("detent.selection.*", "detent.kernels.registry"),
    "models": ("detent.models.*", "detent.selection.ops"),
    "sampling": ("detent.sampling.*", "detent.selection.ops"),
    "scheduler": ("detent.scheduler.*", "detent.sampling.*"),
    "engine": ("detent.engine.*", "detent.scheduler.*", "detent.sampling.*", "detent.models.*",
               "detent.selection.*"),
    "server": ("detent.server.*", "detent.engine", "detent.sampling.params", "detent"),
}


def _allowed(src: str, dst: str) -> bool:
    folder = _folder(src)
    if folder == "detent":  # the package root (the CLI) sits on top
        return True
    for rule in FLOORS[folder]:
        if rule.endswith(".*"):
            if dst == rule[:-2] or dst.startswith(rule[:-1]):
                return True
        elif dst == rule:
            return True
    return False


def floor_violations(g: nx.DiGraph) -> list[str]:
    return sorted(f"{src} imports {dst}" for src, dst in g.edges if not _allowed(src, dst))


def test_every_import_points_down():
    bad = floor_violations(import_graph(_modules()))
    assert not bad, "imports that climb a floor:\n" + "\n".join(bad)


# LLMEngine internals: a server that read them would break with each engine refactor
ENGINE_INTERNALS = {"dispatcher", "facts", "state", "runner", "scheduler", "block_manager", "model_config",
                    "outputs", "config"}


def engine_internals_read(tree: ast.AST) -> list[str]:
    """`<...engine>.X` or `getattr(<...engine>, "X")` for an internal X."""
    def names_engine(node) -> bool:
        last = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
        return last.endswith("engine")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS and names_engine(node.value):
            out.append(f"line {node.lineno}: .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and names_engine(node.args[0])
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in ENGINE_INTERNALS):
            out.append(f"line {node.lineno}: getattr(..., {node.args[1].value!r})")
    return out


def test_server_reads_only_the_engine_public_api():
    bad = []
    for path in (ROOT / "server").glob("*.py"):
        bad += [f"server/{path.name} {hit}" for hit in engine_internals_read(ast.parse(path.read_text()))]
    assert not bad, "server reads engine internals (use LLMEngine.fingerprint()/limits()):\n" + "\n".join(bad)


def test_engine_internals_check_catches_reads():
    tree = ast.parse("a = engine.state.max_model_len\nb = getattr(llm.llm_engine, 'dispatcher', None)\n"
                     "c = engine.limits().max_model_len\n")
    assert sorted(engine_internals_read(tree)) == ["line 1: .state", "line 2: getattr(..., 'dispatcher')"]


def test_no_circles_between_modules():
    g = import_graph(_modules())
    cycles = list(nx.simple_cycles(g))
    assert nx.is_directed_acyclic_graph(g), "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_step_runtime_does_not_reach_the_compiler():
    """What runs every step (ops, the step context, the dispatcher) reaches
    no module of selection/compiler/, even indirectly: selectors are built
    at startup and called by name."""
    g = import_graph(_modules())
    for runtime in ("detent.selection.ops", "detent.selection.context", "detent.selection.dispatch"):
        reached = sorted(m for m in nx.descendants(g, runtime) if m.startswith("detent.selection.compiler"))
        assert not reached, f"{runtime} reaches the compiler: {reached}"


def test_the_graph_sees_the_package():
    mods = _modules()
    g = import_graph(mods)
    assert "detent.kernels.registry" in mods and "detent.selection.compiler.lang" in mods
    assert g.has_edge("detent.selection.ops", "detent.selection.context")
    assert g.has_edge("detent.selection.dispatch", "detent.kernels.registry")  # a lazy import
    assert g.out_degree("detent.kernels.registry") == 0


def _graph_of(tmp_path, files: dict[str, str]) -> nx.DiGraph:
    mods = {}
    for name, src in files.items():
        p = tmp_path / (name.replace(".", "_") + ".py")
        p.write_text(src)
        mods[name] = p
    return import_graph(mods)


def test_rules_catch_violations(tmp_path):
    g = _graph_of(tmp_path, {
        "detent.kernels.gemm": "from detent.selection.ops import linear\n",
        "detent.selection.ops": "def f():\n    from detent.engine.config import X\n",
        "detent.scheduler.scheduler": "import detent.engine.block_manager\n",
        "detent.server.cli": "from detent.engine.llm_engine import LLMEngine\n",
        "detent.engine.config": "",
        "detent.engine.block_manager": "",
        "detent.engine.llm_engine": "",
        "detent.engine": "",
    })
    assert floor_violations(g) == [
        "detent.kernels.gemm imports detent.selection.ops",
        "detent.scheduler.scheduler imports detent.engine.block_manager",
        "detent.selection.ops imports detent.engine.config",
        "detent.server.cli imports detent.engine.llm_engine",
    ]
    ok = _graph_of(tmp_path, {
        "detent.kernels.gemm": "from detent.kernels.registry import register\n",
        "detent.kernels.registry": "",
        "detent.server.cli": "from detent.engine import LLM\n",
        "detent.engine": "",
    })
    assert floor_violations(ok) == []


def test_circle_check_catches_a_lazy_circle(tmp_path):
    g = _graph_of(tmp_path, {
        "detent.engine.a": "from detent.engine import b\n",
        "detent.engine.b": "def f():\n    import detent.engine.a\n",
        "detent.engine": "",
    })
    assert not nx.is_directed_acyclic_graph(g)
