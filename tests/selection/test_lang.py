"""The SelIR surface language: the subset, its error messages, the interpreter."""
import pytest

from detent.selection import SelIRError, SelIRSyntaxError, parse_program, solve
from detent.selection.compiler.lang import SelectionError
from detent.selection.compiler import interp

OK = '''
TABLE = {1: 10, 4: 40}


def helper(x, scale=2):
    if x > 3:
        return x * scale
    return x


def select(n: Fact[int], mode: Fact[str], m: Runtime[int]):
    assume(1 <= m <= 8, "m out of range")
    k = knob("k", (1, 2), 1)
    acc = 0
    for i in range(3):
        acc += i * k
    if mode == "a":
        v = helper(m)
    elif mode == "b":
        v = -m
    else:
        v = TABLE[1 if m < 4 else 4]
    require(v != 99, "never 99")
    return {"v": v, "acc": acc, "c": cdiv(m, 3) + log2(8) + next_pow2(m) + round_up(m, 4) + min(m, n)}
'''


def test_interpreter_runs_with_python_semantics_and_knobs():
    p = parse_program(OK, "ok.py")
    assert p.facts == ["n", "mode"] and p.runtime_inputs == ["m"]
    out = interp.run(p, {"n": 5, "mode": "a", "m": 6})
    assert out == {"v": 12, "acc": 3, "c": 2 + 3 + 8 + 8 + 5}
    assert interp.run(p, {"n": 5, "mode": "x", "m": 2})["v"] == 10
    assert interp.run(p, {"n": 5, "mode": "a", "m": 2}, knobs={"k": 2})["acc"] == 6
    with pytest.raises(SelectionError, match="m out of range"):
        interp.run(p, {"n": 5, "mode": "a", "m": 9})


@pytest.mark.parametrize("body,construct,line", [
    ("    while m:\n        m -= 1\n    return {'a': m}", "while loop", 3),
    ("    f = lambda x: x\n    return {'a': m}", "lambda", 3),
    ("    return {'a': m.bit_length()}", "method call", 3),
    ("    return {'a': [x for x in (1, 2)]}", "list comprehension", 3),
    ("    return {'a': f'{m}'}", "f-string", 3),
    ("    import os\n    return {'a': m}", "import inside a function", 3),
    ("    try:\n        pass\n    except Exception:\n        pass\n    return {'a': m}", "try statement", 3),
    ("    assert m\n    return {'a': m}", "assert (use require)", 3),
    ("    return {'a': open(m)}", "call of 'open'", 3),
    ("    x = m[1:2]\n    return {'a': x}", "slicing", 3),
    ("    for i in range(3):\n        break\n    return {'a': m}", "break", 4),
])
def test_constructs_outside_the_subset_name_file_line_col(body, construct, line):
    src = "def select(m: Runtime[int]):\n    assume(0 <= m <= 3)\n" + body + "\n"
    with pytest.raises(SelIRSyntaxError) as e:
        parse_program(src, "prog.py")
    msg = str(e.value)
    assert msg.startswith(f"prog.py:{line}:"), msg
    assert construct in msg, msg


def test_signature_and_module_errors():
    with pytest.raises(SelIRSyntaxError, match=r"p.py:1:\d+: input 'm' needs an annotation"):
        parse_program("def select(m):\n    return {'a': 1}\n", "p.py")
    with pytest.raises(SelIRSyntaxError, match=r"p.py:1:0: module-level ClassDef"):
        parse_program("class A: pass\n", "p.py")
    with pytest.raises(SelIRSyntaxError, match="Python syntax error"):
        parse_program("def select(:\n", "p.py")


def test_unbounded_runtime_input_and_missing_fact_are_named():
    p = parse_program("def select(n: Fact[int], m: Runtime[int]):\n    return {'a': m + n}\n", "p.py")
    with pytest.raises(SelIRError, match="runtime input 'm' .* has no declared bounds"):
        solve(p, {"n": 1}, cache=False)
    with pytest.raises(SelIRError, match="needs fact 'n'"):
        solve(p, {}, cache=False)
    with pytest.raises(SelIRError, match="fact 'n' should be int"):
        solve(p, {"n": "1"}, cache=False)


def test_bounds_from_annotation_may_refer_to_facts():
    p = parse_program("def select(hi: Fact[int], m: Runtime[int, 2, hi * 2]):\n    return {'a': m > 100}\n")
    sol = solve(p, {"hi": 10}, cache=False)
    assert sol.lowered.domains["m"] == (2, 20)
    assert sol.pins == ()  # m > 100 is False over [2, 20]: range folding removes the batch dependence
    assert sol.compile()(m=5) == {"a": False}
