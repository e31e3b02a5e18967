"""Where the local-resolution job's time goes (issue 51): the job's command line run in this process, first once
(compiling, plans), then again with synchronised timers around its steps (reading, the half maps' set-up, the phase
randomisation, each batch of windows and, inside them, masks, forward and inverse FFTs, shell sums; the maps' and
the FSC STAR's writing). Nested timers: a step's time includes the steps timed inside it.

Run (GPU machine): python benchmarks/profile_locres.py --out results/x.json -- local_resolution --locres --i h1.mrc
    --i2 h2.mrc --o out/relion --mask mask.mrc
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from profile_job import COUNTS, TIMES, wrap  # benchmarks/profile_job.py: the synchronised timers

from napari_gpu_relion import cli
from napari_gpu_relion.compute import local_resolution as LR
from napari_gpu_relion.jobs import local_resolution as job
from napari_gpu_relion.runtime.device import select_backend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("argv", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    argv = [x for x in a.argv if x != "--"]
    t = time.perf_counter()
    assert cli.main(argv) == 0
    first = time.perf_counter() - t
    be = select_backend("--cpu" in argv)
    for owner, name, label in ((job, "load_half_maps", "read half maps and mask"),
                               (LR.LocalResolution, "__init__", "set-up (half maps, unmasked FSC, randomised)"),
                               (LR, "randomize_phases", "  phase randomisation"),
                               (LR.LocalResolution, "add_windows", "windows (batches)"),
                               (LR, "window_masks", "  window masks"),
                               (LR, "_fsc_sums", "  windowed FSC sums (2 forward FFTs + 3 shell sums)"),
                               (LR, "rfft_centered", "    forward FFTs"),
                               (LR, "shell_sum", "    shell sums"),
                               (LR, "irfft_centered", "  inverse FFTs (filtered maps)"),
                               (LR.LocalResolution, "result", "result maps to the host"),
                               (job, "write_mrc", "write maps"),
                               (job, "write_star_blocks", "write FSC STAR")):
        wrap(owner, name, be, label)
    t = time.perf_counter()
    assert cli.main(argv) == 0
    total = time.perf_counter() - t
    rows = {k: {"s": round(v, 4), "calls": COUNTS[k]} for k, v in TIMES.items()}
    res = {"argv": argv, "first_s": first, "timed_s": total, "steps": rows}
    try:
        import cupy  # noqa: PLC0415

        res["gpu"] = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    except Exception:  # noqa: BLE001
        res["gpu"] = "CPU"
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
