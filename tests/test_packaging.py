"""The Dockerfile and the extras: what they promise, checked against the project's own files
(pyproject.toml, detent-serve's argument parser, benchmarks/serve.py's imports). `docker build`
itself runs where a Docker daemon does, not here."""
from __future__ import annotations

import ast
import json
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
tomllib = pytest.importorskip("tomllib")


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _dist(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, 1)[0].strip().lower().replace("_", "-")


def _instructions() -> list[tuple[str, str]]:
    with open(os.path.join(ROOT, "Dockerfile")) as f:
        text = re.sub(r"\\\n", " ", f.read())
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1]) for ln in text.splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]


def test_dockerfile_serves_detent_serve_on_all_interfaces():
    ins = _instructions()
    base = dict(ins)["FROM"]
    args = {k: v for k, v in (a.split("=", 1) for op, a in ins if op == "ARG")}
    assert re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base).startswith("nvidia/cuda:")
    [entry] = [json.loads(v) for op, v in ins if op == "ENTRYPOINT"]  # exec form: signals reach the server
    assert entry[0] in _pyproject()["project"]["scripts"] and entry[0] == "detent-serve"
    from detent.server.cli import parse_args
    a = parse_args(entry[1:])  # detent-serve's own parser reads the entry point's flags
    assert a.host == "0.0.0.0"  # detent-serve binds 127.0.0.1 by default: unreachable from the host
    assert [v for op, v in ins if op == "EXPOSE"] == [str(a.port)]


def test_dockerfile_installs_the_package_with_extras_that_exist():
    extras = _pyproject()["project"]["optional-dependencies"]
    runs = " ".join(v for op, v in _instructions() if op == "RUN")
    wanted = re.findall(r'pip install "\.\[([\w,]+)\]"', runs)
    assert wanted and all(e in extras for w in wanted for e in w.split(","))
    assert "gpu" in wanted[0].split(",")
    assert any(_dist(r) == "triton" for r in extras["gpu"])


def test_benchmarks_serve_needs_nothing_beyond_the_package_and_the_bench_extra():
    proj = _pyproject()["project"]
    declared = {_dist(r) for r in proj["dependencies"] + proj["optional-dependencies"]["bench"]}
    with open(os.path.join(ROOT, "benchmarks", "serve.py")) as f:
        tree = ast.parse(f.read())
    mods = {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    mods |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    third_party = {m for m in mods if m not in sys.stdlib_module_names and m not in ("detent", "__future__")}
    assert "httpx" in third_party
    assert {m.replace("_", "-") for m in third_party} <= declared, third_party - declared


def test_the_kernels_load_without_triton():
    """triton is an extra (`gpu`): without it the torch candidates still register, and no module of
    kernels/ that always loads (attention_fa4, ...) imports it at the top."""
    import subprocess
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name.split('.')[0] == 'triton':\n"
            "            raise ImportError('triton blocked')\n"
            "sys.meta_path.insert(0, Block())\n"
            "from detent.kernels import registry\n"
            "import detent.kernels\n"
            "print(sorted(registry.candidates('top_p')))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "['torch_rowwise']"
