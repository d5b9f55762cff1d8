"""The request log's writer (server/request_log.py) without a server: lines
never interleave under concurrent submits, submit never blocks or raises, and
a failing disk or a failing record loses that record only."""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

from detent.server.request_log import RequestLog

FIRST = {"type": "server"}


def _lines(path) -> list[str]:
    with open(path) as f:
        return f.read().split("\n")


def test_concurrent_submits_give_whole_lines(tmp_path):
    path = tmp_path / "log.jsonl"
    log = RequestLog(str(path), FIRST, max_pending=100_000)
    payload = "x" * 5000  # lines longer than any pipe or buffer atom

    def submit(t: int) -> None:
        for i in range(300):
            log.submit(lambda t=t, i=i: {"t": t, "i": i, "pad": payload})
    threads = [threading.Thread(target=submit, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    log.close()
    lines = _lines(path)
    assert lines[-1] == ""  # every line ends with a newline
    objs = [json.loads(x) for x in lines[:-1]]
    assert objs[0] == FIRST
    assert sorted((o["t"], o["i"]) for o in objs[1:]) == [(t, i) for t in range(8) for i in range(300)]
    assert log.written == 2401 and log.dropped == log.failed == 0


def test_a_full_queue_drops_without_blocking(tmp_path, caplog):
    release = threading.Event()
    log = RequestLog(str(tmp_path / "log.jsonl"), FIRST, max_pending=2)
    log.submit(lambda: (release.wait(10), {"slow": True})[1])  # the writer waits here
    time.sleep(0.2)
    t0 = time.monotonic()
    for i in range(10):
        log.submit(lambda i=i: {"i": i})
    assert time.monotonic() - t0 < 0.5  # submit never waits for the disk
    assert log.dropped >= 7
    assert "request log queue full" in caplog.text
    release.set()
    log.close()
    objs = [json.loads(x) for x in _lines(tmp_path / "log.jsonl") if x]
    assert objs[:2] == [FIRST, {"slow": True}] and len(objs) == log.written == 12 - log.dropped


def test_a_record_that_cannot_be_built_is_the_only_one_lost(tmp_path):
    log = RequestLog(str(tmp_path / "log.jsonl"), FIRST)
    log.submit(lambda: {"a": 1})
    log.submit(lambda: 1 / 0)
    log.submit(lambda: {"b": object()})  # not JSON
    log.submit(lambda: {"c": "\ud800"})  # a lone surrogate: escaped, still a line
    log.close()
    objs = [json.loads(x) for x in _lines(tmp_path / "log.jsonl") if x]
    assert objs == [FIRST, {"a": 1}, {"c": "\ud800"}] and log.failed == 2


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_full_disk_raises_nothing(caplog):
    log = RequestLog("/dev/full", FIRST)
    for i in range(5):
        log.submit(lambda i=i: {"i": i})
    log.close()
    assert log.failed == 6 and log.written == 0
    assert "write failed" in caplog.text


class _TearsOnce:
    """A file whose second write stores half its bytes, then fails."""

    def __init__(self, f):
        self.f, self.calls = f, 0

    def write(self, data) -> int:
        self.calls += 1
        if self.calls == 2:
            self.f.write(bytes(data[: len(data) // 2]))
            raise OSError(28, "No space left on device")
        return self.f.write(data)

    def close(self) -> None:
        self.f.close()


def test_a_torn_line_costs_one_record(tmp_path):
    path = tmp_path / "log.jsonl"
    log = RequestLog(str(path), FIRST)
    log.close()
    log = RequestLog(str(path), {"type": "server", "again": True})  # a restart appends
    deadline = time.monotonic() + 10
    while log.written < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    log._f = _TearsOnce(log._f)
    for i in range(3):
        log.submit(lambda i=i: {"i": i})
    log.close()
    lines = [x for x in _lines(path) if x]
    assert json.loads(lines[0]) == FIRST and json.loads(lines[1])["again"]
    assert json.loads(lines[2]) == {"i": 0}
    with pytest.raises(ValueError):
        json.loads(lines[3])  # the torn one
    assert json.loads(lines[4]) == {"i": 2} and log.failed == 1


def test_records_waiting_are_bounded_by_their_size(tmp_path):
    """Each queued record holds its outputs in memory: past max_pending_entries they are dropped,
    but one record alone always fits, whatever its size."""
    release = threading.Event()
    log = RequestLog(str(tmp_path / "log.jsonl"), FIRST, max_pending_entries=100)
    deadline = time.monotonic() + 10
    while log.written < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    log.submit(lambda: (release.wait(10), {"big": 1})[1], entries=1000)  # alone: accepted
    log.submit(lambda: {"small": 1}, entries=10)  # 1000 + 10 > 100: dropped
    assert log.dropped == 1
    release.set()
    log.close()
    assert [json.loads(x) for x in _lines(tmp_path / "log.jsonl") if x] == [FIRST, {"big": 1}]
    assert log._entries == 0
