"""The tuner (detent/tune.py, docs/tune.md) on the tiny Llama (fp32, CPU).

With a fake cost model whose optimum is known, the tuner picks the cheapest
legal assignment and never measures an illegal tuple; its additivity check
is exact for an additive cost and reports an interaction. The tuned tuple
loads, serves, and keeps the battery's cells bit-identical (compared with
`==`), which the same cells under selection="stock" do not."""
from __future__ import annotations

import pytest

from detent.battery import OfflineBackend, run_battery
from detent.battery_cells import select
from detent.cli import main
from detent.selection import CommitmentTuple
from detent.selection.compiler.tune_space import family_assignment, family_space
from detent.tune import tune
from engine_helpers import bundle, make_llm
from tune_helpers import BEST, CONFIG, fake_tune, tiny_llm, workload

llm = pytest.fixture(scope="module")(tiny_llm)


def test_profile_records_each_familys_runtime_inputs(llm):
    out, _ = fake_tune(llm, max_candidates=2, min_fraction=1.0, refine=0, interactions=0)
    att = out.profile["attention"]
    assert len(att) == 1  # one call site
    (counts,) = att.values()
    inputs = [dict(rt) for rt in counts]
    assert any(i["max_seqlen_q"] == 1 for i in inputs) and any(i["max_seqlen_q"] > 1 for i in inputs)
    # weights in decode rows (the default objective, "tpot"): a prefill-only step's inputs weigh 0
    assert all(isinstance(n, int) and n >= 0 for n in counts.values())
    assert all(n >= 1 for rt, n in counts.items() if dict(rt)["max_seqlen_q"] == 1)
    assert len(out.profile["gemm"]) == 5  # qkv, o, gate_up, down, lm head


def test_profile_records_prompt_steps_and_one_decode_step_in_every_and_replays_the_rest(llm):
    # the profile under graphs: every step with prompt rows eagerly, recorded as before; one
    # decode-only step in 4 eagerly, counted 4 times; the other decode steps through the forward the
    # runner held (its CUDA graphs; here a stand-in that runs the eager forward and counts). Steps
    # are counted as steps: the "time" objective (decode-row weights: test_tune_objective.py)
    import tempfile
    from detent.selection import default_tuple
    from detent.tune_cost import profile_workload
    from detent.tune_engine import SampledProfile, TupleInstaller, engine_facts
    runner = llm.llm_engine.runner
    base = default_tuple(engine_facts(llm))

    def profile(every):
        with tempfile.TemporaryDirectory() as tmp:
            inst = TupleInstaller(llm, tmp, every, objective="time")
            calls = profile_workload(inst, base, workload())
        assert not isinstance(runner._forward, SampledProfile)  # the runner's own forward is back
        return calls, inst.profile_stats

    def split(calls):
        decode, prompt = {}, {}
        for (fam, site, rt), n in calls.items():
            (decode if dict(rt)["max_seqlen_q"] == 1 else prompt)[(fam, site, rt)] = n
        return decode, prompt

    eager, replayed = runner._forward, []

    def graphs(input_ids, positions, ctx):
        replayed.append(ctx.attn.max_seqlen_q)
        return eager(input_ids, positions, ctx)
    runner._forward, runner._eager_forward = graphs, eager
    try:
        runner.graphs_tuple = "another tuple's"  # graphs of other selections: every step eager
        _, other = profile(4)
        assert other["replayed"] == 0 and not replayed and other["decode_steps"] > 8
        runner.graphs_tuple = base.hash  # the stand-in graphs hold the profiled tuple's selections
        sampled, prof = profile(4)
    finally:
        runner._forward = eager
        del runner._eager_forward
    full, prof1 = profile(1)
    assert prof1["replayed"] == 0
    d4, p4 = split(sampled)
    d1, p1 = split(full)
    assert p4 == p1 and p1  # prompt-row steps: every one, the same counts
    steps = prof["decode_steps"]
    assert steps > 8 and prof["replayed"] == len(replayed) == steps - -(-steps // 4) and set(replayed) == {1}
    assert set(d4) < set(d1)  # a sample of the decode steps' inputs...
    for fam, site in {(f, s) for f, s, _ in d1}:  # ...each counted 4 times: every site's total covers them all
        n1 = sum(n for (f, s, _), n in d1.items() if (f, s) == (fam, site))
        n4 = sum(n for (f, s, _), n in d4.items() if (f, s) == (fam, site))
        assert n1 == steps and steps <= n4 < steps + 4, (fam, site, n1, n4)


def test_fake_cost_exhaustive_picks_the_cheapest_legal_assignment(llm):
    out, fake = fake_tune(llm, dedupe=False, max_candidates=10_000, min_fraction=1.0, refine=0)
    res = out.result
    for fam in ("gemm", "attention"):
        space = family_space(out.facts, fam)
        cheapest = min(space.legal, key=lambda a: fake.family_cost(fam, a))
        assert cheapest == BEST[fam] and res.families[fam].chosen == BEST[fam]
        assert len(res.families[fam].tried) == len(space.legal)  # the whole legal grid, nothing else
    assert {f: family_assignment(res.chosen, f) for f in BEST} == BEST
    assert not res.kept_default and res.delta < 1e-12  # an additive cost adds up exactly


def test_halving_and_hill_climbing_reach_the_optimum_measuring_a_part_of_the_grid(llm):
    out, fake = fake_tune(llm, dedupe=False, max_candidates=8, eta=3, min_fraction=0.25, refine=30)
    att = out.result.families["attention"]
    assert att.chosen == BEST["attention"]
    assert len(att.tried) < att.legal / 2
    assert all(t.hash for t in fake.seen)  # every one loaded (FakeCost.measure validates)


def test_additivity_check_reports_an_interaction(llm):
    out, _ = fake_tune(llm, interaction=3.0, dedupe=False, max_candidates=10_000, min_fraction=1.0, refine=0)
    c = out.result.checks[0]
    assert c["label"] == "combined best" and c["measured"] - c["predicted"] == pytest.approx(3.0)
    assert out.result.delta == pytest.approx(3.0 / c["measured"])


def test_where_families_interact_the_cheapest_measured_tuple_is_taken(llm):
    """The default costs 120 (gemm 5, attention 15), attention's repin alone 105, gemm's 115.
    With +30 whenever both move, the combined tuple (130) and every mix cost more than the
    default, and attention's repin alone is the cheapest tuple measured: it is the one taken
    (before: the default, because the combined tuple was slower)."""
    grid = dict(dedupe=False, max_candidates=10_000, min_fraction=1.0, refine=0)
    res = fake_tune(llm, interaction=30.0, **grid)[0].result
    assert res.checks[0]["label"] == "combined best" and res.checks[0]["measured"] == pytest.approx(130.0)
    assert res.base_cost == pytest.approx(120.0) and res.pick == "attention alone" and not res.kept_default
    assert res.pick_cost == pytest.approx(105.0) and {f: family_assignment(res.chosen, f) for f in BEST} == {
        "gemm": res.families["gemm"].default, "attention": BEST["attention"]}
    # a mix that moves both families 50 cheaper than the additive sum, the combined tuple not:
    # a measured mix beats the per-family optimum, and the cheapest measured mix is taken
    bonus = lambda a: -50.0 if a["gemm"] == BEST["gemm"] and a["attention"] not in (  # noqa: E731
        BEST["attention"], res.families["attention"].default) else 0.0
    res = fake_tune(llm, interaction=bonus, **grid)[0].result
    mixes = [c for c in res.checks if c["label"].startswith("mix")]
    assert mixes and res.checks[0]["measured"] == pytest.approx(100.0)
    best = min(mixes, key=lambda c: c["measured"])
    assert res.pick == best["label"] and res.pick_cost == best["measured"] < 100.0
    assert {f: family_assignment(res.chosen, f) for f in BEST} == best["assignments"]
    # one family searched (attention, as on one GPU): the combined tuple is that family's repin,
    # and its check's later measurement stands for it, not the search's
    res = fake_tune(llm, families=["attention"], **grid)[0].result
    assert res.pick == "combined best" and res.pick_cost == res.checks[0]["measured"] == pytest.approx(105.0)


def test_dedupe_measures_each_set_of_selections_once(llm):
    """Attention's split_stride only shapes the legal split sizes: repins that differ in it
    select the same kernels with the same parameters, so it is held at the default and a
    repeated selection is not measured again."""
    out, fake = fake_tune(llm, max_candidates=10_000, min_fraction=1.0, refine=0)
    att = out.result.families["attention"]
    assert att.inert == ["split_stride"]
    assert all(t["assignment"]["split_stride"] == 256 for t in att.tried)
    assert att.chosen == {"split_tokens": 32, "split_stride": 256}  # the cheapest selection the fake can see
    measured = [t for t in att.tried if "same_as" not in t]
    assert len(fake.seen) < len(family_space(out.facts, "attention").legal)
    for t in att.tried:
        if "same_as" in t:  # it shares a measured assignment's cost, which selects what it selects
            assert t["costs"] == next(m["costs"] for m in measured if m["assignment"] == t["same_as"])


def test_an_illegal_candidate_is_refused_not_measured(llm, monkeypatch):
    from detent.selection import TupleError
    from detent.selection.compiler import tune_space
    real = tune_space.family_space

    def with_an_illegal_value(facts, family):
        s = real(facts, family)
        if s is None or family != "attention":
            return s
        bad = {"split_tokens": 24, "split_stride": 64}  # not a multiple of the 16-token page
        axes = {**s.axes, "split_tokens": (24,) + s.axes["split_tokens"]}
        return tune_space.FamilySpace(s.family, s.pins, s.knobs, axes, (bad,) + s.legal[:3], s.sites)
    monkeypatch.setattr("detent.tune.family_space", with_an_illegal_value)
    with pytest.raises(TupleError, match="split_tokens"):  # the tuner's own check, before measuring
        fake_tune(llm, check=False, dedupe=False, max_candidates=10_000, min_fraction=1.0, refine=0)


def test_kernel_cost_times_the_profiled_calls(llm):
    from detent.tune_kernels import _attention_meta, bucket
    out = tune(llm, workload(), cost="kernels", max_candidates=4, min_fraction=0.5, refine=1, interactions=1)
    # the default objective, "tpot": per decode row, over the loops W-A's four Poisson loads run in
    assert out.unit.startswith("ms of kernel time per decode row (a TPOT estimate)")
    assert sorted(name for loop in out.loops for name in loop["loads"]) == ["A1", "A2", "A3", "A4"]
    res = out.result
    assert res.base_cost > 0 and all(c > 0 for f in res.families.values() for t in f.tried for c in t["costs"].values())
    for fam in ("gemm", "attention"):
        assert res.families[fam].chosen in family_space(out.facts, fam).legal
    rt = {"num_tokens": 19, "num_seqs": 4, "max_seqlen_q": 16, "max_seqlen_k": 40, "total_kv": 70}
    meta, blocks = _attention_meta(rt, 16, "cpu")
    assert (meta.num_seqs, meta.max_seqlen_q, meta.max_seqlen_k) == (4, 16, 40)
    assert meta.num_tokens == 19 and len(meta.slot_mapping) == 19 and int(meta.slot_mapping.max()) < blocks * 16
    # rounded down to 1.25^k: 1.25^13 = 18.2, 1.25^12 = 14.6, 1.25^16 = 35.5, 1.25^19 = 69.4
    assert dict(bucket(tuple(rt.items()))) == {"num_tokens": 18, "num_seqs": 4, "max_seqlen_q": 14,
                                               "max_seqlen_k": 35, "total_kv": 69}


def _cells(selection: str, tuple_path: str | None):
    llm = make_llm(bundle("llama"), selection, tuple=tuple_path, **CONFIG)
    try:
        return run_battery(OfflineBackend(llm), select("quick"))
    finally:
        llm.shutdown()


def test_tuned_tuple_loads_serves_and_stays_invariant(llm, tmp_path):
    out, _ = fake_tune(llm, max_candidates=10_000, min_fraction=1.0, refine=0)
    path = str(tmp_path / "tuned.json")
    out.result.chosen.save(path)
    tuned = make_llm(bundle("llama"), "pinned", tuple=path, **CONFIG)
    try:
        assert tuned.llm_engine.fingerprint().tuple_hash == out.result.chosen.hash
        outs = tuned.generate([{"prompt_token_ids": [5, 6, 7, 8]}], __import__("detent").SamplingParams(
            temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(outs[0].outputs[0].token_ids) == 4
    finally:
        tuned.shutdown()
    pinned = _cells("pinned", path)
    assert all(r.passed for r in pinned), [(r.cell, r.differences) for r in pinned if not r.passed]
    stock = _cells("stock", None)
    assert any(not r.passed for r in stock), "stock passed every cell: the check cannot fail"


def test_cli_writes_the_tuple_report_and_plot_and_the_tuple_serves(tmp_path, capsys):
    import json

    from detent import LLM, SamplingParams
    from detent.cli import main
    from detent.models.tiny import write_tiny_llama
    model = write_tiny_llama(str(tmp_path / "tiny"))
    args = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--max-num-batched-tokens", "32"]
    out = tmp_path / "t" / "w.json"
    assert main(["tune", "--model", model, "--workload", "W-C", "--num-requests", "2", "--max-len", "40",
                 "--families", "gemm", "--interactions", "0", *args, "-o", str(out)]) == 0
    rep = json.loads((tmp_path / "t" / "w.report.json").read_text())
    assert rep["format"] == "detent-tune-report/1" and rep["workload"] == "W-C"
    assert rep["objective"] == "tpot" and rep["unit"] == (  # W-C: two closed loops
        "ms per output token, row-weighted step time, geometric mean over the closed loops of 1, 8")
    # W-C's own loads, nothing measured to place them; two requests, each loop replays both
    assert rep["loops"] == [{"cap": 1, "loads": ["C1"], "requests": 2}, {"cap": 8, "loads": ["C2"], "requests": 2}]
    assert rep["throughput"] is None
    fam = rep["families"]["gemm"]
    assert fam["legal_assignments"] == 2 and fam["measured_assignments"] == 2 and fam["chosen"] in ({"chunk": 1},
                                                                                                   {"chunk": 16})
    assert all(c > 0 for t in fam["tried"] for c in t["costs"].values())
    assert rep["profile"]["attention"] and rep["tuple_hash"] == CommitmentTuple.load(str(out)).hash
    assert (tmp_path / "t" / "w.png").stat().st_size > 1000
    assert "ms per output token" in capsys.readouterr().out
    llm = LLM(model=model, tuple=str(out), device="cpu", dtype="float32", max_model_len=256,
              max_num_batched_tokens=32)
    try:
        assert llm.llm_engine.fingerprint().tuple_hash == rep["tuple_hash"]
        o = llm.generate([{"prompt_token_ids": [11, 12, 13]}], SamplingParams(max_tokens=3, ignore_eos=True),
                         use_tqdm=False)
        assert len(o[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()
    assert main(["tune", "--model", model, "--workload", "W-Z", *args, "-o", str(out)]) == 2
    assert "neither a workload name" in capsys.readouterr().err
    assert main(["tune", "--model", model, "--workload", "W-C", "--profile-every", "0", *args, "-o", str(out)]) == 2
    assert "--profile-every 0" in capsys.readouterr().err  # refused before the model loads
    assert rep["profile_every"] == 8 and rep["time_budget"] == 600
    assert {"load", "profile", "search"} <= set(rep["phases"]) and all(v >= 0 for v in rep["phases"].values())
    assert main(["tune", "--model", model, "--workload", "W-C", "--time-budget", "-1", *args, "-o", str(out)]) == 2
    assert "--time-budget -1" in capsys.readouterr().err
    # a budget the load alone spends: the default is measured, nothing else, and the default is written
    spent = tmp_path / "spent.json"
    assert main(["tune", "--model", model, "--workload", "W-C", "--num-requests", "2", "--max-len", "40",
                 "--families", "gemm", "--time-budget", "1", *args, "-o", str(spent)]) == 0
    rep = json.loads((tmp_path / "spent.report.json").read_text())
    assert rep["search_cut"].startswith("family gemm") and rep["kept_default"] and rep["time_budget"] == 1
    assert rep["families"]["gemm"]["measured_assignments"] == 0
    assert "the search's share of --time-budget ran out" in capsys.readouterr().out
    # Poisson loads at fractions of a given maximum (stock's, served): no replay of every request at once
    given = tmp_path / "given.json"
    assert main(["tune", "--model", model, "--workload", "W-B", "--num-requests", "2", "--max-len", "40",
                 "--families", "gemm", "--interactions", "0", "--max-throughput", "1000", *args,
                 "-o", str(given)]) == 0
    rep = json.loads((tmp_path / "given.report.json").read_text())
    assert rep["throughput"]["max_throughput"] == 1000 and rep["throughput"]["max_throughput_from"] == "given"
    assert "maximum throughput: 1000.000 requests/s (given)" in capsys.readouterr().err
    assert main(["tune", "--model", model, "--workload", "W-B", "--max-throughput", "0", *args, "-o", str(given)]) == 2
    assert "--max-throughput 0" in capsys.readouterr().err


def test_a_workload_file_of_requests(tmp_path):
    import json

    from detent.tune_cli import load_workload
    f = tmp_path / "w.jsonl"
    f.write_text(json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 3}) + "\n\n"
                 + json.dumps({"prompt_token_ids": [5, 6, 7, 8], "max_tokens": 2, "after": 0}) + "\n")
    w = load_workload(str(f), vocab=160, num_requests=None, max_len=None, seed=0)
    assert [(r.prompt_token_ids, r.max_tokens, r.after) for r in w.requests] == [((5, 6), 3, None),
                                                                                 ((5, 6, 7, 8), 2, 0)]
    assert w.rounds() == [[0], [1]]
    f.write_text(json.dumps({"prompt_token_ids": [5], "max_tokens": 3, "after": 0}) + "\n")
    with pytest.raises(ValueError, match="line 1: 'after' must name an earlier request"):
        load_workload(str(f), vocab=160, num_requests=None, max_len=None, seed=0)
    f.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match="line 1: expected"):
        load_workload(str(f), vocab=160, num_requests=None, max_len=None, seed=0)


@pytest.mark.parametrize("args,said", [
    (["--eta", "1"], "argument --eta: must be at least 2, got 1"),  # was taken as 2, silently
    (["--min-fraction", "0"], "argument --min-fraction: a share of the workload, in (0, 1], got 0"),
    (["--num-requests", "0"], "argument --num-requests: must be at least 1, got 0"),  # was the whole workload
    (["--max-len", "2"], "argument --max-len: must be at least 8, got 2"),  # W-B's requests then had max_tokens 0
    (["--repeats", "0"], "argument --repeats: must be at least 1, got 0"),
    (["--max-candidates", "0"], "argument --max-candidates: must be at least 1, got 0"),
    (["--refine", "-1"], "argument --refine: must be at least 0, got -1"),
])
def test_tune_refuses_a_search_setting_out_of_range_before_anything_loads(args, said, capsys):
    with pytest.raises(SystemExit) as e:
        main(["tune", "--workload", "W-A", "-o", "t.json", *args])
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_a_bad_workload_file_fails_before_the_model_loads_naming_its_line(tmp_path, monkeypatch, capsys):
    """A request with no prompt token failed only in the profile, after the model's load, as the
    engine's "prompt_token_ids is empty" with no line; an id outside the vocabulary, the same way.
    The file is read and checked first; the vocabulary, once the model says it."""
    import json

    import detent.engine
    f = tmp_path / "w.jsonl"
    f.write_text(json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 3}) + "\n\n"
                 + json.dumps({"prompt_token_ids": [], "max_tokens": 2}) + "\n")
    with monkeypatch.context() as m:
        m.setattr(detent.engine, "LLM", lambda *a, **k: pytest.fail("the model was loaded"))
        assert main(["tune", "--workload", str(f), "-o", str(tmp_path / "t.json")]) == 2
    assert f"--workload {f} line 3: a request needs at least one prompt token" in capsys.readouterr().err

    from detent.tune_cli import file_workload, read_requests
    f.write_text(json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 3}) + "\n"
                 + json.dumps({"prompt_token_ids": [7, 160], "max_tokens": 2}) + "\n")
    rows = read_requests(str(f))
    with pytest.raises(ValueError, match=r"line 2: token id 160 is outside the model's vocabulary \[0, 160\)"):
        file_workload(str(f), rows, 160, None, 0)
    assert len(file_workload(str(f), rows, 161, None, 0).requests) == 2


def test_tune_runs_from_a_plain_install_without_the_plot(tmp_path):
    """Only the runtime dependencies importable (tests/server/plain_install.py): the tuple and
    report are written, the PNG (matplotlib, the `bench` extra) is skipped with a message."""
    import os
    import subprocess
    import sys

    from detent.models.tiny import write_tiny_llama
    model = write_tiny_llama(str(tmp_path / "tiny"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = (
        "import sys; sys.path.insert(0, 'tests/server')\n"
        "from plain_install import block, blocked_modules, project_requirements, runtime_closure\n"
        "b = blocked_modules(runtime_closure(project_requirements())); assert 'matplotlib' in b; block(b)\n"
        "from detent.cli import main\n"
        f"sys.exit(main(['tune', '--model', {model!r}, '--workload', 'W-C', '--num-requests', '2', '--max-len', '40',"
        " '--families', 'gemm', '--cost', 'kernels', '--device', 'cpu', '--dtype', 'float32',"
        f" '--max-model-len', '256', '--max-num-batched-tokens', '32', '--block-size', '32',"
        f" '-o', {str(tmp_path / 't.json')!r}]))\n")
    p = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "matplotlib is not installed, no plot written" in p.stderr
    assert (tmp_path / "t.json").exists() and (tmp_path / "t.report.json").exists()
    assert not (tmp_path / "t.png").exists()
    assert CommitmentTuple.load(str(tmp_path / "t.json")).to_dict()["deployment"]["facts"]["page_size"] == 32


def test_a_candidate_whose_graphs_did_not_capture_stops_the_tune(llm, monkeypatch, tmp_path):
    # lease 15: on the H200 the candidates' recaptures ran out of memory and their steps ran
    # eagerly, timed against the default's graphs. The installer now refuses such a candidate
    # (the default's own failures, if any, are the baseline); CPU captures nothing, so the
    # install's report of failed graph sets is stubbed
    from detent.selection import default_tuple
    from detent import tune_engine
    from detent.tune_engine import GraphCaptureError, TupleInstaller, engine_facts
    facts = engine_facts(llm)
    base = default_tuple(facts)
    other = CommitmentTuple.from_json(base.to_json())
    other.families["attention"]["knobs"]["split_stride"] = 64
    report = {"failed": {"cuda_graphs": "decode graphs off for another reason"}}
    monkeypatch.setattr(tune_engine, "_install_local", lambda *a, **k: dict(report["failed"]))
    inst = TupleInstaller(llm, str(tmp_path))
    inst.install(base, record=True)  # profiling: eager on purpose, no baseline yet
    assert inst.base_failures is None
    inst.install(base)
    assert inst.base_failures == {"cuda_graphs": "decode graphs off for another reason"}
    inst.install(other)  # fails what the default failed too: comparable, measured
    report["failed"] = {"cuda_graphs": "decode graphs off for another reason",
                        "mixed_graphs": "mixed-step capture failed (OutOfMemoryError: ...)"}
    inst.current = None
    with pytest.raises(GraphCaptureError, match=r"mixed_graphs: mixed-step capture failed .*--cost kernels"):
        inst.install(other)
    assert inst.current is None  # the next install tries again


def test_kernel_cost_compiles_are_not_logged_as_serving(llm, monkeypatch, caplog):
    """KernelCost's warm-up call compiles each candidate's kernels by design. After a warm start
    the engine's compile watch names every later compile as a miss of the warm start; inside the
    tuner's timing it must stay silent, and outside it still counts."""
    import detent.tune_kernels as tk
    from detent.engine.compile_watch import CompileWatch
    watch = CompileWatch()
    real = tk._call

    def compiling(*a, **kw):
        call = real(*a, **kw)
        return lambda: (watch(repr="candidate_kernel"), call())

    monkeypatch.setattr(tk, "_call", compiling)
    out = tune(llm, workload(), cost="kernels", families=["gemm"], max_candidates=2, min_fraction=1.0, refine=0,
               interactions=0)
    assert out.result.base_cost > 0
    assert watch.count == 0 and "compiled while serving" not in caplog.text
    watch(repr="a_compile_while_serving")
    assert watch.count == 1 and "compiled while serving" in caplog.text
