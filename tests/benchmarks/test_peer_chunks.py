"""benchmarks/peer_chunks.py: every chunk fits its limit, and the pieces rejoin to the same bytes."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import peer_chunks  # noqa: E402


def test_chunks_fit_and_rejoin(tmp_path):
    peer = tmp_path / ".peer"
    sizes = {"c1/vllm.whl.part00": 900, "c1/a.whl": 300, "c2/vllm.whl.part01": 700, "c2/b.whl": 120,
             "c3/install-on-device.sh": 40}
    for i, (name, n) in enumerate(sizes.items()):
        (peer / os.path.dirname(name)).mkdir(parents=True, exist_ok=True)
        (peer / name).write_bytes(bytes((i * 7 + j) % 251 for j in range(n)))
    files = sorted((str(peer / n), n_) for n, n_ in sizes.items())
    chunks = peer_chunks.plan(files, limit=500)
    assert all(sum(p[3] for p in c) <= 500 for c in chunks)
    out = tmp_path / "out"
    peer_chunks.write(chunks, str(out))
    got = {}
    for d in sorted(os.listdir(out)):
        for f in os.listdir(out / d):
            got[f] = (out / d / f).read_bytes()
    for name in list(got):  # the device's join: NAME.h0 + NAME.h1 -> NAME
        if name.endswith(".h0"):
            got[name[:-3]] = got.pop(name) + got.pop(name[:-3] + ".h1")
    assert got == {os.path.basename(n): (peer / n).read_bytes() for n in sizes}
    assert {"vllm.whl.part00.h0", "vllm.whl.part01.h1"} <= {p[0] for c in chunks for p in c}  # 900, 700 > 250
    with pytest.raises(SystemExit, match="two chunks"):
        peer_chunks.plan([(str(peer / "c1/vllm.whl.part00"), 900)], limit=400)
