"""vLLM's load generator (`vllm bench serve`) in one long-lived process, for
benchmarks/serve_load.py: each call through the CLI spent 19-26 s beyond its load
(lease 9, `wall_s` against `duration`), most of it importing vLLM. `BenchWorker`
imports `vllm.benchmarks.serve` once and calls its `main` (what `vllm bench serve`
calls) for each load's arguments.
"""
from __future__ import annotations

import json
import subprocess
import sys

BENCH_MODULE = "vllm.benchmarks.serve"  # its add_cli_args(parser) and main(args), as `vllm bench serve` calls
WORKER = r"""
import argparse, json, os, sys
out = os.fdopen(os.dup(1), "w")  # the replies' own channel; then fd 1 (print, logging, C code) goes to the log
os.dup2(2, 1)
from {module} import add_cli_args, main
try:  # the parser class `vllm bench` builds its arguments on, where this vLLM has it
    from vllm.utils.argparse_utils import FlexibleArgumentParser as Parser
except ImportError:
    try:
        from vllm.utils import FlexibleArgumentParser as Parser
    except ImportError:
        Parser = argparse.ArgumentParser
for line in sys.stdin:
    try:
        p = Parser()
        add_cli_args(p)
        main(p.parse_args(json.loads(line)))
        reply = {{"ok": True}}
    except BaseException as e:  # argparse's SystemExit too: report it, keep serving
        reply = {{"ok": False, "error": f"{{type(e).__name__}}: {{e}}"}}
    out.write(json.dumps(reply) + "\n")
    out.flush()
"""


class BenchWorker:
    """One process that imports the load generator once and runs each load's arguments."""

    def __init__(self, env: dict | None, log_path: str, module: str = BENCH_MODULE):
        self.log = open(log_path, "a")
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER.format(module=module)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env, text=True)

    def run(self, argv: list[str]) -> None:
        """Run `vllm bench serve ARGV`; raises RuntimeError if it failed or the worker is gone."""
        if self.dead():
            raise RuntimeError(f"bench worker exited ({self.proc.returncode})")
        try:
            self.proc.stdin.write(json.dumps(argv) + "\n")
            self.proc.stdin.flush()
        except OSError as e:  # it died since the check
            raise RuntimeError(f"bench worker exited ({e})") from e
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench worker exited ({self.proc.wait()})")
        try:
            reply = json.loads(line)
        except ValueError as e:
            raise RuntimeError(f"bench worker: not a reply: {line[:200]!r}") from e
        if not reply["ok"]:
            raise RuntimeError(reply["error"])

    def dead(self) -> bool:
        """Whether the process has exited (an import that failed ends it at once)."""
        return self.proc.poll() is not None

    def close(self) -> None:
        if not self.dead():
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
