"""Property tests over randomly generated small SelIR programs (hypothesis)."""
from hypothesis import given, settings, strategies as st

from detent.selection import parse_program, solve
from detent.selection.compiler.lang import SelectionError
from detent.selection.compiler import interp

VARS = ("a", "b")


@st.composite
def programs(draw):
    lines, names = [], ["m", "n", "f"]
    for i in range(draw(st.integers(1, 5))):
        x, y = draw(st.sampled_from(names)), draw(st.sampled_from(names))
        op = draw(st.sampled_from(["+", "-", "*", "min", "max", "cdiv", "//", "if"]))
        name = f"v{i}"
        if op in ("min", "max"):
            expr = f"{op}({x}, {y})"
        elif op == "cdiv":
            expr = f"cdiv({x}, 3)"
        elif op == "//":
            expr = f"{x} // 2"
        elif op == "if":
            k = draw(st.integers(0, 6))
            expr = f"{x} if {y} > {k} else {draw(st.integers(0, 4))}"
        else:
            expr = f"{x} {op} {y}"
        lines.append(f"    {name} = {expr}")
        names.append(name)
    outs = draw(st.lists(st.sampled_from(names[2:]), min_size=1, max_size=3))
    branch = draw(st.booleans())
    body = "\n".join(lines)
    ret = "{" + ", ".join(f"'p{j}': {o}" for j, o in enumerate(outs)) + "}"
    if branch:
        k = draw(st.integers(0, 6))
        tail = f"    if {outs[0]} > {k}:\n        return {ret}\n    return {{'p0': 0, 'flag': {names[-1]}}}\n"
    else:
        tail = f"    return {ret}\n"
    req = draw(st.sampled_from(["", f"    require({names[-1]} != 5, 'never five')\n"]))
    return ("def select(f: Fact[int], m: Runtime[int], n: Runtime[int]):\n"
            "    assume(0 <= m <= 6)\n    assume(0 <= n <= 5)\n" + body + "\n" + req + tail)


@settings(max_examples=60, deadline=None)
@given(programs(), st.integers(0, 3), st.sampled_from(["full", "fold"]))
def test_pinned_selectors_ignore_the_batch_and_agree_where_pins_match(src, fact, level):
    prog = parse_program(src)
    sol = solve(prog, {"f": fact}, level=level, cache=False)
    stock = sol.compile(mode="stock")
    points = [(m, n) for m in range(7) for n in range(6)]
    # stock == the reference interpreter (Python semantics), including check failures
    for m, n in points:
        try:
            want = interp.run(prog, {"f": fact, "m": m, "n": n})
        except SelectionError:
            want = "fail"
        try:
            got = stock(m=m, n=n)
        except SelectionError:
            got = "fail"
        assert got == want, (m, n)
    for a in sol.legal[:6]:
        sel = sol.compile(a)
        outs = {repr(sel(m=m, n=n)) for m, n in points}
        assert len(outs) == 1  # batch-invariant: the runtime inputs no longer reach the selection
        for m, n in points:
            vals = sol.vra.values_at((m, n))
            if vals is not None and all(v == a[p] for p, v in zip(sol.pins, vals)):
                try:
                    want = interp.run(prog, {"f": fact, "m": m, "n": n})
                except SelectionError:
                    continue
                assert sel(m=m, n=n) == want
