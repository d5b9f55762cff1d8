"""Taint and the weighted minimum vertex cut: known answers and a brute-force oracle."""
import itertools

import networkx as nx
import pytest
from hypothesis import given, settings, strategies as st

from detent.selection import SelIRError, parse_program, solve
from detent.selection.compiler.cut import min_vertex_cut, taint
from detent.selection.compiler.ir import Graph

ROW_KEY = '''
TABLE = {1: (16, 32, 4), 16: (32, 64, 4), 256: (64, 128, 8)}


def select(m: Runtime[int]):
    assume(1 <= m <= 512)
    row = 1
    for key in (1, 16, 256):
        if abs(key - m) < abs(row - m):
            row = key
    cfg = TABLE[row]
    return {"impl": "fused", "block_m": cfg[0], "block_n": cfg[1], "warps": cfg[2], "stages": cfg[2] - 1}
'''


def test_cut_falls_on_the_row_key_not_on_the_selection_points():
    sol = solve(parse_program(ROW_KEY), {}, cache=False)
    assert set(sol.graph.batch_dependent_points) == {"block_m", "block_n", "warps", "stages"}
    assert len(sol.pins) == 1
    assert sol.candidates[sol.pins[0]] == ((16, 32, 4), (32, 64, 4), (64, 128, 8))
    every = solve(parse_program(ROW_KEY), {}, cache=False, cut=False)
    assert len(every.pins) == 4


def test_ties_prefer_pins_nearest_the_selection_points():
    src = '''
def select(m: Runtime[int]):
    assume(0 <= m <= 9)
    a = m * 3
    b = a + 1
    return {"x": b * 2}
'''
    sol = solve(parse_program(src), {}, cache=False)
    assert sol.pins == ("x",)  # one pin either way: the one at the selection point


def test_two_inputs_meeting_in_one_value_need_one_pin():
    src = '''
def select(a: Runtime[int], b: Runtime[int]):
    assume(0 <= a <= 9)
    assume(0 <= b <= 9)
    key = min(a, b) + max(a, b)
    return {"x": key * 2, "y": key + 1, "z": 7}
'''
    sol = solve(parse_program(src), {}, cache=False)
    assert sol.pins == ("key",)
    assert sol.graph.batch_dependent_points == ("x", "y")


def test_unpinnable_data_path_to_a_selection_point_is_an_error_but_control_is_not():
    bad = '''
def select(t: Unpinnable[int]):
    assume(1 <= t <= 9)
    return {"grid": t * 2}
'''
    with pytest.raises(SelIRError, match="Unpinnable"):
        solve(parse_program(bad), {}, cache=False)
    ok = '''
def select(t: Unpinnable[int]):
    assume(1 <= t <= 9)
    big = t > 4
    return {"impl": "a" if big else "b"}
'''
    sol = solve(parse_program(ok), {}, cache=False)
    assert sol.pins == ("impl",)


def _brute_min_cut(g, sources, sinks, cuttable):
    """Smallest set of cuttable nodes whose removal disconnects sources from sinks."""
    for k in range(len(cuttable) + 1):
        for cut in itertools.combinations(sorted(cuttable), k):
            h = g.copy()
            h.remove_nodes_from(cut)
            if not any(nx.has_path(h, s, t) for s in sources for t in sinks if s in h and t in h):
                return k
    return None


@settings(max_examples=40, deadline=None)
@given(st.integers(3, 9).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), min_size=1, max_size=3 * n))))
def test_max_flow_cut_matches_brute_force_on_random_dags(spec):
    n, edges = spec
    g = Graph("fold")
    nodes = [g.input("in0", "runtime", 0, 9), g.input("in1", "runtime", 0, 9)]
    preds = {i: set() for i in range(n)}
    for a, b in edges:
        if a < b:
            preds[b].add(a)
    for i in range(n):
        args = [nodes[p] for p in sorted(preds[i])] + [nodes[i % 2]]
        nodes.append(g.op("min", *args, g.const(i + 100)) if len(args) > 1 else g.op("neg", args[0]))
    outputs = {f"o{i}": nodes[2 + i] for i in range(n) if i % 3 == 0}
    cut = min_vertex_cut(g, outputs)
    order = g.reachable(list(outputs.values()))
    tainted, _ = taint(g, order)
    G = nx.DiGraph()
    for v in order:
        G.add_node(v)
        for a in g.args[v]:
            G.add_edge(a, v)
    inputs = {v for v in order if g.ops[v] == "input"}
    sinks = {v for v in outputs.values() if v in tainted}
    assert len(cut.pins) == (_brute_min_cut(G, inputs, sinks, tainted - inputs) if sinks else 0)
    h = G.copy()
    h.remove_nodes_from(cut.pins)
    assert not any(nx.has_path(h, s, t) for s in inputs for t in sinks if t in h)
