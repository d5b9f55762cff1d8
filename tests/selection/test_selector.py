"""Compiled selectors: agreement with the interpreter, pinning, checks, repin, modes."""
import itertools

import pytest

from detent.selection import IllegalAssignment, SelectionError, parse_program, solve
from detent.selection.compiler import interp

PROG = '''
def pick(m, cap):
    if m >= cap:
        return cap
    return next_pow2(m)


def select(cap: Fact[int], m: Runtime[int], q: Runtime[int]):
    assume(1 <= m <= 40, "m out of range")
    assume(1 <= q <= 40, "q out of range")
    assume(q <= m, "q must not exceed m")
    chunk = pick(m, cap)
    require(chunk >= 2 or q == 1, "a chunk of 1 row serves single queries only")
    if chunk > 8:
        return {"impl": "big", "chunk": chunk, "split": q // 2}
    return {"impl": "small", "chunk": chunk}
'''


@pytest.fixture(scope="module")
def sol():
    return solve(parse_program(PROG, "prog.py", "prog"), {"cap": 16}, cache=False)


def test_stock_selector_agrees_with_the_interpreter_everywhere(sol):
    sel = sol.compile(mode="stock")
    for m, q in itertools.product(range(1, 41), range(1, 41)):
        if q > m:
            with pytest.raises(SelectionError):
                sel(m=m, q=q)
            continue
        try:
            want = interp.run(sol.program, {"cap": 16, "m": m, "q": q})
        except SelectionError:
            with pytest.raises(SelectionError):
                sel(m=m, q=q)
            continue
        assert sel(m=m, q=q) == want


def test_pins_vra_and_pinned_invariance(sol):
    assert set(sol.pins) == {"chunk", "split"}
    assert sol.candidates["chunk"] == (1, 2, 4, 8, 16)
    legal = sol.legal
    assert {"chunk": 1, "split": 0} not in legal  # the require fails at q > 1
    assert {"chunk": 4, "split": 0} in legal
    sel = sol.compile({"chunk": 16, "split": 3})
    outs = {repr(sel(m=m, q=q)) for m in range(1, 41) for q in range(1, m + 1)}
    assert outs == {repr({"impl": "big", "chunk": 16, "split": 3})}


def test_illegal_assignment_names_pin_condition_and_legal_values(sol):
    with pytest.raises(IllegalAssignment) as e:
        sol.compile({"chunk": 1, "split": 0})
    msg = str(e.value)
    assert "pin 'chunk' = 1" in msg and "legal values: [2, 4, 8, 16]" in msg
    assert "chunk >= 2 or q == 1" in msg and "prog.py:" in msg
    with pytest.raises(IllegalAssignment, match="unknown pin or knob 'nope'"):
        sol.compile({"chunk": 4, "split": 0, "nope": 1})
    with pytest.raises(IllegalAssignment, match="no value for pin 'split'"):
        sol.compile({"chunk": 4})


def test_runtime_check_failure_names_program_condition_and_inputs(sol):
    sel = sol.compile({"chunk": 4, "split": 0})
    with pytest.raises(SelectionError) as e:
        sel(m=3, q=9)
    msg = str(e.value)
    assert "'prog'" in msg and "q <= m" in msg and "q must not exceed m" in msg and "m=3" in msg and "q=9" in msg
    with pytest.raises(SelectionError, match=r"needs runtime input\(s\) \['q'\]"):
        sel(m=3)


def test_checks_run_once_per_new_combination_and_batches_never_recompile(sol):
    sel = sol.compile({"chunk": 4, "split": 0})
    memo = sel.__globals__["_memo"]
    slow = sel.__globals__["_slow"]
    calls = []
    sel.__globals__["_slow"] = lambda *a: calls.append(a) or slow(*a)
    for _ in range(3):
        for m in (5, 6, 5):
            sel(m=m, q=1, num_seqs=99)  # inputs the program does not read are ignored
    assert calls == [(5, 1), (6, 1)]
    assert len(memo) == 2
    assert sel.reads == ("m", "q")


def test_repin_regenerates_without_solving(sol):
    from detent.selection.compiler.lang import ABSENT
    assert ABSENT in sol.candidates["split"]  # the selection point is left out on the small path
    a = sol.repin({"chunk": 4, "split": ABSENT})
    b = sol.repin({"chunk": 16, "split": 1})
    assert a(m=30, q=3) == {"impl": "small", "chunk": 4}
    assert b(m=30, q=3) == {"impl": "big", "chunk": 16, "split": 1}
    assert "4" in a.source and sol.lowered is not None


def test_wherever_pins_equal_the_unpinned_values_outputs_agree(sol):
    stock = sol.compile(mode="stock")
    for m in range(1, 41):
        for q in range(1, m + 1):
            vals = sol.vra.values_at((m, q))
            a = dict(zip(sol.pins, vals))
            if sol.is_legal(a):
                try:
                    want = stock(m=m, q=q)
                except SelectionError:
                    continue
                assert sol.compile(a)(m=m, q=q) == want


def test_untaken_branches_are_not_evaluated():
    src = '''
T = (1, 2, 3)


def select(m: Runtime[int]):
    assume(0 <= m <= 5)
    if m < 3:
        v = T[m]
    else:
        v = 10 // (m - m)
    return {"v": v}
'''
    sel = solve(parse_program(src), {}, cache=False).compile(mode="stock")
    assert [sel(m=m)["v"] for m in range(3)] == [1, 2, 3]
    with pytest.raises(ZeroDivisionError):
        interp.run(parse_program(src), {"m": 4})  # Python raises: so do we (lazily, only when reached)
    with pytest.raises(ZeroDivisionError):
        sel(m=4)


def test_conservative_needs_a_conservative_function(sol):
    from detent.selection import SelIRError
    with pytest.raises(SelIRError, match="no conservative"):
        sol.compile(mode="conservative")
    with pytest.raises(ValueError, match="selection mode"):
        sol.compile(mode="fast")
