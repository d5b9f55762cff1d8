"""The periodic stats line `vllm serve` prints, from the server's own metrics.

Every `DETENT_LOG_STATS_INTERVAL` seconds (10 by default, as vLLM's
`VLLM_LOG_STATS_INTERVAL`), while the server has had work: prompt and
generation throughput over the interval, running and waiting requests, KV
usage and the prefix-cache hit rate. `--disable-log-stats` turns it off."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from detent.server.metrics import kv_usage, stat

log = logging.getLogger("detent.server.stats")


def interval_s() -> float:
    raw = os.environ.get("DETENT_LOG_STATS_INTERVAL", "10")
    try:
        v = float(raw)
    except ValueError:
        raise ValueError(f"DETENT_LOG_STATS_INTERVAL must be a number of seconds, got {raw!r}") from None
    if not v > 0:
        raise ValueError(f"DETENT_LOG_STATS_INTERVAL must be > 0, got {raw!r}")
    return v


def stats_line(prompt_tps: float, gen_tps: float, stats: dict[str, Any]) -> str:
    return (f"Avg prompt throughput: {prompt_tps:.1f} tokens/s, Avg generation throughput: {gen_tps:.1f} tokens/s, "
            f"Running: {int(stat(stats, 'num_running'))} reqs, "
            f"Waiting: {int(stat(stats, 'num_waiting') + stat(stats, 'num_pending'))} reqs, "
            f"KV cache usage: {100 * kv_usage(stats):.1f}%, "
            f"Prefix cache hit rate: {100 * stat(stats, 'prefix_cache_hit_rate'):.1f}%")


async def log_stats_forever(metrics: Any, engine: Any, every_s: float) -> None:
    """Runs on the event loop until cancelled (the app's lifespan)."""
    def totals() -> tuple[float, float]:
        return metrics.token_totals()

    (p0, g0), t0 = totals(), time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        (p1, g1), t1 = totals(), time.monotonic()
        stats = engine.stats()
        busy = p1 > p0 or g1 > g0 or stat(stats, "num_running") or stat(stats, "num_waiting")
        if busy:
            log.info(stats_line((p1 - p0) / (t1 - t0), (g1 - g0) / (t1 - t0), stats))
        (p0, g0), t0 = (p1, g1), t1
