"""The scheduler finishes a request, for every reason (docs/architecture.md,
"How a request flows"): no module outside scheduler/ writes a request's
`status` or `stop_reason`."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("engine", "models", "selection", "kernels", "sampling", "server", "detent")


def status_writes(tree: ast.AST) -> list[int]:
    """Lines that assign `<obj>.status` or `<obj>.stop_reason` of an object other than self."""
    lines = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for t in targets:
            for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if (isinstance(el, ast.Attribute) and el.attr in ("status", "stop_reason")
                        and not (isinstance(el.value, ast.Name) and el.value.id == "self")):
                    lines.add(node.lineno)
    return sorted(lines)


def test_only_the_scheduler_finishes_requests():
    bad = [f"{p.relative_to(ROOT)}:{n}" for f in FOLDERS for p in (ROOT / f).rglob("*.py")
           for n in status_writes(ast.parse(p.read_text()))]
    assert not bad, "request status written outside scheduler/: " + ", ".join(bad)


def test_the_rule_sees_a_write():
    tree = ast.parse("req.status, req.stop_reason = 1, 's'\nself.status = 2\nr.error = 'x'\n")
    assert status_writes(tree) == [1]
