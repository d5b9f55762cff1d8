"""Block manager + prefix cache: exact block ids, ref counts, eviction order."""
import hashlib

import pytest

from detent.scheduler.block_hash import NONE_HASH, HashedPrompt, hash_block, hash_blocks
from detent.scheduler.block_manager import BlockManager
from detent.sampling.params import SamplingParams
from detent.scheduler.request import Request

BS = 4


def req(rid, ids):
    return Request(rid, ids, SamplingParams(temperature=0), seed=0, block_size=BS)


def admit(bm, r):
    """What the scheduler does at admission: look up, allocate, advance."""
    hits = bm.find_cached_blocks(r)
    n = r.num_tokens - len(hits) * BS
    assert bm.allocate(r, n, hits)
    r.num_computed_tokens = r.num_tokens
    return hits


def test_hash_recipe_is_the_documented_one():
    h0 = hash_block(NONE_HASH, [1, 2, 3, 4])
    assert h0 == hashlib.sha256(repr((NONE_HASH, (1, 2, 3, 4), ())).encode()).digest()[:16]
    h1 = hash_block(h0, [5, 6, 7, 8], ("x",))
    assert h1 == hashlib.sha256(repr((h0, (5, 6, 7, 8), ("x",))).encode()).digest()[:16]
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], BS, ("x",)) == [hash_block(NONE_HASH, [1, 2, 3, 4], ("x",)), hash_block(hash_block(NONE_HASH, [1, 2, 3, 4], ("x",)), [5, 6, 7, 8], ("x",))]
    # chaining: the same block after a different prefix hashes differently
    assert hash_blocks([9, 9, 9, 9, 5, 6, 7, 8], BS)[1] != hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], BS)[1]


def test_append_extends_hashes_when_a_block_fills():
    r = req("a", [1, 2, 3, 4, 5, 6])
    assert len(r.block_hashes) == 1
    r.append_output_token(7)
    assert len(r.block_hashes) == 1
    r.append_output_token(8)
    assert r.block_hashes == hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], BS)
    assert r.output_token_ids == [7, 8] and r.num_tokens == 8


def test_a_hashed_prompts_hashes_are_taken_only_for_its_ids_block_size_and_extra_keys(monkeypatch):
    """A prompt hashed elsewhere (a server's pool: `HashedPrompt`) brings its blocks' hashes, pickled
    with it; a Request takes them only where they are its own prompt's, block size's and extra keys'
    (a copy of the ids will do), and hashes as before otherwise. Bit-identical to its own hashing."""
    import pickle

    from detent.scheduler import request as R
    ids = list(range(1, 11))
    hp = pickle.loads(pickle.dumps(HashedPrompt.of(ids, BS)))
    assert hp == tuple(ids) and list(hp.block_hashes) == hash_blocks(ids, BS) and hp.block_size == BS
    calls = []
    monkeypatch.setattr(R, "hash_blocks", lambda *a, **k: calls.append(a) or hash_blocks(*a, **k))
    taken = Request("a", list(ids), SamplingParams(), seed=0, block_size=BS, prompt_hashes=hp)
    assert calls == [] and taken.block_hashes == hash_blocks(ids, BS)
    taken.append_output_token(11)
    taken.append_output_token(12)
    assert taken.block_hashes == hash_blocks(ids + [11, 12], BS)  # its own list, grown
    assert list(hp.block_hashes) == hash_blocks(ids, BS)
    for other in (dict(prompt_token_ids=ids[:-1] + [99]), dict(block_size=BS // 2), dict(extra_keys=("lora",))):
        kw = dict(prompt_token_ids=ids, block_size=BS) | other
        calls.clear()
        r = Request("b", kw.pop("prompt_token_ids"), SamplingParams(), seed=0, prompt_hashes=hp, **kw)
        assert len(calls) == 1, other
        assert r.block_hashes == hash_blocks(r.prompt_token_ids, r.block_size, r.extra_keys)


def test_allocation_ids_and_null_block():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = req("a", list(range(10)))
    admit(bm, a)
    assert a.block_ids == [1, 2, 3]  # block 0 is reserved
    assert bm.ref_count[1:4] == [1, 1, 1]
    assert list(bm.cached.values()) == [1, 2]  # the two full blocks
    assert bm.num_free_blocks == 6


def test_prefix_hit_shares_blocks_and_ref_counts():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a, b = req("a", list(range(10))), req("b", list(range(8)) + [50, 51, 52])
    admit(bm, a)
    assert admit(bm, b) == [1, 2]
    assert b.block_ids == [1, 2, 4]
    assert bm.ref_count[1:5] == [2, 2, 1, 1]
    bm.free_request(a)
    assert bm.ref_count[1:5] == [1, 1, 0, 1]
    assert 1 not in bm.free and 2 not in bm.free and 3 in bm.free


def test_hit_is_capped_to_leave_one_token():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = req("a", list(range(8)))
    admit(bm, a)
    bm.free_request(a)
    b = req("b", list(range(8)))  # both blocks cached, but one token must be computed
    assert bm.find_cached_blocks(b) == [1]
    c = req("c", list(range(9)))
    assert bm.find_cached_blocks(c) == [1, 2]


def test_lru_eviction_order():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = req("a", list(range(10)))  # blocks 1, 2 (cached), 3 (partial)
    admit(bm, a)
    b = req("b", list(range(100, 108)) + [7])  # blocks 4, 5 (cached), 6
    admit(bm, b)
    bm.free_request(a)
    bm.free_request(b)
    # uncached blocks first, then cached ones: a freed before b, each prefix's tail first
    assert list(bm.free) == [6, 3, 7, 2, 1, 5, 4]
    c = req("c", list(range(200, 216)))  # 4 new blocks: takes 6, 3, 7, 2 -> evicts a's block 2
    admit(bm, c)
    assert c.block_ids == [6, 3, 7, 2]
    assert set(bm.cached.values()) == {1, 4, 5} | {6, 3, 7, 2}  # c full blocks are cached too
    # a's first block is still a hit, its second is gone
    assert bm.find_cached_blocks(req("a2", list(range(10)))) == [1]
    assert bm.find_cached_blocks(req("b2", list(range(100, 108)) + [7])) == [4, 5]


def test_revived_blocks_count_against_free_space():
    bm = BlockManager(num_blocks=4, block_size=BS)  # 3 usable
    a = req("a", list(range(9)))
    admit(bm, a)
    bm.free_request(a)  # all 3 free, blocks 1 and 2 cached
    b = req("b", list(range(8)) + [60, 61, 62, 63, 64])  # hits 1, 2; needs 2 more blocks
    hits = bm.find_cached_blocks(b)
    assert hits == [1, 2]
    assert not bm.can_allocate(b, b.num_tokens - 8, hits)  # 2 revived + 2 new > 3
    assert not bm.allocate(b, b.num_tokens - 8, hits)
    assert b.block_ids == [] and bm.ref_count == [0, 0, 0, 0]


def test_duplicate_content_stays_uncached():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a, b = req("a", list(range(6))), req("b", list(range(6)))
    assert bm.allocate(a, 6) and bm.allocate(b, 6)  # computed in the same step: no hit
    assert a.block_ids == [1, 2] and b.block_ids == [3, 4]
    assert bm.cached == {a.block_hashes[0]: 1}
    assert bm.block_hash[3] is None


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    a = req("a", list(range(10)))
    admit(bm, a)
    bm.free_request(a)
    assert bm.cached == {} and bm.find_cached_blocks(req("b", list(range(10)))) == []


def test_reset_refused_while_in_use():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = req("a", list(range(10)))
    admit(bm, a)
    assert not bm.reset_prefix_cache()
    bm.free_request(a)
    assert bm.reset_prefix_cache() and bm.cached == {}


def test_too_few_blocks_is_an_error():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=1, block_size=BS)
