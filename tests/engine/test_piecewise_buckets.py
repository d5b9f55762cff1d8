"""The token buckets piecewise CUDA graphs are captured at (engine/piecewise_graph.py).
The graphs themselves run on the GPU (tests/gpu/test_gpu_piecewise_graph.py)."""
from detent.engine.config import EngineConfig
from detent.engine.piecewise_graph import default_token_buckets


def test_small_limits_keep_the_powers_of_two_ladder():
    assert default_token_buckets(128) == [16, 24, 32, 48, 64, 96, 128]
    assert default_token_buckets(100) == [16, 24, 32, 48, 64, 96, 100]
    assert default_token_buckets(15) == []


def test_mixed_steps_pad_by_less_than_128_tokens():
    b = default_token_buckets(8192)
    assert b[:11] == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert b[-1] == 8192 and b == sorted(set(b))
    for t in range(513, 2049):  # a 1,024-token prompt and its step's decodes
        assert 0 <= min(x for x in b if x >= t) - t < 128, t
    for t in range(2049, 8193):
        assert min(x for x in b if x >= t) - t < 512, t
    assert default_token_buckets(3000)[-3:] == [2048, 2560, 3000]


def test_every_step_of_the_default_budget_fits_a_bucket():
    c = EngineConfig()
    assert min(c.piecewise_max_tokens, c.max_num_batched_tokens) == c.max_num_batched_tokens
