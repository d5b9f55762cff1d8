"""DESIGN.md §2: models/ and engine/ never import kernels/ directly; they call
`ops.<family>` which dispatches through the family's selector."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def test_models_and_engine_do_not_import_kernels():
    offenders = []
    for folder in ("models", "engine", "scheduler"):
        for path in (ROOT / folder).rglob("*.py"):
            for name in _imports(path):
                if name == "detent.kernels" or name.startswith("detent.kernels."):
                    offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, "\n".join(offenders)


def test_rule_detects_a_violation(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("from detent.kernels.gemm import gemm_torch\n")
    assert "detent.kernels.gemm" in _imports(bad)
