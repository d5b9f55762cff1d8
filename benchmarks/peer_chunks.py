"""Re-cut the vLLM peer's wheel chunks so that each fits one device call beside this tree.

The peer's `build.sh` cuts its wheels into 60 MB chunks (`.peer/c1` ...). A device call
carries the tracked tree too, within 64 MiB in all, and the tree has grown past 4 MB
(10.9 MB at lease 14), so a 60 MB chunk no longer travels. This packs the same files
into chunks of at most `64 MiB - tree - margin`, halving any file larger than half a
chunk (`NAME.h0`, `NAME.h1`), and prints the device commands:

    python3 benchmarks/peer_chunks.py --peer .peer --out .peer2
    # each call k: carry [".peer2/pk"], command: mkdir -p /tmp/vx && cp .peer2/pk/* /tmp/vx/
    # then, once, on the device: the join command it prints, and /tmp/vx/install-on-device.sh
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess

CALL_LIMIT = 64 << 20  # what one device call carries: the tree, untracked files and the carried paths


def tree_bytes(repo: str) -> int:
    """Bytes of the files git tracks or leaves unignored (what every call sends)."""
    out = subprocess.run(["git", "-C", repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         check=True, capture_output=True).stdout
    return sum(os.path.getsize(os.path.join(repo, p)) for p in out.decode().split("\0")
               if p and os.path.isfile(os.path.join(repo, p)))


def plan(files: list[tuple[str, int]], limit: int) -> list[list[tuple[str, str, int, int]]]:
    """Chunks of (name, source, offset, size) pieces, each chunk at most `limit` bytes; a file
    over half a chunk is cut in two halves, which then pack beside smaller files."""
    pieces = []
    for path, size in files:
        name = os.path.basename(path)
        if size > limit // 2:
            if size > 2 * limit:
                raise SystemExit(f"{name} ({size} bytes) is over two chunks of {limit}: cut it more finely")
            h = size // 2
            pieces += [(f"{name}.h0", path, 0, h), (f"{name}.h1", path, h, size - h)]
        else:
            pieces.append((name, path, 0, size))
    chunks: list[list] = []
    for piece in sorted(pieces, key=lambda p: -p[3]):  # first fit, largest first
        for c in chunks:
            if sum(p[3] for p in c) + piece[3] <= limit:
                c.append(piece)
                break
        else:
            chunks.append([piece])
    return chunks


def write(chunks, out: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    for i, chunk in enumerate(chunks, 1):
        d = os.path.join(out, f"p{i}")
        os.makedirs(d)
        for name, src, off, size in chunk:
            with open(src, "rb") as f, open(os.path.join(d, name), "wb") as g:
                f.seek(off)
                g.write(f.read(size))


JOIN = 'cd /tmp/vx && for f in *.h0; do [ -e "$f" ] || continue; b=${f%.h0}; cat "$b.h0" "$b.h1" > "$b" && rm "$b.h0" "$b.h1"; done'


def main(argv=None) -> None:
    ap = argparse.ArgumentParser("peer_chunks")
    ap.add_argument("--peer", default=".peer")
    ap.add_argument("--out", default=".peer2")
    ap.add_argument("--margin-mb", type=float, default=1.0, help="room left in each call")
    a = ap.parse_args(argv)
    files = sorted((os.path.join(r, f), os.path.getsize(os.path.join(r, f)))
                   for r, _, fs in os.walk(a.peer) if os.path.basename(r).startswith("c") for f in fs)
    if not files:
        raise SystemExit(f"no chunk under {a.peer}: run the vLLM peer's build.sh first")
    tree = tree_bytes(".")
    limit = CALL_LIMIT - tree - int(a.margin_mb * 2**20)
    chunks = plan(files, limit)
    write(chunks, a.out)
    print(f"tree {tree / 1e6:.1f} MB: {len(chunks)} chunks of <= {limit / 1e6:.1f} MB in {a.out}")
    print("device, once all are copied:", JOIN + " && bash /tmp/vx/install-on-device.sh")


if __name__ == "__main__":
    main()
