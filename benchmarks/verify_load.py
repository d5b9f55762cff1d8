"""Concurrent requests for `detent verify` (issue 20): N completions sent at once
to a `detent-serve --request-log LOG`, so that every logged request ran in a
batch with others; `detent verify LOG --model M` then re-executes them.

Prompts are token ids below --vocab (lengths 8 to 600), half greedy and half
seeded at temperature 1 (a third of those without a client seed: the server
draws one and logs it), logprobs 5, 16 to 96 output tokens, ignore_eos.
Standard library only (threads), so it runs on a bare machine.

    python3 benchmarks/verify_load.py --url http://127.0.0.1:8000 -n 100
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import sys
import time
import urllib.request


def body(i: int, rng: random.Random, vocab: int, model: str) -> dict:
    n = rng.choice((8, 40, 130, 300, 600))
    b = {"model": model, "prompt": [rng.randrange(10, vocab) for _ in range(n)],
         "max_tokens": rng.choice((16, 48, 96)), "logprobs": 5, "ignore_eos": True}
    if i % 2:
        b["temperature"] = 1.0
        if i % 3:
            b["seed"] = 1000 + i
    else:
        b["temperature"] = 0.0
    return b


def post(url: str, b: dict, key: str | None) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(b).encode(),
                                 headers={"content-type": "application/json",
                                          **({"authorization": f"Bearer {key}"} if key else {})})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("-n", type=int, default=100)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--model", default=None, help="served model name (default: the server's first)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    model = a.model
    if model is None:
        with urllib.request.urlopen(a.url + "/v1/models", timeout=30) as r:
            model = json.loads(r.read())["data"][0]["id"]
    rng = random.Random(a.seed)
    bodies = [body(i, rng, a.vocab, model) for i in range(a.n)]
    t = time.perf_counter()
    with cf.ThreadPoolExecutor(a.n) as ex:
        outs = list(ex.map(lambda b: post(a.url, b, a.api_key), bodies))
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    print(json.dumps({"requests": len(outs), "completion_tokens": tokens,
                      "seconds": round(time.perf_counter() - t, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
