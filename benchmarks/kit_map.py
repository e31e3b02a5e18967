"""Pack and unpack a float32 MRC map for the GPU call's 64 MiB limit, losslessly.

A density map's float32 mantissas barely compress (gzip: 28.3 -> 26.4 MB for EMD-11007's 192^3 copy); grouping
each value's four bytes into four planes lets gzip find the exponent bytes' redundancy (23.6 MB). The packed file is
gzip(1024-byte header + the four byte planes); an MRC with an extended header is refused.

Run: python benchmarks/kit_map.py pack MAP.mrc MAP.mrc.planes.gz
     python benchmarks/kit_map.py unpack MAP.mrc.planes.gz MAP.mrc
"""

from __future__ import annotations

import gzip
import os
import sys

import numpy as np

HEADER = 1024


def pack(raw: bytes) -> bytes:
    """gzip of the header and the data's four byte planes."""
    nsymbt = int(np.frombuffer(raw[92:96], "<i4")[0])
    mode = int(np.frombuffer(raw[12:16], "<i4")[0])
    if nsymbt != 0 or mode != 2 or (len(raw) - HEADER) % 4:
        raise SystemExit(f"kit_map: only float32 MRC without an extended header (mode {mode}, nsymbt {nsymbt})")
    planes = np.frombuffer(raw[HEADER:], np.uint8).reshape(-1, 4).T
    return gzip.compress(raw[:HEADER] + planes.tobytes(), 9)


def unpack(packed: bytes) -> bytes:
    """The MRC file pack() was given."""
    raw = gzip.decompress(packed)
    planes = np.frombuffer(raw[HEADER:], np.uint8).reshape(4, -1)
    return raw[:HEADER] + planes.T.tobytes()


if __name__ == "__main__":
    what, src, dst = sys.argv[1:4]
    data = open(src, "rb").read()
    out = pack(data) if what == "pack" else unpack(data)
    with open(dst + ".part", "wb") as f:
        f.write(out)
    os.replace(dst + ".part", dst)
