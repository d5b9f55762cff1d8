"""The prefix-cache hash recipe (one place, tested down to the digest).

A full block of ``block_size`` tokens is identified by the hash of its
parent block's hash, its own token ids and the request's extra keys:

    block_hash[i] = sha256(repr((block_hash[i-1], tuple(token_ids[i*bs:(i+1)*bs]), extra_keys)))

truncated to 16 bytes, with ``block_hash[-1] = NONE_HASH``. Chaining makes a
block's hash name its whole prefix, so a hit on block ``i`` implies hits on
blocks ``0..i-1``. ``extra_keys`` carries anything besides the tokens that
changes the KV (none today; a LoRA id or an image hash would go here).
sha256 over ``repr`` is stable across processes and Python versions (unlike
``hash()`` on str/bytes), so hashes can be logged and compared.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

BlockHash = bytes

NONE_HASH: BlockHash = hashlib.sha256(b"detent-prefix-cache-v1").digest()[:16]


def hash_block(parent: BlockHash, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    payload = repr((parent, tuple(int(t) for t in token_ids), tuple(extra_keys))).encode()
    return hashlib.sha256(payload).digest()[:16]


def hash_blocks(token_ids: Sequence[int], block_size: int, extra_keys: tuple = (),
                parent: BlockHash = NONE_HASH, start_block: int = 0) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block ``start_block`` on,
    chained from ``parent`` (the hash of block ``start_block - 1``)."""
    out: list[BlockHash] = []
    for i in range(start_block, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys)
        out.append(parent)
    return out


class HashedPrompt(tuple):
    """A prompt's token ids, immutable, with its full blocks' hashes under one block size and extra
    keys, made off the engine's step thread (`HashedPrompt.of`: detent-serve's pool, for its engine's
    block size, EngineLimits.block_size). It travels as the prompt itself (pickled with its hashes);
    a `Request` takes them where they are its own prompt's, block size's and extra keys' (`hashes_for`),
    else hashes as before: a 32k-token prompt's took 6.4 ms on the step thread."""
    block_size: int
    extra_keys: tuple
    block_hashes: tuple[BlockHash, ...]

    @classmethod
    def of(cls, token_ids: Sequence[int], block_size: int, extra_keys: tuple = ()) -> "HashedPrompt":
        p = cls(token_ids)
        p.block_size, p.extra_keys = block_size, tuple(extra_keys)
        p.block_hashes = tuple(hash_blocks(p, block_size, p.extra_keys))
        return p

    def hashes_for(self, token_ids: Sequence[int], block_size: int, extra_keys: tuple) -> list[BlockHash] | None:
        """Its hashes, if they are those of `token_ids` under `block_size` and `extra_keys`; else None."""
        if block_size != self.block_size or tuple(extra_keys) != self.extra_keys or tuple(token_ids) != self:
            return None
        return list(self.block_hashes)
