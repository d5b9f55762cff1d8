"""The keyed Philox RNG: known-answer vectors, an independent pure-Python Philox, keying."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from detent.kernels.philox import philox4x32, random_bits, uniform_from_bits

M32 = 0xFFFFFFFF


def py_philox4x32_10(ctr, key):
    """Philox-4x32-10 with Python integers (Salmon et al., SC'11), written independently."""
    c, (k0, k1) = list(ctr), key
    for r in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k0) & M32, p1 & M32, ((p0 >> 32) ^ c[3] ^ k1) & M32, p0 & M32]
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c


# Random123's kat_vectors for philox4x32_10 (counter, key, expected output)
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,expected", KAT)
def test_known_answer_vectors(ctr, key, expected):
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    got = philox4x32([t(c) for c in ctr], [t(k) for k in key])
    assert [int(w) for w in got] == list(expected)
    assert py_philox4x32_10(ctr, key) == list(expected)


def test_random_bits_match_pure_python_reference():
    seeds = [0, 1, 2**32 + 5, 2**64 - 1, 123456789012345]
    positions = [0, 7, 4095, 2**32 - 1, 31]
    samples = [0, 3, 1, 0, 9]
    V = 11
    bits = random_bits(seeds, positions, samples, V, role=2)
    for i, (s, p, n) in enumerate(zip(seeds, positions, samples)):
        want = []
        for t in range(V):
            want.append(py_philox4x32_10((t // 4, p, n, 2), (s & M32, s >> 32))[t % 4])
        assert bits[i].tolist() == want


def test_bits_at_token_ids_equal_the_full_vocabulary_draw():
    from detent.kernels.philox import random_bits_at
    seeds, pos, smp = [3, 2**40 + 1], [17, 900], [0, 2]
    full = random_bits(seeds, pos, smp, 1000, role=1)
    ids = torch.tensor([[0, 1, 2, 3, 4, 999, 517], [998, 5, 5, 6, 7, 0, 250]])
    assert torch.equal(random_bits_at(seeds, pos, smp, ids, role=1), full.gather(1, ids))


def test_row_bits_do_not_depend_on_the_batch():
    V = 1000
    alone = random_bits([42], [17], [0], V)
    batch = random_bits(list(range(40)) + [42] + list(range(100, 123)), [5] * 40 + [17] + [9] * 23,
                        [0] * 64, V)
    assert torch.equal(alone[0], batch[40])


def test_every_key_component_changes_the_draw():
    base = random_bits([7], [100], [0], 64, role=0)
    for kw in (dict(seeds=[8], positions=[100], sample_indices=[0], role=0),
               dict(seeds=[7], positions=[101], sample_indices=[0], role=0),
               dict(seeds=[7], positions=[100], sample_indices=[1], role=0),
               dict(seeds=[7], positions=[100], sample_indices=[0], role=1),
               dict(seeds=[7 + 2**32], positions=[100], sample_indices=[0], role=0)):
        other = random_bits(vocab=64, **kw)
        assert (other != base).float().mean() > 0.9


def test_negative_seed_is_taken_mod_2_64():
    assert torch.equal(random_bits([-1], [0], [0], 8), random_bits([2**64 - 1], [0], [0], 8))


def test_uniforms_are_uniform():
    u = uniform_from_bits(random_bits(list(range(200)), [3] * 200, [0] * 200, 500)).flatten().numpy()
    assert 0 < u.min() and u.max() < 1
    assert stats.kstest(u, "uniform").pvalue > 1e-4
    # bits 0..31 each set about half the time
    b = random_bits(list(range(100)), [0] * 100, [0] * 100, 1000).flatten().numpy()
    frac = np.array([((b >> k) & 1).mean() for k in range(32)])
    assert np.all(np.abs(frac - 0.5) < 0.01)


def test_position_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="position"):
        random_bits([0], [2**32], [0], 4)


@pytest.mark.gpu
def test_cpu_and_gpu_bits_are_identical():
    args = (list(range(64)), list(range(64)), [0] * 64, 128256)
    assert torch.equal(random_bits(*args).cuda(), random_bits(*args, device="cuda"))
