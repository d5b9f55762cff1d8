"""benchmarks/schedule_sim.py: the real engine loop on a simulated clock.

The oracle is arithmetic: a request alone on the engine takes one prefill step
(base + per token x prompt) to its first token and one decode step (base + per
token) per token after, back to back under async scheduling."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import schedule_sim  # noqa: E402


def test_a_request_alone_gets_the_cost_models_step_times():
    r = schedule_sim.simulate(rate=0.01, requests=4, prompt_len=32, output_len=8, cap=2048, base_ms=8.6,
                              per_token_us=21.8, max_num_batched_tokens=256)
    assert abs(r["ttft_ms"]["mean"] - (8.6 + 32 * 0.0218)) < 1e-6
    assert abs(r["tpot_ms"]["mean"] - (8.6 + 0.0218)) < 1e-6
    assert (r["prefill_steps"], r["mixed_steps"], r["decode_steps"]) == (4, 0, 28)  # 1 + 7 steps a request
    # a decode row priced apart from a prompt token (lease 26's fit): only the TPOT moves
    r = schedule_sim.simulate(rate=0.01, requests=4, prompt_len=32, output_len=8, cap=2048, base_ms=7.7,
                              per_token_us=21.2, per_row_us=56.0, max_num_batched_tokens=256)
    assert abs(r["ttft_ms"]["mean"] - (7.7 + 32 * 0.0212)) < 1e-6
    assert abs(r["tpot_ms"]["mean"] - (7.7 + 0.056)) < 1e-6


def test_under_load_every_running_request_advances_every_step():
    # requests overlap: each step carries every running request's decode row, save the extra
    # row a request that finished at the step before still has under async scheduling
    r = schedule_sim.simulate(rate=50, requests=24, prompt_len=48, output_len=16, cap=2048, base_ms=8.6,
                              per_token_us=21.8, max_num_batched_tokens=256)
    assert r["mixed_steps"] > 0 and r["decode_rows_per_step"] > 2
    assert r["rows_short_of_running"] <= 1
