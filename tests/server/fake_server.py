"""TEST DOUBLE launcher: `detent-serve`'s serving path (cli.serve, the app,
AsyncEngine) over the fake engine of fake_engine.py, in its own process."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fake_engine import FakeEngine  # noqa: E402

from detent.server.async_engine import AsyncEngine  # noqa: E402
from detent.server.cli import parse_args, serve  # noqa: E402
from detent.server.serving import ServerState  # noqa: E402

if __name__ == "__main__":
    a = parse_args(sys.argv[1:])
    eng = FakeEngine(max_num_seqs=a.max_num_seqs or 8, max_model_len=a.max_model_len or 512)
    state = ServerState(engine=AsyncEngine(eng, max_queue_len=a.max_queue_len), tokenizer=eng.tok,
                        served_model_names=a.served_model_name or ["fake"], model_root="fake",
                        max_model_len=eng.max_model_len, vocab_size=eng.vocab_size, tuple_hash="t" * 64,
                        deployment_hash="d" * 64, api_key=a.api_key, max_request_bytes=a.max_request_bytes)
    serve(state, a.host, a.port, a.log_level, a.graceful_timeout)
    print("detent-serve: stopped", file=sys.stderr, flush=True)
