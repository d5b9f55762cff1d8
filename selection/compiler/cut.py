"""Taint and the weighted minimum vertex cut (docs/selir.md section 2).

Values reachable from a Runtime/Unpinnable input are batch-dependent. The
pins are a minimum-weight set of values whose removal disconnects every
batch-dependent input from every batch-dependent selection point: node
splitting (v_in -> v_out with the node's weight) turns it into an edge cut,
found by max-flow (Edmonds–Karp, networkx). Inputs, and values computed
from an Unpinnable input by data edges, get infinite weight. A node's weight
is BIG + (its distance to the nearest selection point), with BIG larger than
any sum of distances: the fewest pins first, then pins nearest the selection
points. A phi with an ABSENT arm whose condition the batch does not reach
(a knob or fact decides whether the selection point is set, as when a knob
chooses between candidates with different parameters) is never a pin: its
pinned value would reach the paths that leave the key out, so the cut goes
inside the paths that set it. (Where the batch decides, ABSENT is one of
the pin's values.)
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import networkx as nx
from networkx.algorithms.flow import edmonds_karp

from detent.selection.compiler import lang
from detent.selection.compiler.ir import ABSENT, Graph


@dataclass(frozen=True)
class GraphStats:
    nodes: int  # values reachable from the selection points and checks
    data_edges: int
    control_edges: int  # phi conditions: a value assigned under a condition depends on it
    inputs: int  # batch-dependent inputs
    selection_points: int
    batch_dependent_points: tuple[str, ...]
    tainted: int

    def as_dict(self) -> dict:
        return {"nodes": self.nodes, "data_edges": self.data_edges, "control_edges": self.control_edges,
                "inputs": self.inputs, "selection_points": self.selection_points,
                "batch_dependent_points": list(self.batch_dependent_points), "tainted": self.tainted}


def taint(g: Graph, order: list[int]) -> tuple[set[int], set[int]]:
    """(batch-dependent nodes, unpinnable nodes) among `order` (topological)."""
    tainted: set[int] = set()
    unpin: set[int] = set()
    for n in order:
        op = g.ops[n]
        if op == "input":
            tainted.add(n)
            if g.vals[n][1] == "unpinnable":
                unpin.add(n)
            continue
        args = g.args[n]
        if op == "neutral":
            continue  # numerics-neutral: the batch may reach it, the kernel's bits do not depend on it
        if any(a in tainted for a in args):
            tainted.add(n)
        data = args[1:] if op == "phi" else args
        if any(a in unpin for a in data):
            unpin.add(n)
    return tainted, unpin


def stats(g: Graph, outputs: dict[str, int], checks, tainted_points: list[str], n_inputs: int,
          n_tainted: int) -> GraphStats:
    roots = list(outputs.values()) + [c.cond for c in checks] + [c.guard for c in checks]
    order = g.reachable(roots)
    data = ctrl = 0
    for n in order:
        if g.ops[n] == "phi":
            ctrl += 1
            data += 2
        else:
            data += len(g.args[n])
    return GraphStats(len(order), data, ctrl, n_inputs, len(outputs), tuple(tainted_points), n_tainted)


@dataclass(frozen=True)
class Cut:
    pins: tuple[int, ...]
    sinks: tuple[int, ...]  # batch-dependent selection point nodes
    weight: int


def _absent_arm(g: Graph, n: int) -> bool:
    """A phi one of whose arms is the constant ABSENT (the key left out)."""
    return g.ops[n] == "phi" and any(g.is_const(a) and g.value(a) is ABSENT for a in g.args[n][1:])


def min_vertex_cut(g: Graph, outputs: dict[str, int], program: str = "?") -> Cut:
    sinks = []
    order = g.reachable(list(outputs.values()))
    tainted, unpin = taint(g, order)
    for k, n in outputs.items():
        if n in tainted and n not in sinks:
            sinks.append(n)
    if not sinks:
        return Cut((), (), 0)
    # distance (in edges) from each tainted node to the nearest sink, along data/control edges
    users: dict[int, list[int]] = {}
    for n in order:
        if n in tainted:
            for a in g.args[n]:
                if a in tainted:
                    users.setdefault(a, []).append(n)
    dist: dict[int, int] = {s: 0 for s in sinks}
    q = deque(sinks)
    while q:
        x = q.popleft()
        for a in g.args[x]:
            if a in tainted and a not in dist:
                dist[a] = dist[x] + 1
                q.append(a)
    maxd = max(dist.values()) + 1
    big = (len(tainted) + 1) * (maxd + 1)
    G = nx.DiGraph()
    for n in order:
        if n not in tainted:
            continue
        if g.ops[n] == "input" or n in unpin or (_absent_arm(g, n) and g.args[n][0] not in tainted):
            G.add_edge(("in", n), ("out", n))  # no capacity attribute: infinite
        else:
            G.add_edge(("in", n), ("out", n), capacity=big + dist.get(n, maxd))
        for a in g.args[n]:
            if a in tainted:
                G.add_edge(("out", a), ("in", n))
        if g.ops[n] == "input":
            G.add_edge("S", ("in", n))
    for s in sinks:
        G.add_edge(("out", s), "T")
    try:
        value, (reach, _) = nx.minimum_cut(G, "S", "T", flow_func=edmonds_karp)
    except nx.NetworkXUnbounded:
        bad = next(s for s in sinks if s in unpin)
        raise lang.SelIRError(f"program {program!r}: a batch-dependent selection point "
                              f"({g.names[bad][0] if g.names[bad] else g.describe(bad)}) is computed from an "
                              "Unpinnable input by data alone, so no pin can separate it from the batch") from None
    pins = tuple(sorted(n for n in tainted if ("in", n) in reach and ("out", n) not in reach))
    return Cut(pins, tuple(sinks), int(value))
