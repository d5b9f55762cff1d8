"""lease 9: where a mixed step's host forward time goes (whole-step graphs on), offline."""
import cProfile, pstats, io, time, random, sys, collections
import torch
from detent.engine.llm import LLM
from detent.sampling.params import SamplingParams

llm = LLM(model="/tmp/wl8b", load_format="dummy", dtype="bfloat16", max_model_len=4096,
          mixed_graph_max_tokens=int(sys.argv[1]) if len(sys.argv) > 1 else 2048, gpu_memory_utilization=0.85)
eng = llm.llm_engine
r = eng.runner
inner = r._forward
rec = collections.defaultdict(list)
prof = cProfile.Profile()
SYNC = [False]

def fwd(ids, pos, ctx):
    if SYNC[0]:
        torch.cuda.synchronize()
    mixed = not (ctx.attn.max_seqlen_q == 1)
    t0 = time.perf_counter()
    if mixed:
        prof.enable()
    out = inner(ids, pos, ctx)
    if mixed:
        prof.disable()
    rec[(SYNC[0], r.forward_path, mixed)].append(time.perf_counter() - t0)
    return out
r._forward = fwd
rng = random.Random(0)
sp = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0)
n = 0
for phase in (False, True):
    SYNC[0] = phase
    for k in range(24):
        eng.add_request(f"w{phase}{k}", [rng.randrange(10, 128000) for _ in range(rng.randrange(600, 1024))], sp); n += 1
    steps = 0
    while eng.has_unfinished_requests():
        eng.step(); steps += 1
        if steps % 5 == 0 and steps < 200:
            eng.add_request(f"a{phase}{steps}", [rng.randrange(10, 128000) for _ in range(rng.randrange(200, 1024))], sp)
    if not phase:
        s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22); print(s.getvalue()[-5000:])
        s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(18); print(s.getvalue()[-4000:])
for k, v in sorted(rec.items(), key=str):
    print("sync_before" if k[0] else "async", k[1], "mixed" if k[2] else "decode", len(v),
          f"mean {1e3 * sum(v) / len(v):.2f} ms  median {1e3 * sorted(v)[len(v) // 2]:.2f} ms")
print({k: tuple(round(x, 3) if isinstance(x, float) else x for x in v) for k, v in eng.stats()["steps_by_kind"].items()})
