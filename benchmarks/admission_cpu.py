"""What detent-serve's engine core spends admitting one request on its step thread (CPU).

The core admits requests between two steps (engine/core_process.py), so this time is a
pause of every running request. Per case, a hostile-but-legal request (many bad words,
a 64 KB JSON schema, a vocabulary's logit_bias, allowed ids or stop ids, many stop
strings, a long prompt) is made as the server makes it: SamplingParams checked on its
pool for the engine's vocabulary and EOS ids (`checked_params`) and the prompt's blocks
hashed there for its block size (`HashedPrompt`), timed as "pool", and pickled as the
pipe pickles them. Then, median of `--repeat` admissions: the message read
from a pipe as another process writes it ("pipe", as the core reads a server's), its
unpickling, `add_request`, and the inbox's drain into the scheduler (the start of the
next step), each and their sum.
The engine is the tests' tiny Llama (SmolLM2's 49,152-token vocabulary, models/tiny.py),
its context raised to `--max-model-len` for the long prompt; its startup heap frozen, as
the core's is. A schema's grammar is compiled before its admissions are timed (a hit in
the grammar cache); "json_schema_new" sends a new schema each time (a miss).

    python benchmarks/admission_cpu.py [--repeat 15] [--only bad_words,json_schema] [--json PATH]
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import pickle
import random
import statistics
import tempfile
import time
from multiprocessing.reduction import ForkingPickler

PARTS = ("pipe", "unpickle", "add_request", "drain")
MAX_N = 128  # detent-serve's --max-n default: samples of one request


def schema(tag: str = "", max_bytes: int = 63 * 1024) -> dict:
    """A legal JSON schema of about `max_bytes`: 1,000 properties (the limit), long descriptions."""
    from detent.sampling.grammar_limits import check_spec_size, GrammarLimits
    last, width = None, 1
    while True:
        props = {f"p{i}": {"type": "string", "description": f"{tag}{i}-" + "d" * width} for i in range(1000)}
        s = {"type": "object", "properties": props, "required": ["p0"], "additionalProperties": False}
        try:
            check_spec_size("json", s, GrammarLimits(max_spec_bytes=max_bytes))
        except ValueError:
            if last is None:
                raise ValueError(f"1,000 properties do not fit {max_bytes} bytes") from None
            return last
        last, width = s, width + 4


def cases(V: int, max_model_len: int, seed: int) -> dict:
    """name -> (what, prompt ids, a function of the repetition giving SamplingParams' fields)."""
    rng = random.Random(seed)
    words = [[rng.randrange(V) for _ in range(rng.randint(1, 5))] for _ in range(100_000)]
    big = schema()
    every = list(range(V))
    short = [rng.randrange(3, V) for _ in range(16)]
    long_prompt = [rng.randrange(3, V) for _ in range(max_model_len - 8)]
    stops = [f"stop string {i:05d}" for i in range(10_000)]
    return {
        "plain": ("16 prompt tokens, no options", short, lambda i: {}),
        "bad_words": ("100k words of 1-5 tokens", short, lambda i: {"bad_words_token_ids": words}),
        "json_schema": (f"{len(json.dumps(big)) // 1024} KB schema, compiled", short,
                        lambda i: {"structured_outputs": {"json": big}}),
        "json_schema_new": ("the same, a new one each time", short,
                            lambda i: {"structured_outputs": {"json": schema(f"r{i}-")}}),
        "logit_bias": (f"{V} ids", short, lambda i: {"logit_bias": dict.fromkeys(every, 1.0)}),
        "allowed_token_ids": (f"{V} ids", short, lambda i: {"allowed_token_ids": every}),
        "stop_token_ids": (f"{V - 100} ids, min_tokens=1", short,
                           lambda i: {"stop_token_ids": every[100:], "min_tokens": 1}),
        "stop": (f"{len(stops)} strings", short, lambda i: {"stop": stops}),
        "long_prompt": (f"{len(long_prompt)} prompt tokens", long_prompt, lambda i: {}),
        "long_prompt_n": (f"the same, n={MAX_N}", long_prompt, lambda i: {"n": MAX_N}),
        "json_schema_n": (f"the compiled schema, n={MAX_N}", short,
                          lambda i: {"structured_outputs": {"json": big}, "n": MAX_N}),
    }


def engine(path: str, max_model_len: int):
    """The tests' tiny Llama (models/tiny.py) written to `path`, its context raised to max_model_len."""
    from detent.engine import LLM
    from detent.models.tiny import write_tiny_llama
    write_tiny_llama(path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], max_model_len)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return LLM(model=path, device="cpu", max_model_len=max_model_len, max_num_seqs=8,
               max_queued_grammar_compiles=64).llm_engine


class Server:
    """A process that sends the core its messages down a pipe, as detent-serve does (CoreProcess.send):
    the core reads a message as it is written, on its step thread (core_process._loop)."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()

    def load(self, message: bytes) -> None:
        self.conn.send_bytes(message)

    def receive(self) -> tuple[bytes, float]:
        """The loaded message, sent again; seconds from its first bytes to its last."""
        self.conn.send_bytes(b"")
        self.conn.poll(None)
        t = time.perf_counter()
        data = self.conn.recv_bytes()
        return data, time.perf_counter() - t


def _serve(conn) -> None:
    message = b""
    try:
        while True:
            data = conn.recv_bytes()
            if data:
                message = data
            else:
                conn.send_bytes(message)
    except EOFError:
        pass


def admit(eng, server: Server) -> dict[str, float]:
    """One admission as the core makes it, seconds by part; the request withdrawn after."""
    message, pipe = server.receive()
    t0 = time.perf_counter()
    _, rid, ids, params = pickle.loads(message)
    t1 = time.perf_counter()
    eng.add_request(rid, ids, params)
    t2 = time.perf_counter()
    eng._drain_inbox()
    t3 = time.perf_counter()
    wait_for_grammar(eng, rid)
    eng.withdraw_requests([rid])
    return {"pipe": pipe, "unpickle": t1 - t0, "add_request": t2 - t1, "drain": t3 - t2}


_WAIT_FOR = set()  # request ids whose grammar is to be compiled before they leave (warm-ups)


def wait_for_grammar(eng, rid: str, timeout_s: float = 120.0) -> None:
    g = eng.outputs.children(rid)[0].grammar if rid in _WAIT_FOR else None
    if g is None:
        return
    deadline = time.monotonic() + timeout_s
    while not g.ready and g.error is None and time.monotonic() < deadline:  # ready polls the compile
        time.sleep(0.05)


def measure(eng, server: Server, what, prompt, fields, repeat: int) -> dict:
    from detent.engine import HashedPrompt, SamplingParams, checked_params
    limits = eng.limits()  # what the server knows of its engine
    row: dict = {"what": what}
    pool, parts = [], {p: [] for p in PARTS}
    totals = []
    for i in range(-1, repeat):  # -1: a warm-up (a schema's compile), not counted
        params = SamplingParams(max_tokens=8, **fields(max(i, 0)))
        t = time.perf_counter()
        checked_params(params, limits.vocab_size, limits.eos_token_ids)
        hashed = HashedPrompt.of(prompt, limits.block_size)  # as the server's pool does (Generation)
        pool.append(time.perf_counter() - t)
        rid = f"r{i}"
        message = bytes(ForkingPickler.dumps(("add", rid, hashed, params)))
        if i < 0:
            _WAIT_FOR.add(rid)
        server.load(message)
        got = admit(eng, server)
        if i >= 0:
            for p in PARTS:
                parts[p].append(got[p])
            totals.append(sum(got.values()))
        row["message_bytes"] = len(message)
    ms = lambda xs: round(statistics.median(xs) * 1e3, 2)  # noqa: E731
    row["pool_ms"] = ms(pool[1:])
    row.update({f"{p}_ms": ms(parts[p]) for p in PARTS})
    row["step_thread_ms"] = ms(totals)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="admission-tiny-") as path:
        eng = engine(path, a.max_model_len)
        try:
            run(eng, a)
        finally:
            eng.shutdown()
            gc.unfreeze()  # as the core does at exit (nanobind's extensions report what is alive then as leaks)


def run(eng, a: argparse.Namespace) -> None:
    all_cases = cases(eng.model_config.vocab_size, a.max_model_len, a.seed)
    names = [n for n in a.only.split(",") if n] or list(all_cases)
    gc.collect()
    gc.freeze()  # as the core does after startup (freeze_startup_heap)
    rows = {}
    server = Server()
    print(f"ms, median of {a.repeat}; step thread = pipe + unpickle + add_request + drain "
          "(a pause of every running request)")
    print(f"{'case':<18} {'what':<32} {'bytes':>9} {'pool':>8} {'pipe':>7} {'unpickle':>9} {'add_req':>8} "
          f"{'drain':>8} {'step thread':>12}")
    for name in names:
        what, prompt, fields = all_cases[name]
        r = rows[name] = measure(eng, server, what, prompt, fields, a.repeat)
        print(f"{name:<18} {what:<32} {r['message_bytes']:>9} {r['pool_ms']:>8} {r['pipe_ms']:>7} "
              f"{r['unpickle_ms']:>9} {r['add_request_ms']:>8} {r['drain_ms']:>8} {r['step_thread_ms']:>12}",
              flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"repeat": a.repeat, "max_model_len": a.max_model_len, "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
