"""Scale-out over MPI ranks (mpi4py): the communicator the jobs use, of size 1 when not under MPI.

A job is the same code on every rank: it takes its share of the particles or micrographs (``share``), sums
its accumulators with the other ranks (``sum_arrays``, through host buffers), gathers per-item results
(``allgather`` / ``gather``) and lets rank 0 alone write files and yield events (``is_root``). Outside
``mpirun`` / ``srun`` the communicator is ``SingleProcess`` and mpi4py is never imported, so a plain run
neither needs nor loads MPI. MPI is used when a launcher's variables are present (``OMPI_COMM_WORLD_SIZE``,
``PMI_SIZE``, ``PMIX_RANK``, ``MV2_COMM_WORLD_SIZE``, or a SLURM step of several tasks) or when
``NAPARI_GPU_RELION_MPI=1``; ``NAPARI_GPU_RELION_MPI=0`` turns it off.

Sums of device (CuPy) arrays go through NCCL, GPU to GPU, when every rank has a GPU of its own (NCCL refuses two
ranks on one GPU) and CuPy finds NCCL; through host buffers otherwise, or when ``NAPARI_GPU_RELION_NCCL=0``.
``reduction_path`` says which (the EM jobs print it with each iteration's timing).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

import numpy as np

from .compute.backend import get_array_module, to_host

#: Environment variables that a launcher sets in every rank it starts (Open MPI, MPICH/Intel MPI (Hydra, PMI-1/2),
#: PMIx (srun --mpi=pmix, Open MPI 5), MVAPICH2).
LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")
#: Variables that give the rank's index on its own host (for mapping ranks to the GPUs of that host).
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "MV2_COMM_WORLD_LOCAL_RANK",
                        "PMI_LOCAL_RANK")
#: Arrays larger than this are summed on their own, in chunks of this size (bytes); smaller ones are packed into
#: one buffer per dtype, so one E-step's many small sums cost one collective.
CHUNK_BYTES = 1 << 28
#: Array types that NCCL sums on the device (complex as pairs of reals); others go through host buffers.
NCCL_DTYPES = ("float64", "float32", "int64", "int32", "complex128", "complex64")
ABORT_GRACE_S = 1.0  # seconds a failing rank waits after its message before MPI_Abort (see World.abort)


def launched_by_mpi(environ: dict | None = None) -> bool:
    """True when this process was started by an MPI launcher (or NAPARI_GPU_RELION_MPI=1 asks for MPI)."""
    env = os.environ if environ is None else environ
    flag = env.get("NAPARI_GPU_RELION_MPI", "").strip().lower()
    if flag in ("0", "no", "false", "off"):
        return False
    if flag in ("1", "yes", "true", "on"):
        return True
    if any(v in env for v in LAUNCHER_VARIABLES):
        return True
    try:
        return int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1 and "SLURM_PROCID" in env
    except ValueError:
        return False


def local_rank(environ: dict | None = None) -> int | None:
    """This rank's index among the ranks on its host, when the launcher says."""
    env = os.environ if environ is None else environ
    for v in LOCAL_RANK_VARIABLES:
        if env.get(v, "").strip().isdigit():
            return int(env[v])
    return None


class SingleProcess:
    """The communicator of a run without MPI: rank 0 of 1; every collective is the identity."""

    rank = 0
    size = 1

    def __init__(self) -> None:
        self.host = socket.gethostname()

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def local_rank(self) -> int:
        return self.rank

    def describe(self) -> str:
        return f"rank {self.rank} of {self.size} on {self.host}"

    def share(self, items: int | np.ndarray) -> np.ndarray:
        """This rank's contiguous block of ``items`` (a count: its indices; an array: its elements), blocks as
        equal as they can be, in rank order."""
        items = np.arange(items) if np.isscalar(items) else np.asarray(items)
        return np.array_split(items, self.size)[self.rank]

    reduction_path = "none (one process)"

    def sum_arrays(self, arrays: list) -> None:
        """Sum each NumPy/CuPy array over the ranks, in place (every rank gets the same sums)."""

    def sum_scalars(self, values: list[float]) -> list[float]:
        return [float(v) for v in values]

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any."""
        return bool(flag)

    def allgather(self, obj: Any) -> list:
        return [obj]

    def gather(self, obj: Any) -> list | None:
        """Every rank's ``obj`` in rank order on rank 0, None elsewhere."""
        return [obj]

    def bcast(self, obj: Any) -> Any:
        return obj

    def barrier(self) -> None:
        pass

    def abort(self, message: str, code: int = 1) -> None:
        print(message, file=sys.stderr, flush=True)
        raise SystemExit(code)


class MPICommunicator(SingleProcess):
    """MPI_COMM_WORLD through mpi4py. Sums go through host buffers (device arrays are copied)."""

    def __init__(self, comm=None) -> None:
        super().__init__()
        from mpi4py import MPI  # noqa: PLC0415 - only under an MPI launcher

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.host = MPI.Get_processor_name()
        lr = local_rank()
        self._local = lr if lr is not None else self.comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        self._nccl_comm = False  # not decided yet (see _nccl)
        self.reduction_path = "host buffers (MPI)"

    @property
    def local_rank(self) -> int:
        return self._local

    def _allreduce_host(self, buf: np.ndarray) -> None:
        flat = buf.reshape(-1)
        step = max(1, CHUNK_BYTES // max(flat.itemsize, 1))
        for i in range(0, flat.size, step):
            self.comm.Allreduce(self.MPI.IN_PLACE, flat[i:i + step], op=self.MPI.SUM)

    def sum_arrays(self, arrays: list) -> None:
        nccl_kind = [get_array_module(a) is not np and np.dtype(a.dtype).name in NCCL_DTYPES for a in arrays]
        nccl = self._nccl() if any(nccl_kind) else None  # collective: every rank passes the same kinds of arrays
        if nccl is not None:
            _nccl_sum(nccl, [a for a, k in zip(arrays, nccl_kind, strict=True) if k])
            arrays = [a for a, k in zip(arrays, nccl_kind, strict=True) if not k]
        small: dict[np.dtype, list] = {}
        for a in arrays:
            if a.nbytes > CHUNK_BYTES // 4:
                host = np.ascontiguousarray(to_host(a))
                self._allreduce_host(host)
                _store(a, host)
            else:
                small.setdefault(np.dtype(a.dtype), []).append(a)
        for dt, group in small.items():
            buf = np.concatenate([np.asarray(to_host(a), dtype=dt).reshape(-1) for a in group])
            self._allreduce_host(buf)
            i = 0
            for a in group:
                _store(a, buf[i:i + a.size].reshape(a.shape))
                i += a.size

    def _nccl(self):
        """An NCCL communicator over every rank's current GPU, made at the first sum of device arrays (all
        ranks decide together), or None: some rank has no GPU of its own, no NCCL, NAPARI_GPU_RELION_NCCL=0."""
        if self._nccl_comm is not False:
            return self._nccl_comm
        self._nccl_comm, self.reduction_path = None, "host buffers (MPI)"
        wanted = os.environ.get("NAPARI_GPU_RELION_NCCL", "1").strip().lower() not in ("0", "no", "false", "off")
        nccl, gpu = None, None
        if wanted:
            try:
                import cupy  # noqa: PLC0415
                from cupy.cuda import nccl  # noqa: PLC0415

                gpu = (self.host, cupy.cuda.Device().pci_bus_id) if getattr(nccl, "available", True) else None
            except Exception:  # no CuPy or no NCCL library: host buffers
                gpu = None
        gpus = self.comm.allgather(gpu)
        if any(g is None for g in gpus) or len(set(gpus)) < len(gpus):
            if wanted and all(g is not None for g in gpus):
                self.reduction_path = "host buffers (MPI; ranks share a GPU, which NCCL cannot)"
            return None
        uid = self.comm.bcast(nccl.get_unique_id() if self.rank == 0 else None, root=0)
        try:
            comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        except Exception as exc:  # noqa: BLE001 - any failure means the host path, decided together below
            comm, why = None, f"{type(exc).__name__}: {exc}"
        else:
            why = ""
        whys = self.comm.allgather(why)
        if any(whys):
            self.reduction_path = "host buffers (MPI; NCCL failed: " + next(w for w in whys if w) + ")"
            return None
        self._nccl_comm, self.reduction_path = comm, "NCCL (GPU to GPU)"
        return comm

    def sum_scalars(self, values: list[float]) -> list[float]:
        buf = np.asarray(values, dtype=np.float64)
        self._allreduce_host(buf)
        return [float(v) for v in buf]

    def any(self, flag: bool) -> bool:
        return bool(self.comm.allreduce(int(bool(flag)), op=self.MPI.MAX))

    def allgather(self, obj: Any) -> list:
        return self.comm.allgather(obj)

    def gather(self, obj: Any) -> list | None:
        return self.comm.gather(obj, root=0)

    def bcast(self, obj: Any) -> Any:
        return self.comm.bcast(obj, root=0)

    def barrier(self) -> None:
        self.comm.Barrier()

    def abort(self, message: str, code: int = 1) -> None:
        """Stop every rank: print ``message`` and MPI_Abort (the launcher ends the others).

        The launcher forwards a rank's output through a pipe that it stops reading once it kills the job, so an
        abort right after the print loses the message about one time in five (MPICH's Hydra): wait
        ``ABORT_GRACE_S`` before aborting."""
        print(message, file=sys.stderr, flush=True)
        time.sleep(ABORT_GRACE_S)
        self.comm.Abort(code)
        os._exit(code)  # MPI_Abort may return after notifying the launcher; this rank must not go on


def _nccl_sum(comm, arrays: list) -> None:
    """Sum CuPy arrays over the ranks in place with NCCL on the current stream: large contiguous ones each on
    their own, the rest packed into one buffer per dtype (complex as pairs of reals)."""
    import cupy  # noqa: PLC0415
    from cupy.cuda import nccl  # noqa: PLC0415

    types = {np.dtype(np.float64): nccl.NCCL_FLOAT64, np.dtype(np.float32): nccl.NCCL_FLOAT32,
             np.dtype(np.int64): nccl.NCCL_INT64, np.dtype(np.int32): nccl.NCCL_INT32}

    def reduce(buf) -> None:
        flat = buf.reshape(-1)
        if flat.dtype.kind == "c":
            flat = flat.view(flat.real.dtype)
        comm.allReduce(flat.data.ptr, flat.data.ptr, flat.size, types[flat.dtype], nccl.NCCL_SUM,
                       cupy.cuda.get_current_stream().ptr)

    small: dict[np.dtype, list] = {}
    for a in arrays:
        if a.nbytes > CHUNK_BYTES // 4 and a.flags.c_contiguous:
            reduce(a)
        else:
            small.setdefault(np.dtype(a.dtype), []).append(a)
    for _, group in small.items():
        buf = cupy.concatenate([a.reshape(-1) for a in group])
        reduce(buf)
        i = 0
        for a in group:
            a[...] = buf[i:i + a.size].reshape(a.shape)
            i += a.size
    cupy.cuda.get_current_stream().synchronize()


def _store(a, host: np.ndarray) -> None:
    """Write ``host`` values into the NumPy or CuPy array ``a`` in place."""
    xp = get_array_module(a)
    if xp is np:
        if host is not a:
            a[...] = host
    else:
        a[...] = xp.asarray(host)


_world: SingleProcess | None = None


def world() -> SingleProcess:
    """The communicator of this process, made once: MPI_COMM_WORLD under an MPI launcher, else SingleProcess.
    Under a launcher without mpi4py installed this raises a clear error (never a silent single-rank run per
    rank, which would make N copies of the same job write the same files)."""
    global _world
    if _world is None:
        if not launched_by_mpi():
            _world = SingleProcess()
        else:
            try:
                import mpi4py  # noqa: F401, PLC0415
            except ImportError as exc:
                raise RuntimeError("started by an MPI launcher (mpirun/mpiexec/srun) but mpi4py is not installed: "
                                   "pip install 'napari-gpu-relion[mpi]' (or set NAPARI_GPU_RELION_MPI=0 for "
                                   "independent single-process runs)") from exc
            comm = MPICommunicator()
            _world = comm if comm.size > 1 else SingleProcess()
    return _world


def set_world(comm: SingleProcess | None) -> None:
    """Replace the communicator (tests; None: detect again on the next ``world()``)."""
    global _world
    _world = comm


def gpu_for_rank(spec: str | int | None, local: int, n_devices: int | None = None) -> int | None:
    """The GPU of a rank from RELION's ``--gpu`` syntax: "0:1:2:3" gives the ranks of a host GPUs 0, 1, 2, 3 in
    turn (rank ``local`` takes entry ``local % 4``; an entry "0,1" (RELION's threads) uses its first GPU); "2"
    or 2 puts every rank on GPU 2; empty or None: GPU ``local % n_devices`` when ``n_devices`` is given, else
    None (the backend's default)."""
    if spec is None or str(spec).strip() == "":
        return None if not n_devices else local % n_devices
    fields = [f for f in str(spec).strip().split(":") if f.strip()]
    if not fields:
        return None if not n_devices else local % n_devices
    entry = fields[local % len(fields)].split(",")[0].strip()
    if not entry.isdigit():
        raise ValueError(f"--gpu {spec!r}: expected GPU numbers separated by ':' (RELION's syntax, e.g. 0:1:2:3)")
    return int(entry)


#: Variables that give a rank's index in the whole job (before MPI is initialised).
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK", "SLURM_PROCID")


def launcher_rank(environ: dict | None = None) -> int | None:
    """This process's rank as its launcher says (None when not under an MPI launcher)."""
    env = os.environ if environ is None else environ
    if not launched_by_mpi(env):
        return None
    for v in RANK_VARIABLES:
        if env.get(v, "").strip().isdigit():
            return int(env[v])
    return None


def rank_error(message: str, code: int) -> int:
    """Report an error that ends the job: under MPI (MPI initialised, several ranks) print it and abort every
    rank, since the others would wait for this one in their next collective; else print it and return
    ``code``."""
    w = _world
    if w is not None and w.size > 1:
        w.abort(message, code)
    print(message, file=sys.stderr, flush=True)
    return code


def rank_prefix() -> str:
    """"rank R of N on HOST: " under MPI, "" otherwise (for messages that name the failing rank)."""
    w = _world
    if w is not None and w.size > 1:
        return f"rank {w.rank} of {w.size} on {w.host}: "
    r = launcher_rank()
    return "" if r is None else f"rank {r} on {socket.gethostname()}: "
