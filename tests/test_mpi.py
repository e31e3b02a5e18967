"""MPI scale-out (issue 19): the jobs run under ``mpiexec -n N`` give the results of one process.

The communicator's plumbing (launcher detection, RELION's --gpu syntax, shares) is checked without MPI; the jobs
are run as ``mpiexec -n 2|3 python -m napari_gpu_relion.cli ...`` subprocesses on a tiny simulated set (box 32,
160 particles, two micrographs) and compared with one process. Those tests are skipped, with the reason, when
mpi4py or mpiexec is missing (``pip install -e ".[mpi]"`` installs both).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import mrcfile
import numpy as np
import pytest
import starfile
from mpi_cases import mpi_missing, mpiexec, rank_env

from napari_gpu_relion import cli
from napari_gpu_relion.compute.backend import gpu_available
from napari_gpu_relion.compute.estep import EStepSums
from napari_gpu_relion.compute.geometry import angular_distance_deg, euler_to_matrix
from napari_gpu_relion.io.star import read_coordinates
from napari_gpu_relion.jobs.simulate import make_sample_data
from napari_gpu_relion.runtime import device, distributed

ANG = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")


needs_mpi = pytest.mark.skipif(mpi_missing() is not None, reason=str(mpi_missing()))


def _mpirun(ranks: int, args: list[str], cwd: Path, timeout: float = 120,
            python: list[str] | None = None) -> subprocess.CompletedProcess:
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, *(python or ["-m", "napari_gpu_relion.cli"]), *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=rank_env(), capture_output=True, text=True, timeout=timeout)


def _ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    return r.stdout


def _one_process(args: list[str], cwd: Path) -> None:
    old = Path.cwd()
    os.chdir(cwd)
    try:
        assert cli.main([str(a) for a in args]) == 0
    finally:
        os.chdir(old)


def _same(a_star: Path, b_star: Path) -> tuple[float, float]:
    """Fractions of particles with the same orientation (< 0.01°) and the same class."""
    a, b = starfile.read(a_star)["particles"], starfile.read(b_star)["particles"]
    A = euler_to_matrix(*(a[c].to_numpy() for c in ANG))
    B = euler_to_matrix(*(b[c].to_numpy() for c in ANG))
    same_angle = float((angular_distance_deg(A, B) < 0.01).mean())
    return same_angle, float((a["rlnClassNumber"].to_numpy() == b["rlnClassNumber"].to_numpy()).mean())


def _resolution(model_star: Path) -> float:
    return float(starfile.read(model_star)["model_general"]["rlnCurrentResolution"])


def _close_maps(a: Path, b: Path, tol: float = 1e-3) -> None:
    x, y = mrcfile.read(a).astype(np.float64), mrcfile.read(b).astype(np.float64)
    assert x.shape == y.shape
    assert np.abs(x - y).max() <= tol * x.std(), (a, np.abs(x - y).max(), x.std())


# ----------------------------------------------------------------------------------------------------------
# Without MPI: detection, --gpu syntax, shares, the E-step sums all accounted for
# ----------------------------------------------------------------------------------------------------------


def test_mpi_is_detected_only_under_a_launcher():
    assert not distributed.launched_by_mpi({})
    assert not distributed.launched_by_mpi({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"})  # sbatch, no srun -n
    assert distributed.launched_by_mpi({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4"})
    for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        assert distributed.launched_by_mpi({v: "2"})
    assert not distributed.launched_by_mpi({"PMI_SIZE": "2", "NAPARI_GPU_RELION_MPI": "0"})
    assert distributed.launched_by_mpi({"NAPARI_GPU_RELION_MPI": "1"})
    assert distributed.launcher_rank({"PMI_SIZE": "3", "PMI_RANK": "2"}) == 2
    assert distributed.launcher_rank({}) is None


def test_a_plain_run_never_imports_mpi4py():
    code = ("import sys; from napari_gpu_relion import cli; from napari_gpu_relion.runtime import distributed; "
            "cli.build_parser(); w = distributed.world(); "
            "assert (w.rank, w.size) == (0, 1); assert 'mpi4py' not in sys.modules, 'mpi4py imported'")
    r = subprocess.run([sys.executable, "-c", code], env=rank_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_relion_gpu_syntax_maps_ranks_in_turn():
    assert [device.gpu_for_rank("0:1:2:3", r) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert [device.gpu_for_rank("1:1:0", r) for r in range(3)] == [1, 1, 0]  # two ranks share GPU 1
    assert device.gpu_for_rank("0,1:2,3", 1) == 2  # RELION's threads per rank: the first GPU of the entry
    assert device.gpu_for_rank("2", 5) == 2 and device.gpu_for_rank(3, 0) == 3
    assert device.gpu_for_rank(None, 5) is None and device.gpu_for_rank(None, 5, n_devices=4) == 1
    with pytest.raises(ValueError, match="0:1:2:3"):
        device.gpu_for_rank("a:b", 0)


def test_shares_cover_every_item_once_in_order():
    class Rank(distributed.SingleProcess):
        def __init__(self, rank: int, size: int) -> None:
            super().__init__()
            self.rank, self.size = rank, size

    rows = np.array([3, 8, 9, 14, 20, 21, 30])
    for size in (1, 2, 3, 8):
        parts = [Rank(r, size).share(rows) for r in range(size)]
        np.testing.assert_array_equal(np.concatenate(parts), rows)
        assert max(p.size for p in parts) - min(p.size for p in parts) <= 1
    np.testing.assert_array_equal(Rank(1, 2).share(5), [3, 4])
    for n in (0, 5, 7, 100):  # without speeds: np.array_split's blocks
        for size in (1, 3, 8):
            want = np.array_split(np.arange(n), size)
            assert all(np.array_equal(Rank(r, size).share(n), want[r]) for r in range(size))


def test_dealt_particles_cover_every_item_once_and_give_each_rank_the_same_mix():
    """The E-step deals runs of particles in turn: every row once, each rank's rows in order, counts within one
    run (DEAL_RUN rows) of each other, and a set written in two groups (two states, say) gives every rank half of
    each; with speeds, rows in proportion to them and still spread over the whole set."""
    class Rank(distributed.SingleProcess):
        def __init__(self, rank: int, size: int) -> None:
            super().__init__()
            self.rank, self.size = rank, size

    run = distributed.DEAL_RUN
    for n in (0, 1, 7, 300, 10 * run + 5, 100_000):
        for size in (1, 2, 3, 4):
            rows = np.arange(n) * 2 + 1  # any rows, in order
            parts = [Rank(r, size).deal(rows) for r in range(size)]
            assert all(np.all(np.diff(p) > 0) for p in parts)
            np.testing.assert_array_equal(np.sort(np.concatenate(parts)), rows)
            counts = [p.size for p in parts]
            assert max(counts) - min(counts) <= run
            if n >= 2 * run * size:  # first half one state, second half the other: each rank gets half of each
                first = [np.count_nonzero(p < rows[n // 2]) / p.size for p in parts]
                assert all(abs(f - 0.5) <= run * size / n for f in first), first


def test_rebalanced_runs_follow_the_speeds_and_move_as_few_runs_as_it_takes():
    """After measured speeds, ranks hold shares in proportion to them within about a run; only runs of ranks
    above their share move (the rest stay where their images are kept), spread over the giving rank's runs."""
    class Rank(distributed.SingleProcess):
        def __init__(self, rank: int, size: int) -> None:
            super().__init__()
            self.rank, self.size = rank, size

    n, size = 100_000, 3
    n_runs = distributed.deal_runs(n, size)
    sizes = np.array([len(x) for x in np.array_split(np.arange(n), n_runs)])
    before = distributed.deal_owners(n_runs, size)
    after = distributed.rebalance_owners(before, sizes, [1.0, 2.0, 1.0])
    held = np.bincount(after, weights=sizes, minlength=size)
    np.testing.assert_allclose(held / n, [0.25, 0.5, 0.25], atol=sizes.max() / n)
    moved = after != before
    assert np.all(after[moved] == 1) and not np.any(before[moved] == 1)  # only to the faster rank, from the others
    assert moved.sum() * sizes.max() <= n / 6 + 2 * sizes.max()  # a sixth of the set, the least that balances
    for r in (0, 2):  # what a giver gave is spread over its runs: the kept runs still span the whole set
        kept = np.flatnonzero(after == r)
        assert kept.min() < 2 * size and kept.max() >= n_runs - 2 * size
    parts = [Rank(r, size).deal(n, after) for r in range(size)]
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(n))
    same = distributed.rebalance_owners(after, sizes, [1.0, 2.0, 1.0])  # balanced already: nothing moves
    np.testing.assert_array_equal(same, after)


def test_the_e_steps_rows_follow_halves_that_change_size():
    """The initial model's mini-batches grow from iteration to iteration: each rank's rows are dealt again when a
    half's number of runs changes (the demo failed at its 57th iteration, the first of more than 128 rows a half),
    and still cover every row of every half once, with shares by the measured speeds."""
    import types  # noqa: PLC0415

    from napari_gpu_relion.jobs import em  # noqa: PLC0415

    class Rank(distributed.SingleProcess):
        def __init__(self, rank: int, size: int) -> None:
            super().__init__()
            self.rank, self.size = rank, size

    jobs = [types.SimpleNamespace(comm=Rank(r, 2), _run_owners=None, _owners_speeds=None) for r in range(2)]
    speeds = None
    for n, new_speeds in ((100, None), (256, [1.0, 3.0]), (257, None), (1000, [1.0, 3.0]), (3000, None)):
        halves = [np.arange(0, 2 * n, 2), np.arange(1, 2 * n, 2)]
        speeds = new_speeds or speeds
        parts = []
        for job in jobs:
            job.halves = halves
            parts.append(em.EMJob.own_blocks(job, speeds))
        for h in range(2):
            np.testing.assert_array_equal(np.sort(np.concatenate([p[h] for p in parts])), halves[h])
        if speeds is not None and n >= 1000:  # enough runs to follow the speeds
            share = sum(len(p) for p in parts[1]) / (2 * n)
            assert 0.6 < share <= 0.75 + distributed.DEAL_RUN / n, share


def test_rank_speeds_follow_the_measured_times_half_way():
    """Each rank's share of the next E-step follows its measured speed (particles per second of its own work),
    averaged with the previous estimate (equal speeds before any), once the same rank was the slowest beyond the
    noise band in three iterations in a row; fewer slow iterations, a rank without a time, or times within the
    band keep the previous estimate."""
    slow0, slow1 = [(100, 10.0), (100, 5.0)], [(100, 5.0), (100, 10.0)]
    assert distributed.REBALANCE_AFTER == 3
    s = distributed.rank_speeds(None, [slow0, slow0, slow0])
    np.testing.assert_allclose(s, [5 / 12, 7 / 12])
    np.testing.assert_allclose(distributed.rank_speeds([0.5, 0.5], [slow0, [(90, 10.0), (110, 7.0)], slow0]),
                               [5 / 12, 7 / 12])
    assert distributed.rank_speeds(None, [slow0]) is None  # the first iteration: nothing before it
    assert distributed.rank_speeds(None, [slow0, slow0]) is None  # two slow iterations: a passing difference
    assert distributed.rank_speeds([0.5, 0.5], [slow0, slow1, slow0]) == [0.5, 0.5]  # the other rank between
    assert distributed.rank_speeds([0.5, 0.5], [slow0, [(100, 10.0), (100, 9.5)], slow0]) == [0.5, 0.5]
    assert distributed.rank_speeds([0.5, 0.5], [slow0, slow0, [(100, 10.0), (0, 0.0)]]) == [0.5, 0.5]
    assert distributed.rank_speeds(None, [slow0, slow0, [(10, 0.0), (10, 1.0)]]) is None
    within = [(100, 10.0), (100, 11.0)]
    assert distributed.rank_speeds([0.4, 0.6], [slow1, slow1, within]) == [0.4, 0.6]  # within the band
    # a share moved for a passing difference moves back half way once the other rank is the slow one as long:
    # rank 1 holds 60 %, is a little slower per particle (19.05 against 20 particles/s) and 1.575x as long
    moved = [(80, 4.0), (120, 6.3)]
    now = np.array([20.0, 120 / 6.3]) / (20.0 + 120 / 6.3)
    np.testing.assert_allclose(distributed.rank_speeds([0.4, 0.6], [moved, moved, moved]),
                               0.5 * (now + np.array([0.4, 0.6])))
    assert distributed.rank_speeds([0.4, 0.6], [moved, moved, moved])[0] > 0.45  # back towards equal shares


def test_every_estep_sum_is_summed_over_ranks():
    """A field added to EStepSums must be declared summed (or a shape) here, or the ranks' sums would be lost."""
    names = {f.name for f in fields(EStepSums)}
    declared = set(distributed.SUMMED_ARRAYS) | set(distributed.SUMMED_SCALARS) | set(distributed.SHAPE_FIELDS)
    assert names == declared, names ^ declared


def test_backends_of_several_ranks_are_described_once_each():
    assert distributed.describe_backends(["CPU"]) == "CPU"
    assert distributed.describe_backends(["GPU 0", "GPU 1", "GPU 0"]) == "3 MPI ranks: GPU 0 x 2, GPU 1"


# ----------------------------------------------------------------------------------------------------------
# Under mpiexec
# ----------------------------------------------------------------------------------------------------------

COMM_SCRIPT = """
import numpy as np
from napari_gpu_relion.runtime import distributed
distributed.CHUNK_BYTES = 64  # large arrays in several chunks
w = distributed.world()
r, n = w.rank, w.size
big = np.full(100, r + 1.0)
small = np.arange(3, dtype=np.int64) * (r + 1)
z = np.full((2, 2), 1j * (r + 1))
w.sum_arrays([big, small, z])
tot = n * (n + 1) / 2
assert np.all(big == tot) and np.all(small == np.arange(3) * tot) and np.all(z == 1j * tot), (big, small, z)
assert w.sum_scalars([r, 1.5]) == [n * (n - 1) / 2, 1.5 * n]
assert w.allgather(r) == list(range(n)) and w.any(r == n - 1) and not w.any(False)
g = w.gather(r * 10)
assert (g == [10 * k for k in range(n)]) if r == 0 else g is None
assert w.bcast("x" if r == 0 else None) == "x"
for root in range(n):  # a sum on one rank: float64 in chunks, int64 packed
    a, b = np.full(100, r + 1.0), np.arange(3, dtype=np.int64) * (r + 1)
    w.reduce_arrays([a, b], root)
    if r == root:
        assert np.all(a == tot) and np.all(b == np.arange(3) * tot), (root, a, b)
assert w.bcast(r, root=n - 1) == n - 1
assert w.ranks_on_host == n and sorted(w.allgather(w.local_rank)) == list(range(n))  # one host here
for src, dst in ((0, n - 1), (n - 1, 0), (1, 1)):  # point to point, in chunks; nothing changes elsewhere
    a = np.arange(40.0) + 100 * r
    w.send_arrays([a], src, dst)
    assert np.array_equal(a, np.arange(40.0) + 100 * (src if r == dst else r)), (src, dst, a)
counts = [(2, 0, 3)[k % 3] for k in range(n)]  # blocks of rows in rank order, one rank with none
for bad in (counts + [1], [0] * n if r == 0 else counts):  # too many counts; rank 0's block contradicts them
    try:
        w.allgather_rows(np.zeros((counts[r], 2, 3), np.float32), bad)
    except ValueError:
        pass  # every rank: none is left waiting in the gather
    else:
        raise AssertionError(f"rank {r}: no error for counts {bad}")
for dt in (np.float32, np.complex128):
    rows = (np.arange(counts[r] * 6).reshape(counts[r], 2, 3) + 100 * r).astype(dt)
    got = w.allgather_rows(rows, counts)
    want = np.concatenate([(np.arange(c * 6).reshape(c, 2, 3) + 100 * k).astype(dt) for k, c in enumerate(counts)])
    assert got.dtype == dt and np.array_equal(got, want), (dt, got)
before = w.bytes_sent
mine = {k: np.full((2, 2), 10.0 * k) for k in range(sum(counts)) if sum(counts[:r]) <= k < sum(counts[:r + 1])}
got = distributed.gather_items(w, np, (sum(counts), 2, 2), np.float32, mine)
assert np.array_equal(got, np.arange(sum(counts), dtype=np.float32)[:, None, None] * 10 + np.zeros((1, 2, 2)))
assert w.bytes_sent - before == 16 * len(mine)  # each rank's own block once
mine = {n - 1 - r: np.full(3, r + 1.0)}  # not in rank order: the sum of zero-filled arrays
got = distributed.gather_items(w, np, (n, 3), np.float64, mine)
assert np.array_equal(got, np.repeat(np.arange(n, 0, -1.0)[:, None], 3, 1)), got
print(f"ok {r} {n}")
"""


@needs_mpi
def test_the_communicator_sums_gathers_and_broadcasts(tmp_path):
    script = tmp_path / "comm.py"
    script.write_text(COMM_SCRIPT)
    out = _ok(_mpirun(3, [], tmp_path, timeout=60, python=[str(script)]))
    assert all(f"ok {r} 3" in out for r in range(3)), out


GPU_COMM_SCRIPT = """
import numpy as np, cupy as cp
from napari_gpu_relion.runtime import distributed
distributed.CHUNK_BYTES, distributed.EXCHANGE_BYTES = 4096, 1024  # large arrays in several exchange chunks
w = distributed.world()
r, n = w.rank, w.size
rng = np.random.default_rng(r)
vals = [rng.standard_normal(1000), rng.integers(-5, 5, 700), rng.standard_normal(300) + 1j * rng.standard_normal(300),
        rng.standard_normal((40, 30)).astype(np.float32), rng.standard_normal(5), rng.standard_normal((40, 50))]
dev = [cp.asarray(v) for v in vals]
view = dev[-1][5:35, 10:40]  # a non-contiguous block, as distributed.sum_estep sums
w.sum_arrays(dev[:-1] + [view])
every = w.allgather(vals)
for k, got in enumerate(dev[:-1]):
    want = sum(np.asarray(v[k], np.complex128 if v[k].dtype.kind == "c" else np.float64) for v in every)
    tol = 1e-5 if got.dtype == np.float32 else 1e-12
    assert np.allclose(cp.asnumpy(got), want, rtol=tol, atol=tol * n), (k, w.reduction_path)
outside = cp.asnumpy(dev[-1]).copy()
inside = sum(v[-1][5:35, 10:40] for v in every)
assert np.allclose(outside[5:35, 10:40], inside, rtol=1e-12, atol=1e-12)
outside[5:35, 10:40] = vals[-1][5:35, 10:40]
assert np.array_equal(outside, vals[-1])  # nothing outside the block changed
for root in range(n):  # a sum on one rank (ranks sharing a GPU: every rank gets it)
    x = cp.asarray(vals[0])
    w.reduce_arrays([x], root)
    if r == root:
        assert np.allclose(cp.asnumpy(x), sum(v[0] for v in every), rtol=1e-12, atol=1e-12), root
# each rank's rows once, in rank order: uneven blocks, a rank with none, and equal full blocks
for counts in ([(k + 1) % 3 for k in range(n)], [0] + [2] * (n - 1), [2] * n):
    for dt in (np.float32, np.complex64):
        rows = cp.asarray((np.arange(counts[r] * 12).reshape(counts[r], 3, 4) + 1000 * r).astype(dt))
        got = w.allgather_rows(rows, counts, pinned=True)
        want = np.concatenate([(np.arange(c * 12).reshape(c, 3, 4) + 1000 * k).astype(dt)
                               for k, c in enumerate(counts)])
        assert isinstance(got, np.ndarray) and got.dtype == dt and np.array_equal(got, want), (counts, dt)
print(f"ok {r} {n} {w.reduction_path}")
"""


@needs_mpi
@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU with CuPy")
def test_ranks_sharing_a_gpu_sum_on_it_through_cuda_ipc(tmp_path):
    """Three ranks on one GPU: device arrays of every kind (float64, int64, complex, float32, small ones packed,
    a non-contiguous block) are summed on the GPU through CUDA IPC, in several exchange chunks, and equal the
    float64 sum over the ranks."""
    script = tmp_path / "gpucomm.py"
    script.write_text(GPU_COMM_SCRIPT)
    out = _ok(_mpirun(3, [], tmp_path, timeout=120, python=[str(script)]))
    assert all(f"ok {r} 3 CUDA IPC (all ranks share one GPU)" in out for r in range(3)), out


def _gpu_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 - no CuPy or no driver
        return 0


@needs_mpi
@pytest.mark.gpu
@pytest.mark.skipif(_gpu_count() < 2, reason="needs two CUDA GPUs with CuPy")
def test_ranks_on_their_own_gpus_sum_through_nccl_started_before_the_first_sum(tmp_path):
    """Two ranks, each on its own GPU, decide how to sum before the first sum (prepare_device_sum: NCCL's
    communicator made in a background thread while a job starts); the sums of every kind then go through NCCL and
    equal the float64 sum over the ranks."""
    script = tmp_path / "ncclcomm.py"
    script.write_text(GPU_COMM_SCRIPT.replace(
        "w = distributed.world()\n",
        "w = distributed.world()\ncp.cuda.Device(w.rank % cp.cuda.runtime.getDeviceCount()).use()\n"
        "w.prepare_device_sum()\n"))
    out = _ok(_mpirun(2, [], tmp_path, timeout=120, python=[str(script)]))
    assert all(f"ok {r} 2 NCCL (GPU to GPU)" in out for r in range(2)), out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_sample_data(tmp_path_factory.mktemp("mpi"), box=32, angpix=6.0, n_particles=160, snr=0.2,
                            diameter=134.4, ini_high=60.0, n_micrographs=2)


CLASS2D = ["class2d", "--i", "particles.star", "--K", "4", "--ctf", "--particle_diameter", "150", "--cpu"]
REFINE = ["refine3d", "--i", "particles.star", "--ref", "reference.mrc", "--healpix_order", "0", "--auto_iter_max",
          "2", "--ctf", "--particle_diameter", "150", "--cpu"]


@pytest.fixture(scope="module")
def class2d_one(data) -> Path:
    """One process, 2 iterations of class2d."""
    _one_process(CLASS2D + ["--iter", "2", "--o", "C1/run"], data)
    return data / "C1"


@pytest.mark.slow
@needs_mpi
def test_class2d_on_three_ranks_equals_one_process(data, class2d_one):
    """The same classes and in-plane angles for >= 99.5 % of the particles, the same class averages (to float
    rounding) and resolution; rank 0 alone prints and writes (one note.txt entry, one 'done' line)."""
    out = _ok(_mpirun(3, CLASS2D + ["--iter", "2", "--o", "C3/run"], data))
    assert "3 MPI ranks: CPU" in out and out.count("[done in") == 1
    same_angle, same_class = _same(class2d_one / "run_it002_data.star", data / "C3/run_it002_data.star")
    assert same_angle >= 0.995 and same_class >= 0.995, (same_angle, same_class)
    _close_maps(class2d_one / "run_it002_classes.mrcs", data / "C3/run_it002_classes.mrcs")
    assert _resolution(class2d_one / "run_it002_model.star") == _resolution(data / "C3/run_it002_model.star")
    assert (data / "C3/note.txt").read_text().count("++++") == 1


@needs_mpi
@pytest.mark.slow
def test_continue_with_another_number_of_ranks(data, class2d_one):
    """Iteration 1 on 3 ranks, iteration 2 continued on 2 ranks: the run of one process, uninterrupted."""
    _ok(_mpirun(3, CLASS2D + ["--iter", "1", "--o", "Cc/run"], data))
    _ok(_mpirun(2, ["class2d", "--continue", "Cc/run_it001_optimiser.star", "--iter", "2", "--cpu"], data))
    same_angle, same_class = _same(class2d_one / "run_it002_data.star", data / "Cc/run_it002_data.star")
    assert same_angle >= 0.995 and same_class >= 0.995, (same_angle, same_class)
    _close_maps(class2d_one / "run_it002_classes.mrcs", data / "Cc/run_it002_classes.mrcs")


@needs_mpi
@pytest.mark.slow
def test_class3d_with_more_ranks_than_classes_equals_one_process(data):
    """3D classification, K=2 on 3 ranks (each class summed on and reconstructed by its own rank; rank 2 makes
    no map and gets both): the same classes and orientations for >= 99.5 % of the particles and the same maps (to
    float rounding) as one process; each iteration's log line of every rank's E-step, wait and bytes sent."""
    args = ["class3d", "--i", "particles.star", "--ref", "reference.mrc", "--K", "2", "--iter", "2",
            "--healpix_order", "0", "--ctf", "--particle_diameter", "150", "--cpu", "--random_seed", "3"]
    _one_process(args + ["--o", "K1/run"], data)
    out = _ok(_mpirun(3, args + ["--o", "K3/run"], data))
    assert "reconstructions (M-step): class 1 on rank 0, class 2 on rank 1" in out
    reports = re.findall(r"iteration (\d) per rank: particles ([\d /]+), E-step ([\d. /]+) s, waiting ([\d. /]+) s, "
                         r"sent ([\d. /]+) MB", out)
    assert [r[0] for r in reports] == ["1", "2"], out
    for _, parts, estep, waiting, sent in reports:  # each rank's particles, E-step, wait and bytes, in rank order
        assert all(len(x.split(" / ")) == 3 for x in (parts, estep, waiting, sent))
        assert sum(int(v) for v in parts.split(" / ")) == 160  # every particle once
        assert all(float(v) > 0 for v in sent.split(" / ")), sent
    same_angle, same_class = _same(data / "K1/run_it002_data.star", data / "K3/run_it002_data.star")
    assert same_angle >= 0.995 and same_class >= 0.995, (same_angle, same_class)
    for k in (1, 2):
        _close_maps(data / f"K1/run_it002_class00{k}.mrc", data / f"K3/run_it002_class00{k}.mrc")


@needs_mpi
@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU with CuPy")
def test_ranks_keep_their_own_images_on_the_gpu_and_equal_one_process(data):
    """Two ranks on GPU 0 (issue 47: a rank without its images on the GPU read them from the disk every
    iteration): each keeps only its own rows on the GPU, in a store smaller than the set, and the classes and
    orientations equal one GPU process for >= 99.5 % of the particles."""
    args = ["class3d", "--i", "particles.star", "--ref", "reference.mrc", "--K", "2", "--iter", "3",
            "--healpix_order", "1", "--ctf", "--particle_diameter", "150", "--gpu", "0", "--random_seed", "3"]
    _one_process(args + ["--o", "G1/run"], data)
    out = _ok(_mpirun(2, args + ["--o", "G2/run"], data, timeout=300))
    assert re.search(r"images of this rank's 80 particles, room for 100 kept on the GPU", out), out[-3000:]
    same_angle, same_class = _same(data / "G1/run_it003_data.star", data / "G2/run_it003_data.star")
    assert same_angle >= 0.995 and same_class >= 0.995, (same_angle, same_class)


@pytest.fixture(scope="module")
def refine_one(data) -> Path:
    """One process, refine3d (3 iterations, the last one the final joined one)."""
    _one_process(REFINE + ["--o", "R1/run"], data)
    return data / "R1"


@needs_mpi
@pytest.mark.slow
@pytest.mark.parametrize("n", [3, 2])
def test_refine3d_on_several_ranks_equals_one_process(data, refine_one, n):
    """Gold-standard auto-refine (both halves spread over the ranks), 3 iterations: the same angles for >= 99.5 %
    of the particles, the same final resolution and maps (to float rounding) on 1 and n ranks. Before the final
    iteration each half is summed on and reconstructed by its own rank (the low-resolution join and the FSC
    between the two)."""
    out = _ok(_mpirun(n, REFINE + ["--o", f"R{n}/run"], data))
    assert "reconstructions (M-step): the map of half 1 on rank 0, the map of half 2 on rank 1" in out
    same_angle, _ = _same(refine_one / "run_data.star", data / f"R{n}/run_data.star")
    assert same_angle >= 0.995, (n, same_angle)
    assert _resolution(refine_one / "run_model.star") == _resolution(data / f"R{n}/run_model.star")
    _close_maps(refine_one / "run_class001.mrc", data / f"R{n}/run_class001.mrc")


@needs_mpi
def test_reconstruct_on_three_ranks_equals_one_process(data):
    args = ["reconstruct", "--i", "particles.star", "--ctf", "--cpu"]
    _one_process(args + ["--o", "rec1.mrc"], data)
    _ok(_mpirun(3, args + ["--o", "rec3.mrc"], data))
    _close_maps(data / "rec1.mrc", data / "rec3.mrc", tol=1e-5)


@needs_mpi
@pytest.mark.slow
def test_autopick_and_extract_on_several_ranks_equal_one_process(data):
    """Two micrographs on 3 ranks (one rank has none): the same picks, one autopick.star in STAR order; then
    extraction on 2 ranks: the same particles and boxes."""
    pick = ["autopick", "--i", "micrographs.star", "--LoG", "--LoG_diam_min", "110", "--LoG_diam_max", "160",
            "--LoG_adjust_threshold", "3", "--LoG_robust_stats", "--cpu"]
    _one_process(pick + ["--odir", "P1"], data)
    out = _ok(_mpirun(3, pick + ["--odir", "P3"], data))
    assert out.count("[done in") == 1
    lists = {d: starfile.read(data / d / "autopick.star") for d in ("P1", "P3")}
    assert list(lists["P1"]["rlnMicrographName"]) == list(lists["P3"]["rlnMicrographName"])
    assert len(lists["P1"]) == 2
    for mic in ("mic001", "mic002"):
        a = read_coordinates(data / "P1/micrographs" / f"{mic}_autopick.star")
        b = read_coordinates(data / "P3/micrographs" / f"{mic}_autopick.star")
        assert len(a) > 10
        np.testing.assert_array_equal(a[["rlnCoordinateX", "rlnCoordinateY"]].to_numpy(),
                                      b[["rlnCoordinateX", "rlnCoordinateY"]].to_numpy())
    ext = ["extract", "--i", "micrographs.star", "--coord_list", "P1/autopick.star", "--extract_size", "32", "--norm",
           "--invert_contrast", "--cpu"]
    _one_process(ext + ["--o", "E1"], data)
    _ok(_mpirun(2, ext + ["--o", "E2"], data))
    a, b = (starfile.read(data / e / "particles.star")["particles"] for e in ("E1", "E2"))
    assert len(a) == len(b) > 20
    np.testing.assert_array_equal(a["rlnCoordinateX"], b["rlnCoordinateX"])
    assert list(a["rlnImageName"].str.replace("E1/", "E2/")) == list(b["rlnImageName"])
    for mic in ("mic001", "mic002"):
        np.testing.assert_array_equal(mrcfile.read(data / "E1/Particles/micrographs" / f"{mic}.mrcs"),
                                      mrcfile.read(data / "E2/Particles/micrographs" / f"{mic}.mrcs"))


FAILING_RANK = """
import os, sys
from napari_gpu_relion import cli
from napari_gpu_relion.jobs import em
rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
calls = []
if rank == 1:
    estep = em.run_estep

    def broken(*args, **kw):
        calls.append(1)
        if sys.argv[1] == "kill" and len(calls) == 2:  # iteration 2: rank 0 has printed the ranks' pids
            os.kill(os.getpid(), 9)
        if sys.argv[1] == "raise":
            raise RuntimeError("simulated failure of this rank")
        yield from estep(*args, **kw)
    em.run_estep = broken
sys.exit(cli.main(sys.argv[2:]))
"""


@needs_mpi
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_failing_rank_stops_the_job_naming_rank_and_host(data, tmp_path, how):
    """Rank 1 of 3 raises in its E-step (or is killed in iteration 2's) while the others wait in a collective: the
    job ends (no hang) with a non-zero exit and a message naming rank 1 and the host (killed: the launcher names
    host and pid, the job's log says which rank had that pid)."""
    script = tmp_path / "fail.py"
    script.write_text(FAILING_RANK)
    r = _mpirun(3, CLASS2D + ["--iter", "2", "--o", f"F{how}/run"], data, timeout=60, python=[str(script), how])
    text = r.stdout + r.stderr
    assert r.returncode != 0
    if how == "raise":
        assert f"rank 1 of 3 on {socket.gethostname()}" in text and "simulated failure" in text, text[-2000:]
        assert "stopping all ranks" in text
    else:  # a killed process reports nothing itself: the launcher ends the job and names host and pid (MPICH:
        # "PID n RUNNING AT host", sometimes the pid of a rank it killed while cleaning up; Open MPI: "rank 1 with
        # PID n on node host"); the job's log maps every pid to its rank
        pid = re.search(r"PID (\d+)", text)
        assert pid is not None and socket.gethostname() in text, text[-2000:]
        table = re.search(r"MPI ranks \(host:pid\): (.*)", text)
        assert table is not None and f"{socket.gethostname()}:{pid.group(1)}" in table.group(1), text[-2000:]


@needs_mpi
@pytest.mark.slow
def test_a_job_under_mpiexec_as_a_child_sends_the_events_of_one_in_process(data):
    """What the napari widgets do for "MPI ranks" > 1: class2d on 2 ranks in a child process; its events arrive
    (Started naming 2 ranks, the class averages as arrays, the iteration, Finished) and equal the job's files."""
    from napari_gpu_relion import mpi_child  # noqa: PLC0415
    from napari_gpu_relion.events import ClassAveragesUpdated, Finished, IterationFinished, Started  # noqa: PLC0415
    from napari_gpu_relion.jobs import class2d  # noqa: PLC0415

    p = class2d.Params(i=data / "particles.star", o=data / "W2/run", K=4, iter=1, ctf=True, particle_diameter=150.0,
                       cpu=True)
    events = list(mpi_child.run_under_mpi("class2d", p, 2))
    assert isinstance(events[0], Started) and events[0].backend.startswith("2 MPI ranks")
    assert isinstance(events[-1], Finished) and sum(isinstance(e, IterationFinished) for e in events) == 1
    (avg,) = [e for e in events if isinstance(e, ClassAveragesUpdated)]
    np.testing.assert_array_equal(avg.images, mrcfile.read(data / "W2/run_it001_classes.mrcs"))


@needs_mpi
@pytest.mark.slow
def test_cancelling_a_child_mpi_job_ends_every_rank(data):
    from napari_gpu_relion import mpi_child  # noqa: PLC0415
    from napari_gpu_relion.events import Progress  # noqa: PLC0415
    from napari_gpu_relion.jobs import class2d  # noqa: PLC0415

    out = data / "Wcancel"
    p = class2d.Params(i=data / "particles.star", o=out / "run", K=4, iter=20, ctf=True, particle_diameter=150.0,
                       cpu=True)
    procs: list = []
    gen = mpi_child.run_under_mpi("class2d", p, 2, on_start=procs.append)
    for ev in gen:
        if isinstance(ev, Progress):
            break
    gen.close()
    assert procs[0].poll() is not None
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
    assert not left, f"ranks still running: {left}"
    assert not (out / "run_it020_data.star").exists()


@pytest.mark.slow
@needs_mpi
def test_the_class2d_widget_runs_on_two_mpi_ranks_and_shows_the_classes(make_napari_viewer, qtbot, data, errors,
                                                                         config_dir, monkeypatch):
    """The 2D classification dock with "MPI ranks" 2: the job runs under mpiexec in a child process and the class
    grid appears in the viewer as for a job in this process, equal to the averages the job wrote."""
    pytest.importorskip("napari")
    from napari_gpu_relion import mpi_child  # noqa: PLC0415
    from napari_gpu_relion.io.mrc import read_mrc  # noqa: PLC0415
    from napari_gpu_relion.widgets import job_widget  # noqa: PLC0415
    from napari_gpu_relion.widgets.display import LiveDisplay  # noqa: PLC0415
    from napari_gpu_relion.widgets.runner import JobState  # noqa: PLC0415

    calls = []

    def recorded(job, params, ranks, **kw):
        calls.append((job, ranks))
        yield from mpi_child.run_under_mpi(job, params, ranks, **kw)

    monkeypatch.setattr(job_widget, "run_under_mpi", recorded)
    viewer = make_napari_viewer()
    _, w = viewer.window.add_plugin_dock_widget("napari-gpu-relion", "2D classification")
    w.set_values(i=data / "particles.star", o=data / "Wwidget", K=4, iter=1, ctf=True, particle_diameter=150.0,
                 cpu=True)
    assert w.mpi_ranks is not None and w.mpi_ranks.enabled
    w.mpi_ranks.value = 2
    w.run_button.native.click()
    qtbot.waitUntil(lambda: w.job is not None and w.job.done, timeout=120_000)
    assert w.job.state is JobState.FINISHED, w.status.value
    assert not errors and calls == [("class2d", 2)]
    LiveDisplay.for_viewer(viewer).flush()
    grid = viewer.layers["classes"]
    assert grid.data.shape == (64, 64)  # 4 classes of 32 px
    tiles = read_mrc(data / "Wwidget" / "run_it001_classes.mrcs").data
    t = tiles[grid.metadata["order"][0]]
    np.testing.assert_allclose(grid.data[:32, :32], (t - t.mean()) / t.std(), atol=1e-4)


def test_one_process_gathers_its_own_items_in_index_order():
    """Without MPI gather_items is the items themselves, in index order, in the asked dtype (the jobs call it the
    same way on one rank and on many); allgather_rows gives the rows back on the host."""
    w = distributed.SingleProcess()
    mine = {1: np.full((2, 2), 2.5), 0: np.arange(4.0).reshape(2, 2)}
    got = distributed.gather_items(w, np, (2, 2, 2), np.float32, mine)
    want = np.stack([np.arange(4.0).reshape(2, 2), np.full((2, 2), 2.5)])
    assert got.dtype == np.float32 and np.array_equal(got, want)
    rows = np.arange(6.0).reshape(3, 2)
    assert np.array_equal(w.allgather_rows(rows, [3]), rows)


def test_every_reconstruction_has_one_owner_in_blocks_and_the_rest_is_everyones():
    """runtime.distributed.assign: every (kind, class, half) of an iteration's fixed work has at least one rank;
    each reconstruction exactly one, in contiguous blocks over the ranks in (half, class) order (every block
    size within one of the others); every rank prepares every reference and projects every coarse slice; a job
    that owns nothing (the initial model) leaves every reconstruction to every rank."""
    items = distributed.fixed_work(3, 2)
    assert len(items) == len(set(items)) == len(distributed.FIXED_WORK_KINDS) * 3 * 2

    class Rank(distributed.SingleProcess):
        def __init__(self, rank, size):
            self.rank, self.size = rank, size

    everything = {(k, h) for k in range(3) for h in range(2)}
    for size in (1, 4, 8):
        mine = []
        for r in range(size):
            comm = Rank(r, size)
            a = distributed.assign(items, comm)
            assert set(a) == set(items) and all(ranks for ranks in a.values())
            for kind in ("prepare reference", "coarse projections"):
                assert distributed.owned(a, kind, comm) == everything
            mine.append(distributed.owned(a, "reconstruction", comm))
            shared = distributed.assign(items, comm, owned_kinds=())
            assert distributed.owned(shared, "reconstruction", comm) == everything
            if size > 1:
                assert distributed.owners(shared, "reconstruction", 3, 1) == [None, None, None]
        assert sorted(x for m in mine for x in m) == sorted(everything)  # each reconstruction on one rank
        sizes = [len(m) for m in mine]
        assert max(sizes) - min(sizes) <= 1, sizes
        order = [(h, k) for m in mine for k, h in sorted(m, key=lambda kh: (kh[1], kh[0]))]
        assert order == sorted(order)  # blocks in rank order
    a = distributed.assign(items, Rank(0, 4))
    assert distributed.owners(a, "reconstruction", 3, 0) == [0, 0, 1]  # 6 items on 4 ranks: 2, 2, 1, 1
    assert distributed.owners(a, "reconstruction", 3, 1) == [1, 2, 3]
    assert distributed.owner_blocks([0, 0, 1, None, None, 2]) == [(0, 0, 2), (1, 2, 3), (None, 3, 5), (2, 5, 6)]


def test_compute_threads_share_the_usable_cores_among_a_hosts_ranks(monkeypatch):
    """A CPU rank's threads: the usable cores over the host's ranks, at most COMPUTE_THREADS_MAX, at least one."""
    from napari_gpu_relion.runtime import device

    for cores, ranks, want in ((2, 1, 2), (16, 4, 4), (64, 1, device.COMPUTE_THREADS_MAX), (2, 3, 1)):
        monkeypatch.setattr(device, "usable_cores", lambda c=cores: c)
        assert device.compute_threads(ranks) == want, (cores, ranks)
