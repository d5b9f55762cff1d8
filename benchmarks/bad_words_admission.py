"""What detent-serve's engine core spends admitting a request with many bad words (CPU).

The core admits requests between two steps (engine/core_process.py), so this
time is a pause of every running request. It receives the request's
`SamplingParams` pickled, checks its ids against the vocabulary and builds the
bad-words index (`RequestMaskIds.build`). Printed, median of `--repeat` runs:
unpickling the params (their words as `TokenWords`, sampling/params.py) and,
for comparison, the same words as lists; `verify_vocab`; the index build; and
the three together. `--frozen` freezes the heap first, as the core does on a
GPU (`EngineConfig.freeze_gc`), which changes what the collector walks.

    python benchmarks/bad_words_admission.py --words 100000 [--frozen]
"""
from __future__ import annotations

import argparse
import gc
import pickle
import random
import statistics
import time

from detent.sampling.params import SamplingParams
from detent.sampling.processors import RequestMaskIds


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1000, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--words", type=int, default=100_000)
    ap.add_argument("--max-len", type=int, default=5, help="each word has 1 to this many tokens")
    ap.add_argument("--vocab", type=int, default=128_256)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--frozen", action="store_true", help="gc.freeze() the heap first, as the GPU core does")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    words = [[rng.randrange(a.vocab) for _ in range(rng.randint(1, a.max_len))] for _ in range(a.words)]
    params = SamplingParams(max_tokens=8, bad_words_token_ids=words)
    as_sent, as_lists = pickle.dumps(params), pickle.dumps(words)
    if a.frozen:
        gc.collect()
        gc.freeze()
    received = pickle.loads(as_sent)

    def admit() -> None:
        p = pickle.loads(as_sent)
        p.verify_vocab(a.vocab)
        RequestMaskIds(p, (1,)).build(a.vocab)

    print(f"{a.words} words, vocabulary {a.vocab}, heap {'frozen' if a.frozen else 'not frozen'}; "
          f"ms, median of {a.repeat}")
    print(f"  unpickle params ({len(as_sent)} bytes):        {median_ms(lambda: pickle.loads(as_sent), a.repeat)}")
    print(f"  unpickle the words as lists ({len(as_lists)} bytes): {median_ms(lambda: pickle.loads(as_lists), a.repeat)}")
    print(f"  verify_vocab:                         {median_ms(lambda: received.verify_vocab(a.vocab), a.repeat)}")
    print(f"  index build:                          "
          f"{median_ms(lambda: RequestMaskIds(received, (1,)).build(a.vocab), a.repeat)}")
    print(f"  all three, as the core admits:        {median_ms(admit, a.repeat)}")


if __name__ == "__main__":
    main()
