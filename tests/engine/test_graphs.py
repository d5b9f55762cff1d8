"""engine/graphs.py `release_graphs`: before a recapture (the tuner, per tuple it
measures) the runner lets go of its old graphs, so their memory can return to the
allocator before the new captures need it. CPU: the graphs are stand-ins, and a
weak reference shows they are gone (`is None`)."""
import weakref

import torch

from detent.engine.graphs import GRAPH_ATTRS, release_graphs


class _Graphs:  # stands in for a CudaGraphRunner (and its memory pool)
    pass


class _Runner:
    device = torch.device("cpu")

    def __init__(self):
        self._eager_forward = lambda *a: "eager"
        graphs = {name: _Graphs() for name in GRAPH_ATTRS}
        for name, g in graphs.items():
            setattr(self, name, g)
        inner = self._eager_forward
        mixed = graphs["mixed_graphs"]
        self._forward = lambda *a: (mixed, inner)  # the replaying closure holds its graphs too
        self.refs = [weakref.ref(g) for g in graphs.values()]


def test_release_drops_every_graph_and_restores_the_eager_forward():
    r = _Runner()
    release_graphs(r)
    assert r._forward is r._eager_forward
    assert all(getattr(r, name) is None for name in GRAPH_ATTRS)
    assert [ref() for ref in r.refs] == [None, None, None]


def test_a_runner_that_never_captured_is_left_as_it_is():
    class Bare:
        device = torch.device("cpu")

        def _forward(self, *a):
            return "model"
    r = Bare()
    fwd = r._forward
    release_graphs(r)
    assert r._forward == fwd and not any(hasattr(r, name) for name in GRAPH_ATTRS)


def test_without_the_release_the_graphs_would_live_on():
    # the control: a new capture replacing the attributes one by one (what enable_graphs did
    # before) keeps the old mixed graphs alive through the closure until the last one is set
    r = _Runner()
    r.cuda_graphs = _Graphs()
    assert r.refs[2]() is not None


def test_decode_graphs_stop_at_the_step_budget(monkeypatch):
    # a decode-only step of B sequences has B tokens: with 64 sequences and a 32-token budget
    # (detent battery's engine) the graphs stop at 32. Before, they went to 64, the capture of
    # 64 failed the GEMM program's domain, and the engine ran every decode eagerly (lease 15)
    from types import SimpleNamespace

    from detent.engine import graphs
    seen = {}
    monkeypatch.setattr(graphs, "enable_cuda_graphs", lambda runner, **kw: seen.update(kw))
    config = SimpleNamespace(max_num_seqs=64, max_num_batched_tokens=32, tensor_parallel_size=2,
                             piecewise_max_tokens=2048, mixed_graph_max_tokens=0)
    graphs._enable(object(), config, 1024)
    assert seen == {"max_num_seqs": 32, "max_model_len": 1024}
    config.max_num_batched_tokens = 8192
    graphs._enable(object(), config, 1024)
    assert seen["max_num_seqs"] == 64
