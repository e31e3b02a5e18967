"""How long a job's process takes to end after its last line ("[done in ..."), one of the fixed costs around a job
that more GPUs do not shorten (issue 47): on a 2-core CPU machine 0.2 s; a GPU job's whole command line took ~1 s
more than its job and the time before it (forty-third session).

    python benchmarks/exit_time.py python -m napari_gpu_relion.cli class3d ...
"""

from __future__ import annotations

import subprocess
import sys
import time


def main() -> None:
    t0 = time.time()
    proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    done = None
    for line in proc.stdout:
        if line.startswith("[done"):
            done = time.time() - t0
    proc.wait()
    end = time.time() - t0
    after = f"{end - done:.2f} s" if done is not None else "no [done line"
    print(f"rc {proc.returncode}: the [done line at {done if done is None else round(done, 2)} s, the process ended "
          f"at {end:.2f} s; after the line: {after}")


if __name__ == "__main__":
    main()
