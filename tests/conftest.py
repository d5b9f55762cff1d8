import os
import sys

# `python -m pytest` from the repository root puts the root first on sys.path, and the root's
# folders (kernels/, engine/, models/ ...) are the detent.* subpackages, not top-level
# packages. transformers (5.25 seen) imports the Hugging Face `kernels` package, which the root's
# kernels/ then shadowed ("cannot import name 'CUDAProperties' from 'kernels'"): every test
# that builds a transformers model failed on a fresh machine. detent is installed (pip -e);
# the root stays on the path, last, for `from tests.selection.conftest import ...`.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if any(os.path.abspath(p or os.curdir) == _ROOT for p in sys.path):
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT] + [_ROOT]

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run on CPU only under Triton's interpreter, and it must be
    # on before triton is first imported (its standard-library helpers are
    # jitted at import): tests/kernels runs the Triton candidates this way.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _cpu_threads():
    # the CI machine has 2 cores; keep results independent of thread count. Under pytest-xdist
    # (the README's `-n 2`) each worker is one of the two: one intra-op thread each, since two
    # workers of two threads on two cores spin-wait on each other in OpenMP
    if not torch.cuda.is_available():
        default = "1" if os.environ.get("PYTEST_XDIST_WORKER") else "2"
        torch.set_num_threads(int(os.environ.get("DETENT_TEST_THREADS", default)))
    yield


@pytest.fixture
def count_placeholders():
    """count_placeholders(engine) -> list, appended by every later schedule() with the number of
    PLACEHOLDER input tokens in its plan: evidence that async scheduling overlapped steps."""
    from detent.scheduler.outputs import PLACEHOLDER

    def install(engine) -> list[int]:
        seen, real = [], engine.scheduler.schedule

        def schedule():
            plan = real()
            seen.append(sum(t == PLACEHOLDER for s in plan.seqs for t in s.token_ids))
            return plan
        engine.scheduler.schedule = schedule
        return seen
    return install
