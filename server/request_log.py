"""`--request-log PATH`: one JSON line per finished engine request, written
off the event loop (docs/verify.md, "The request log").

Handlers call `RequestLog.submit(make)` with a function that builds the
record; it goes into a bounded queue without blocking. One writer thread
builds each record (turning the engine's logprob dicts into lists and JSON
costs time proportional to the tokens: not the event loop's) and writes it
as one line with unbuffered `write` calls, so what a crash leaves is every
line before the one being written. One thread writes, so lines never
interleave; the file is opened for appending, so a restarted server adds to
it (each start writes a "server" record first). A line a failed write cut
short is ended before the next one, so it costs that one record only.

Nothing here can fail a request. A full queue (the disk is slower than the
traffic for longer than `max_pending` records, or the records waiting hold
more than `max_pending_entries` tokens and logprob values: each holds its
request's outputs in memory until written) drops the record; a write
that raises (disk full, I/O error) loses its record; both are counted
(`dropped`, `failed`) and logged as errors, at most once every 10 s.
The lifespan's `close()` writes what is queued before the server exits.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import Any, Callable

log = logging.getLogger("detent.server.request_log")
_STOP = object()
ERROR_LOG_INTERVAL_S = 10.0


class RequestLog:
    def __init__(self, path: str, first: dict[str, Any], max_pending: int = 4096,
                 max_pending_entries: int = 1 << 22):
        self.path = path
        self._f = open(path, "ab", buffering=0)  # an unwritable path refuses startup, not a request
        self._torn = False  # the last write failed part-way: start the next record on a new line
        self._q: queue.Queue = queue.Queue(maxsize=max_pending)
        self.max_pending_entries = max_pending_entries
        self._entries = 0  # tokens + logprob values of the records queued (one record always fits)
        self._lock = threading.Lock()
        self.written = self.dropped = self.failed = 0
        self._last_error = -ERROR_LOG_INTERVAL_S
        self._q.put_nowait((lambda: first, 0))
        self._thread = threading.Thread(target=self._run, name="detent-request-log", daemon=True)
        self._thread.start()

    def submit(self, make: Callable[[], dict[str, Any]], entries: int = 0) -> None:
        """Queue a record (built later, on the writer thread) that holds about `entries`
        tokens and logprob values; never blocks, never raises."""
        with self._lock:
            fits = self._entries == 0 or self._entries + entries <= self.max_pending_entries
            if fits:
                try:
                    self._q.put_nowait((make, entries))
                    self._entries += entries
                except queue.Full:
                    fits = False
        if not fits:
            self.dropped += 1
            self._error("request log queue full (%d records, %d logprob entries waiting): dropped a record "
                        "(%d dropped so far); the disk under %s is slower than the traffic", self._q.qsize(),
                        self._entries, self.dropped, self.path)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then stop."""
        try:
            self._q.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        try:
            self._f.close()
        except OSError as e:
            self._error("request log %s: closing failed: %s", self.path, e)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            make, entries = item
            self._write(make)
            with self._lock:
                self._entries -= entries

    def _write(self, make: Callable[[], dict[str, Any]]) -> None:
        try:
            line = (json.dumps(make(), separators=(",", ":")) + "\n").encode()  # ASCII (ensure_ascii): any str encodes
        except Exception as e:  # noqa: BLE001 - a record that cannot be built is lost, the server goes on
            self.failed += 1
            self._error("request log: a record could not be built: %s: %s", type(e).__name__, e)
            return
        data = memoryview(b"\n" + line if self._torn else line)
        try:
            while data:
                data = data[self._f.write(data):]
            self.written += 1
            self._torn = False
        except OSError as e:
            self._torn = True
            self.failed += 1
            self._error("request log %s: write failed (%d records lost so far): %s", self.path, self.failed, e)

    def _error(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last_error >= ERROR_LOG_INTERVAL_S:
            self._last_error = now
            log.error(msg, *args)
