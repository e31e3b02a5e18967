"""Bad input on one MPI rank only (issue 50, item 1): every rank ends, within seconds, with one line naming the rank.

A rank that fails its start-up checks (a node without the data disk, a reference missing there, an option only it
was given wrongly) used to print its error and exit alone, before MPI_Init, while the other ranks waited for it
forever. The jobs are run as ``mpiexec -n 1 -wdir A ... : -n 1 -wdir B ...`` (MPMD: each rank its own working
folder, as two nodes that see different disks) on a tiny simulated set. Skipped, with the reason, when mpi4py or
mpiexec is missing (``pip install -e ".[mpi]"`` installs both).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi_cases import mpi_missing, mpiexec, rank_env

from napari_gpu_relion.jobs.simulate import make_sample_data
from napari_gpu_relion.runtime import distributed

HOST = socket.gethostname()
#: Every rank must have ended by then (the ranks end within ~2 s on a laptop; a hang runs into the timeout).
LIMIT_S = 20.0


pytestmark = pytest.mark.skipif(mpi_missing() is not None, reason=str(mpi_missing()))


def _ranks(*ranks: tuple[Path, list[str]]) -> tuple[subprocess.CompletedProcess, float]:
    """Run one rank per (working folder, arguments) under one mpiexec; (the result, seconds until all ended)."""
    cmd = [mpiexec()]
    for i, (wdir, args) in enumerate(ranks):
        cmd += ([":"] if i else []) + ["-n", "1", "-wdir", str(wdir), sys.executable, "-m", "napari_gpu_relion.cli",
                                       *map(str, args)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=rank_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=3 * LIMIT_S)
    except subprocess.TimeoutExpired:  # a hang: end mpiexec and every rank (its process group), then fail
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the ranks still ran after {3 * LIMIT_S:.0f} s (killed):\n{(out + err)[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.monotonic() - t0


def _ended_with_one_line(r: subprocess.CompletedProcess, elapsed: float, *parts: str) -> str:
    """Every rank ended in time, with a non-zero exit, no traceback, and one error line holding ``parts``."""
    text = r.stdout + r.stderr
    assert elapsed < LIMIT_S, (elapsed, text[-2000:])
    assert r.returncode != 0, text[-2000:]
    assert "Traceback" not in text, text[-3000:]
    lines = [ln for ln in text.splitlines() if ln.startswith("napari-gpu-relion ") and " error: " in ln]
    assert len(lines) == 1, text[-2000:]
    assert all(p in lines[0] for p in parts), (parts, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """The data folder (40 particles, box 32, a reference) and, next to it, what other nodes see."""
    root = tmp_path_factory.mktemp("badmpi")
    make_sample_data(root / "W/in", box=32, n_particles=40, n_micrographs=0)
    return root / "W"


def _node(data: Path, name: str, *shared: str) -> Path:
    """A node's working folder that sees ``shared`` (paths under in/) of the data folder and nothing else."""
    node = data / name
    (node / "in").mkdir(parents=True, exist_ok=True)
    for s in shared:
        if not (node / "in" / s).exists():
            (node / "in" / s).symlink_to(data / "in" / s)
    return node


def test_a_rank_without_the_particles_ends_every_rank(data):
    """The issue's case: rank 1's node lacks the data disk (--i does not exist there); rank 0 used to spin."""
    node = _node(data, "node_empty")
    args = ["class2d", "--i", "in/particles.star", "--o", data / "out/c2/run", "--K", "4", "--iter", "1", "--cpu"]
    r, elapsed = _ranks((data, args), (node, args))
    line = _ended_with_one_line(r, elapsed, f"rank 1 of 2 on {HOST}", "in/particles.star", "does not exist")
    assert line.startswith("napari-gpu-relion class2d: error: ")
    assert r.returncode == 2
    assert not (data / "out/c2").exists()  # no rank started the job


def test_a_rank_without_the_reference_ends_every_rank(data):
    """class3d: rank 1 sees the particles but not --ref."""
    node = _node(data, "node_noref", "particles.star", "particles")
    args = ["class3d", "--i", "in/particles.star", "--ref", "in/reference.mrc", "--o", data / "out/c3/run", "--K",
            "2", "--iter", "1", "--cpu"]
    r, elapsed = _ranks((data, args), (node, args))
    _ended_with_one_line(r, elapsed, f"rank 1 of 2 on {HOST}", "in/reference.mrc", "--ref")
    assert r.returncode == 2


def test_an_option_only_one_rank_has_wrong_ends_every_rank(data):
    """A value that only rank 1 was given (an MPMD line with a typo): its one-line argparse error, every rank ends."""
    args = ["class2d", "--i", "in/particles.star", "--o", data / "out/k/run", "--K", "4", "--iter", "1", "--cpu"]
    bad = [("four" if a == "4" else a) for a in args]
    r, elapsed = _ranks((data, args), (data, bad))
    _ended_with_one_line(r, elapsed, f"rank 1 of 2 on {HOST}", "--K", "'four'")
    assert r.returncode == 2


def test_a_file_that_only_one_rank_reads_wrong_ends_every_rank(data):
    """Rank 1 sees a damaged particles STAR (found when the job reads it, after the start-up checks): it aborts
    every rank (MPI_Abort), naming itself and the file."""
    node = _node(data, "node_damaged", "particles", "reference.mrc")
    (node / "in/particles.star").write_text("data_\nloop_\n_rlnImageName #1\nnot a star row\n")
    args = ["class3d", "--i", "in/particles.star", "--ref", "in/reference.mrc", "--o", data / "out/d/run", "--K",
            "2", "--iter", "1", "--cpu"]
    r, elapsed = _ranks((data, args), (node, args))
    _ended_with_one_line(r, elapsed, f"rank 1 of 2 on {HOST}", "in/particles.star")


def test_when_every_rank_fails_one_line_says_how_many(data):
    """A typo that every rank sees: one line (rank 0's), not one per rank, saying that both failed."""
    node = _node(data, "node_empty")
    args = ["class2d", "--i", "in/particle.star", "--o", data / "out/t/run", "--K", "4", "--iter", "1", "--cpu"]
    r, elapsed = _ranks((data, args), (node, args))
    _ended_with_one_line(r, elapsed, f"rank 0 of 2 on {HOST}", "in/particle.star", "2 of 2 ranks failed")


def test_start_up_without_mpi_prints_the_line_and_returns_its_code(capsys):
    assert distributed.start_up(None) == 0
    assert distributed.start_up(("napari-gpu-relion x: error: bad", 2)) == 2
    assert capsys.readouterr().err == "napari-gpu-relion x: error: bad\n"
