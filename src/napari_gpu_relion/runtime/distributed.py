"""Scale-out over MPI ranks (mpi4py): the communicator the jobs use, of size 1 when not under MPI, and what the
jobs do with it (sum the E-step, merge per-particle results, pass rank 0's events on, assign fixed work to ranks).

A job is the same code on every rank: it takes its share of the particles or micrographs (``share``), sums
its accumulators with the other ranks (``sum_arrays``, through host buffers), gathers per-item results
(``allgather`` / ``gather``) and lets rank 0 alone write files and yield events (``is_root``). Outside
``mpirun`` / ``srun`` the communicator is ``SingleProcess`` and mpi4py is never imported, so a plain run
neither needs nor loads MPI. MPI is used when a launcher's variables are present (``OMPI_COMM_WORLD_SIZE``,
``PMI_SIZE``, ``PMIX_RANK``, ``MV2_COMM_WORLD_SIZE``, or a SLURM step of several tasks) or when
``NAPARI_GPU_RELION_MPI=1``; ``NAPARI_GPU_RELION_MPI=0`` turns it off.

Sums of device (CuPy) arrays stay on the GPUs when every rank has one. Ranks that share a GPU are summed there by
one of them, the GPU's leader, which reads the others' buffers through CUDA IPC (``_GPUSum``); the leaders (every
rank, when no GPU is shared) sum with each other through NCCL, GPU to GPU (NCCL refuses two ranks on one GPU, hence
the IPC step), or through host buffers where NCCL is missing; then the ranks of each GPU copy their leader's
result. Everything goes through host buffers when some rank has no GPU, when CUDA IPC fails, or when
``NAPARI_GPU_RELION_NCCL=0`` / ``NAPARI_GPU_RELION_IPC=0`` turn the device paths off. ``reduction_path`` says
which path (the EM jobs print it with each iteration's timing).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..compute.backend import get_array_module, host_empty, to_host, use_device
from ..compute.memory_model import SLAB_BYTES
from ..events import Message, Started

if TYPE_CHECKING:  # the E-step's modules are not needed to start a job (the command line imports this one)
    from ..compute.estep import EStepSums

#: Environment variables that a launcher sets in every rank it starts (Open MPI, MPICH/Intel MPI (Hydra, PMI-1/2),
#: PMIx (srun --mpi=pmix, Open MPI 5), MVAPICH2).
LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")
#: Variables that give the rank's index on its own host (for mapping ranks to the GPUs of that host).
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "MV2_COMM_WORLD_LOCAL_RANK",
                        "PMI_LOCAL_RANK")
#: Arrays larger than this are summed on their own, in chunks of this size (bytes); smaller ones are packed into
#: one buffer per dtype, so one E-step's many small sums cost one collective.
CHUNK_BYTES = SLAB_BYTES
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
    #: Bytes of array data this rank has given to the sums, reductions, gathers and sends (the per-rank report)
    bytes_sent = 0

    def __init__(self) -> None:
        self.host = socket.gethostname()

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def local_rank(self) -> int:
        return self.rank

    @property
    def ranks_on_host(self) -> int:
        """How many ranks run on this rank's host (they share its cores: jobs/read_ahead.read_threads)."""
        return 1

    def describe(self) -> str:
        return f"rank {self.rank} of {self.size} on {self.host}"

    def share(self, items: int | np.ndarray) -> np.ndarray:
        """This rank's contiguous block of ``items`` (a count: its indices; an array: its elements), in rank
        order, blocks as equal as they can be (np.array_split's): micrographs, reconstructions' particles."""
        items = np.arange(items) if np.isscalar(items) else np.asarray(items)
        return np.array_split(items, self.size)[self.rank]

    def deal(self, items: int | np.ndarray, owner: np.ndarray | None = None) -> np.ndarray:
        """This rank's runs of ``items`` (deal_runs of them, np.array_split's), in order: the runs dealt in turn
        (deal_owners), or ``owner`` (the rank of each run: rebalance_owners' after measured speeds). Every rank
        gets the same mix of the set whatever its order (particles written state by state, micrograph by
        micrograph or sorted by defocus cost unequally per particle), so equal counts take equal time."""
        items = np.arange(items) if np.isscalar(items) else np.asarray(items)
        runs = np.array_split(items, deal_runs(len(items), self.size))
        owner = deal_owners(len(runs), self.size) if owner is None else owner
        mine = [r for r, o in zip(runs, owner, strict=True) if o == self.rank]
        return np.concatenate(mine) if mine else items[:0]

    reduction_path = "none (one process)"

    def prepare_device_sum(self) -> None:
        """Decide how device arrays will be summed before the first sum (collective: every rank, once its GPU is
        chosen); NCCL's communicator is then made in the background while the job starts (nothing without MPI)."""

    def sum_arrays(self, arrays: list) -> None:
        """Sum each NumPy/CuPy array over the ranks, in place (every rank gets the same sums)."""

    def reduce_arrays(self, arrays: list, root: int) -> None:
        """Sum each NumPy/CuPy array over the ranks into rank ``root``'s arrays, in place; the other ranks' arrays
        are left with unspecified values (they must not be used)."""

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

    def bcast(self, obj: Any, root: int = 0) -> Any:
        """Rank ``root``'s ``obj`` on every rank."""
        return obj

    def send_arrays(self, arrays: list, source: int, dest: int) -> None:
        """Copy rank ``source``'s NumPy/CuPy arrays into rank ``dest``'s arrays of the same shapes, in place
        (the other ranks do nothing)."""

    def allgather_rows(self, rows, counts: Sequence[int], pinned: bool = False) -> np.ndarray:
        """Every rank's block of rows (along the first axis) on every rank, on the host, in rank order: ``rows``
        is this rank's block (NumPy or CuPy, ``counts[rank]`` rows, possibly none; the same dtype and row shape on
        every rank). ``pinned``: a device block comes back in page-locked memory (to_host)."""
        return np.asarray(to_host(rows, pinned=pinned))

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
        shared = self.comm.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks of this host (collective: every rank)
        self._local = lr if lr is not None else shared.Get_rank()
        self._on_host = shared.Get_size()
        shared.Free()
        self._gpu_sum: _GPUSum | None | bool = False  # not decided yet (see _device_sum)
        self._nccl_starting = False  # NCCL's communicator is being made in the background (prepare_device_sum)
        self.reduction_path = "host buffers (MPI)"

    @property
    def local_rank(self) -> int:
        return self._local

    @property
    def ranks_on_host(self) -> int:
        return self._on_host

    def _allreduce_host(self, buf: np.ndarray) -> None:
        flat = buf.reshape(-1)
        step = max(1, CHUNK_BYTES // max(flat.itemsize, 1))
        for i in range(0, flat.size, step):
            self.comm.Allreduce(self.MPI.IN_PLACE, flat[i:i + step], op=self.MPI.SUM)

    def sum_arrays(self, arrays: list) -> None:
        self.bytes_sent += sum(int(a.nbytes) for a in arrays)
        on_gpu = [get_array_module(a) is not np and np.dtype(a.dtype).name in NCCL_DTYPES for a in arrays]
        dev = self._device_sum() if any(on_gpu) else None  # collective: every rank passes the same kinds of arrays
        if dev is not None:
            dev.sum([a for a, k in zip(arrays, on_gpu, strict=True) if k])
            arrays = [a for a, k in zip(arrays, on_gpu, strict=True) if not k]
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

    def reduce_arrays(self, arrays: list, root: int) -> None:
        """MPI_Reduce of each array to ``root`` (NCCL's reduce when every rank has a GPU of its own; ranks that
        share a GPU sum everything through it, as sum_arrays, since their sums already meet on one device)."""
        if self.rank != root:
            self.bytes_sent += sum(int(a.nbytes) for a in arrays)
        on_gpu = [get_array_module(a) is not np and np.dtype(a.dtype).name in NCCL_DTYPES for a in arrays]
        dev = self._device_sum() if any(on_gpu) else None  # collective, as in sum_arrays
        if dev is not None:
            dev.reduce([a for a, k in zip(arrays, on_gpu, strict=True) if k], root)
            arrays = [a for a, k in zip(arrays, on_gpu, strict=True) if not k]
        for a in arrays:
            host = np.ascontiguousarray(to_host(a))
            flat = host.reshape(-1)
            step = max(1, CHUNK_BYTES // max(flat.itemsize, 1))
            for i in range(0, flat.size, step):
                part = flat[i:i + step]
                if self.rank == root:
                    self.comm.Reduce(self.MPI.IN_PLACE, part, op=self.MPI.SUM, root=root)
                else:
                    self.comm.Reduce(part, None, op=self.MPI.SUM, root=root)
            if self.rank == root:
                _store(a, host)

    def prepare_device_sum(self) -> None:
        """Decide how device arrays are summed now, not at the first sum (collective: every rank calls it once its
        GPU is chosen). NCCL's communicator is made in a background thread while the job reads its particles and
        makes its first references: made at the first sum, it cost the end of iteration 1 0.5-0.7 s on 2 H200s
        (thirty-ninth session), time that more GPUs add and do not shorten."""
        if self._gpu_sum is False:
            self._decide_device_sum(early=True)

    def _device_sum(self) -> _GPUSum | None:
        """How device arrays are summed, decided by all ranks together at the first sum of device arrays (or at
        prepare_device_sum): a ``_GPUSum`` (CUDA IPC within a shared GPU, NCCL or host buffers between GPUs), or
        None (host buffers: some rank has no GPU, or the device paths failed or were turned off). Collective."""
        if self._gpu_sum is False:
            self._decide_device_sum(early=False)
        if self._nccl_starting:  # every rank, at the same first sum: whether each leader's NCCL started
            self._nccl_starting = False
            nccl_comm, why = (self._gpu_sum.nccl.result() if self._gpu_sum is not None
                              and isinstance(self._gpu_sum.nccl, _NcclStarting) else (None, ""))
            failed = next((w for w in self.comm.allgather(why) if w), "")
            if self._gpu_sum is not None:
                self._gpu_sum.nccl = None if failed else nccl_comm
                if failed and self._gpu_sum.group is None:  # NCCL was the whole path: host buffers instead
                    self._gpu_sum = None
                    self.reduction_path = f"host buffers (MPI; NCCL failed: {failed})"
                elif failed:  # the GPUs' leaders sum through host buffers, every one of them
                    self.reduction_path = f"CUDA IPC within each GPU, host buffers (MPI; NCCL failed: {failed}) " \
                                          "between GPUs"
        return self._gpu_sum

    def _decide_device_sum(self, early: bool) -> None:
        """The decision of _device_sum (collective). ``early``: NCCL's communicator is started in a background
        thread and its failure, if any, is found out together at the first sum."""
        self._gpu_sum, self.reduction_path = None, "host buffers (MPI)"
        key = None
        if _env_on("NAPARI_GPU_RELION_NCCL") or _env_on("NAPARI_GPU_RELION_IPC"):
            try:
                import cupy  # noqa: PLC0415

                key = (self.host, cupy.cuda.Device().pci_bus_id)
            except Exception:  # noqa: BLE001 - no CuPy or no GPU: host buffers
                key = None
        keys = self.comm.allgather(key)
        if any(k is None for k in keys):
            return
        gpus = list(dict.fromkeys(keys))  # each GPU once, in the order of its first rank
        shared = len(gpus) < len(keys)
        if shared and not _env_on("NAPARI_GPU_RELION_IPC"):
            self.reduction_path = "host buffers (MPI; ranks share a GPU and NAPARI_GPU_RELION_IPC=0)"
            return
        if not shared and not _env_on("NAPARI_GPU_RELION_NCCL"):
            return
        group = self.comm.Split(gpus.index(key), self.rank) if shared else None
        leader = group is None or group.Get_rank() == 0
        leaders = self.comm.Split(0 if leader else self.MPI.UNDEFINED, self.rank)
        with_nccl = len(gpus) > 1 and _env_on("NAPARI_GPU_RELION_NCCL")
        nccl_comm, why_nccl = _nccl_among(leaders, self.rank, early) if leader and with_nccl else (None, "")
        why_ipc, exchange = "", None
        if shared:
            try:
                exchange = _IPCExchange(EXCHANGE_BYTES)
                handle = exchange.handle
            except Exception as exc:  # noqa: BLE001 - any failure means host buffers, decided together below
                handle, why_ipc = None, f"{type(exc).__name__}: {exc}"
            handles = group.allgather(handle)
            if not why_ipc and all(h is not None for h in handles):
                try:
                    exchange.open_peers(handles[1:] if leader else handles[:1])
                except Exception as exc:  # noqa: BLE001
                    why_ipc = f"{type(exc).__name__}: {exc}"
        whys = self.comm.allgather((why_ipc, why_nccl if not shared else ""))
        if any(w[0] for w in whys) or any(w[1] for w in whys):
            what = next(w for pair in whys for w in pair if w)
            self.reduction_path = f"host buffers (MPI; {'CUDA IPC' if shared else 'NCCL'} failed: {what})"
            return
        self._nccl_starting = early and with_nccl
        between = self.comm.allgather(nccl_comm is not None if leader else None)
        between = [b for b in between if b is not None]
        n_gpu = len(gpus)
        if not shared:
            self.reduction_path = "NCCL (GPU to GPU)"
        elif n_gpu == 1:
            self.reduction_path = "CUDA IPC (all ranks share one GPU)"
        else:
            self.reduction_path = ("CUDA IPC within each GPU, " +
                                   ("NCCL between GPUs" if all(between) else "host buffers (MPI) between GPUs"))
        self._gpu_sum = _GPUSum(group, leaders if leader else None, nccl_comm, exchange, self.MPI)

    def sum_scalars(self, values: list[float]) -> list[float]:
        buf = np.asarray(values, dtype=np.float64)
        self._allreduce_host(buf)
        return [float(v) for v in buf]

    def any(self, flag: bool) -> bool:
        return bool(self.comm.allreduce(int(bool(flag)), op=self.MPI.MAX))

    def allgather(self, obj: Any) -> list:
        self.bytes_sent += payload_bytes(obj)
        return self.comm.allgather(obj)

    def gather(self, obj: Any) -> list | None:
        return self.comm.gather(obj, root=0)

    def bcast(self, obj: Any, root: int = 0) -> Any:
        return self.comm.bcast(obj, root=root)

    def send_arrays(self, arrays: list, source: int, dest: int) -> None:
        """Point to point through host buffers, in chunks of CHUNK_BYTES."""
        if source == dest or self.rank not in (source, dest):
            return
        if self.rank == source:
            self.bytes_sent += sum(int(a.nbytes) for a in arrays)
        for a in arrays:
            host = np.ascontiguousarray(to_host(a)) if self.rank == source else np.empty(a.shape, a.dtype)
            flat = host.reshape(-1)
            step = max(1, CHUNK_BYTES // max(flat.itemsize, 1))
            for i in range(0, flat.size, step):
                if self.rank == source:
                    self.comm.Send(flat[i:i + step], dest=dest, tag=11)
                else:
                    self.comm.Recv(flat[i:i + step], source=source, tag=11)
            if self.rank == dest:
                _store(a, host)

    def allgather_rows(self, rows, counts: Sequence[int], pinned: bool = False) -> np.ndarray:
        """As SingleProcess.allgather_rows: NCCL's allgather between GPUs of their own (each rank's block padded to
        the largest), one MPI_Allgatherv of host buffers on the host path (counts and places in rows: a row of
        bytes as the datatype, any dtype), and a sum of zero-filled arrays where ranks share a GPU (the IPC path
        sums only). Each rank sends its own rows once, where a sum of the whole zero-filled array sent every row
        2 (n-1) / n times (issue 47: six box-256 maps took 0.54-0.88 s per iteration through host buffers on 2
        H200s, 0.23 s gathered)."""
        counts = [int(c) for c in counts]
        if len(counts) != self.size:
            raise ValueError(f"allgather_rows: {len(counts)} counts for {self.size} ranks")
        if self.any(len(rows) != counts[self.rank]):  # collective: every rank raises, none waits in a gather
            raise ValueError(f"allgather_rows: rank {self.rank} has {len(rows)} rows, the counts say "
                             f"{counts[self.rank]}")
        self.bytes_sent += int(rows.nbytes)
        tail, dtype = tuple(rows.shape[1:]), np.dtype(rows.dtype)
        device_rows = get_array_module(rows) is not np
        on_gpu = device_rows and dtype.name in NCCL_DTYPES
        dev = self._device_sum() if on_gpu else None  # collective: every rank passes the same kind of array
        if dev is not None and dev.group is None and dev.nccl is not None:
            return _nccl_allgather_rows(dev.nccl, rows, counts, pinned)
        if dev is not None:  # ranks share a GPU: the sum of zero-filled arrays, on the devices
            before = self.bytes_sent
            out = _zero_filled_sum(self, get_array_module(rows), (sum(counts), *tail), dtype,
                                   [(sum(counts[:self.rank]), rows)], pinned)
            self.bytes_sent = before  # counted above as its own rows
            return out
        host = np.ascontiguousarray(to_host(rows))
        out = host_empty((sum(counts), *tail), dtype, pinned=pinned and device_rows)
        if out.size == 0:
            return out
        row = self.MPI.BYTE.Create_contiguous(int(np.prod(tail, dtype=np.int64)) * dtype.itemsize).Commit()
        try:
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
            self.comm.Allgatherv([host, len(host), row], [out, (counts, starts), row])
        finally:
            row.Free()
        return out

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


#: Size of each rank's CUDA IPC exchange buffer (bytes) when ranks share a GPU: sums go through it in chunks.
EXCHANGE_BYTES = 1 << 26


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "no", "false", "off")


def _nccl_among(comm, rank: int, early: bool = False):
    """(an NCCL communicator over the ranks of the MPI communicator ``comm``, each on its own GPU, "") or (None, why).
    Every rank of ``comm`` must call it. ``early``: (an _NcclStarting, "") that makes it in the background."""
    uid, why = None, ""
    if comm.Get_rank() == 0:
        try:
            from cupy.cuda import nccl  # noqa: PLC0415

            uid = nccl.get_unique_id() if getattr(nccl, "available", True) else None
            why = "" if uid is not None else "NCCL not available"
        except Exception as exc:  # noqa: BLE001
            why = f"{type(exc).__name__}: {exc}"
    uid, why = comm.bcast((uid, why), root=0)
    if why:
        return None, why
    if early:
        try:  # the warm-up's buffers, here: a rank that cannot have them says so before any rank starts NCCL
            warm = _WarmBuffers()
        except Exception as exc:  # noqa: BLE001
            return None, f"rank {rank}: {type(exc).__name__}: {exc}"
        return _NcclStarting(comm.Get_size(), uid, comm.Get_rank(), rank, warm), ""
    return _make_nccl(comm.Get_size(), uid, comm.Get_rank(), rank)


class _WarmBuffers:
    """Two float32 buffers (1 element and 16 MiB) and a non-blocking stream for NCCL's first sums, made on the
    current device and on that stream: CuPy's pool never hands a block of one stream to another, so the job's own
    kernels cannot be reading a block these sums write, and the sums never wait for the job's kernels."""

    def __init__(self) -> None:
        import cupy  # noqa: PLC0415

        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            self.arrays = [cupy.zeros(n, dtype=np.float32) for n in (1, 4 << 20)]
        self.stream.synchronize()


def _make_nccl(n: int, uid, nccl_rank: int, rank: int, warm: _WarmBuffers | None = None):
    """(NCCL communicator of ``n`` ranks, "") or (None, why) on the current device; ``warm``: then one small and
    one 16 MiB sum on its buffers, so that NCCL's lazy set-up (its kernels, the connections of both protocols)
    happens too, and the buffers are let go only after them."""
    try:
        from cupy.cuda import nccl  # noqa: PLC0415

        comm = nccl.NcclCommunicator(n, uid, nccl_rank)
        if warm is not None:
            for buf in warm.arrays:
                comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                               warm.stream.ptr)
            warm.stream.synchronize()
            warm.arrays.clear()
        return comm, ""
    except Exception as exc:  # noqa: BLE001
        return None, f"rank {rank}: {type(exc).__name__}: {exc}"


class _NcclStarting:
    """An NCCL communicator being made (and warmed on ``warm``) in a background thread on this rank's device;
    ``result()`` waits for it: (communicator, "") or (None, why)."""

    def __init__(self, n: int, uid, nccl_rank: int, rank: int, warm: _WarmBuffers) -> None:
        import threading  # noqa: PLC0415

        import cupy  # noqa: PLC0415

        self._made: tuple = (None, "not made")
        device = cupy.cuda.Device().id  # the thread's current device is its own: the rank's is passed on

        def make() -> None:
            use_device(cupy, device)  # this thread's, for good (compute.backend.use_device)
            self._made = _make_nccl(n, uid, nccl_rank, rank, warm)

        self._thread = threading.Thread(target=make, name="nccl-start", daemon=True)
        self._thread.start()

    def result(self) -> tuple:
        self._thread.join()
        return self._made


class _IPCExchange:
    """A device buffer of this rank that the other ranks on its GPU can read and write through CUDA IPC
    (allocated outside CuPy's pool, so its IPC handle points at its start), and the peers' buffers opened here."""

    def __init__(self, nbytes: int) -> None:
        import cupy  # noqa: PLC0415

        rt = cupy.cuda.runtime
        self.nbytes, self.device = int(nbytes), cupy.cuda.Device().id
        self.ptr = rt.malloc(self.nbytes)
        self.handle = rt.ipcGetMemHandle(self.ptr)
        self.own = self._array(self.ptr)
        self.peers: list = []

    def _array(self, ptr: int):
        import cupy  # noqa: PLC0415

        mem = cupy.cuda.UnownedMemory(ptr, self.nbytes, self, self.device)
        return cupy.ndarray((self.nbytes,), np.uint8, cupy.cuda.MemoryPointer(mem, 0))

    def open_peers(self, handles: list) -> None:
        import cupy  # noqa: PLC0415

        rt = cupy.cuda.runtime
        self.peers = [self._array(rt.ipcOpenMemHandle(h)) for h in handles]


class _GPUSum:
    """Sum CuPy arrays over all ranks in place, on the GPUs.

    ``group``: the MPI communicator of the ranks on this rank's GPU (None when no GPU is shared); its rank 0 is the
    GPU's leader. ``leaders``: the communicator of all leaders (None on the other ranks); ``nccl``: an NCCL
    communicator over the leaders (None: one GPU, or host buffers between GPUs). Per chunk of at most
    ``EXCHANGE_BYTES``: each member copies its values into its exchange buffer; the leader adds its members'
    buffers to its own values in rank order, sums with the other leaders, and puts the result in its exchange
    buffer; each member copies it back. Two barriers per chunk keep the buffers from being reused too early."""

    def __init__(self, group, leaders, nccl_comm, exchange: _IPCExchange | None, MPI) -> None:
        self.group, self.leaders, self.nccl, self.exchange, self.MPI = group, leaders, nccl_comm, exchange, MPI
        self.is_leader = group is None or group.Get_rank() == 0

    def sum(self, arrays: list) -> None:
        if self.group is None:  # every rank has its own GPU: NCCL between all of them
            _nccl_sum(self.nccl, arrays)
        else:
            _reduce_packed(arrays, self._sum_flat)

    def reduce(self, arrays: list, root: int) -> None:
        """The sums on rank ``root`` (NCCL reduce between GPUs of their own; with shared GPUs every rank gets them,
        as ``sum``)."""
        if self.group is None:
            _nccl_sum(self.nccl, arrays, root=root)
        else:
            self.sum(arrays)

    def _sum_flat(self, flat) -> None:
        import cupy  # noqa: PLC0415

        if flat.dtype.kind == "c":
            flat = flat.view(flat.real.dtype)
        stream = cupy.cuda.get_current_stream()
        step = self.exchange.nbytes // flat.itemsize
        own = self.exchange.own.view(flat.dtype)
        peers = [p.view(flat.dtype) for p in self.exchange.peers]
        for i in range(0, flat.size, step):
            part = flat[i:i + step]
            n = part.size
            if not self.is_leader:
                own[:n] = part
                stream.synchronize()
            self.group.Barrier()
            if self.is_leader:
                for p in peers:  # the members in rank order: the same sum on every run
                    part += p[:n]
                if self.leaders is not None and self.leaders.Get_size() > 1:
                    self._between_gpus(part)
                own[:n] = part
                stream.synchronize()
            self.group.Barrier()
            if not self.is_leader:
                part[...] = peers[0][:n]
                stream.synchronize()

    def _between_gpus(self, part) -> None:
        if self.nccl is not None:
            _nccl_sum(self.nccl, [part])
            return
        import cupy  # noqa: PLC0415

        host = cupy.asnumpy(part)
        self.leaders.Allreduce(self.MPI.IN_PLACE, host, op=self.MPI.SUM)
        part[...] = cupy.asarray(host)


def _nccl_sum(comm, arrays: list, root: int | None = None) -> None:
    """Sum CuPy arrays over the ranks in place with NCCL on the current stream (allReduce; reduce to rank ``root``
    of the NCCL communicator when given): large contiguous ones each on their own, the rest packed into one buffer
    per dtype (complex as pairs of reals)."""
    import cupy  # noqa: PLC0415
    from cupy.cuda import nccl  # noqa: PLC0415

    def reduce(buf) -> None:
        flat = buf.reshape(-1)
        if flat.dtype.kind == "c":
            flat = flat.view(flat.real.dtype)
        stream = cupy.cuda.get_current_stream().ptr
        if root is None:
            comm.allReduce(flat.data.ptr, flat.data.ptr, flat.size, _nccl_type(flat.dtype), nccl.NCCL_SUM, stream)
        else:
            comm.reduce(flat.data.ptr, flat.data.ptr, flat.size, _nccl_type(flat.dtype), nccl.NCCL_SUM, root,
                        stream)

    _reduce_packed(arrays, reduce)


def _nccl_allgather_rows(comm, rows, counts: list[int], pinned: bool) -> np.ndarray:
    """Every rank's block of ``rows`` on every rank, on the host, through NCCL's allgather on the current stream:
    each block padded to the largest (NCCL gathers equal counts; a block that fills its part is sent as it is),
    the padding left out on the way to the host (no second gathered copy on the device)."""
    import cupy  # noqa: PLC0415

    n, most = len(counts), max(counts)
    tail = tuple(rows.shape[1:])
    if len(rows) == most and rows.flags.c_contiguous:
        send = rows
    else:
        send = cupy.zeros((most, *tail), dtype=rows.dtype)
        send[:len(rows)] = rows
    recv = cupy.empty((n * most, *tail), dtype=rows.dtype)
    flat_send, flat_recv = send.reshape(-1), recv.reshape(-1)
    if flat_send.dtype.kind == "c":
        flat_send, flat_recv = flat_send.view(flat_send.real.dtype), flat_recv.view(flat_recv.real.dtype)
    stream = cupy.cuda.get_current_stream()
    if most:
        comm.allGather(flat_send.data.ptr, flat_recv.data.ptr, flat_send.size, _nccl_type(flat_send.dtype),
                       stream.ptr)
    stream.synchronize()
    if all(c == most for c in counts):
        return np.asarray(to_host(recv, pinned=pinned))
    out = host_empty((sum(counts), *tail), rows.dtype, pinned=pinned)
    start = 0
    for k, c in enumerate(counts):  # each rank's rows straight to their place on the host
        if c:
            recv[k * most:k * most + c].get(out=out[start:start + c])
        start += c
    return out


def _nccl_type(dtype):
    """NCCL's type of a real NumPy dtype NCCL sums (float64, float32, int64, int32)."""
    from cupy.cuda import nccl  # noqa: PLC0415

    return {np.dtype(np.float64): nccl.NCCL_FLOAT64, np.dtype(np.float32): nccl.NCCL_FLOAT32,
            np.dtype(np.int64): nccl.NCCL_INT64, np.dtype(np.int32): nccl.NCCL_INT32}[np.dtype(dtype)]


def _reduce_packed(arrays: list, reduce) -> None:
    """Apply the in-place collective ``reduce`` to CuPy arrays: a large one (over CHUNK_BYTES / 4) on its own (a
    contiguous copy, written back, when it is a strided view), the others packed into one buffer per dtype; then
    wait for the stream."""
    import cupy  # noqa: PLC0415

    small: dict[np.dtype, list] = {}
    for a in arrays:
        if a.nbytes > CHUNK_BYTES // 4:
            flat = a.reshape(-1) if a.flags.c_contiguous else cupy.ascontiguousarray(a).reshape(-1)
            reduce(flat)
            if not a.flags.c_contiguous:
                a[...] = flat.reshape(a.shape)
        else:
            small.setdefault(np.dtype(a.dtype), []).append(a)
    for group in small.values():
        buf = cupy.concatenate([a.reshape(-1) for a in group])
        reduce(buf)
        i = 0
        for a in group:
            a[...] = buf[i:i + a.size].reshape(a.shape)
            i += a.size
    cupy.cuda.get_current_stream().synchronize()


def payload_bytes(obj: Any) -> int:
    """Bytes of the NumPy/CuPy arrays in ``obj`` (nested lists, tuples and dicts); other values count 0."""
    if hasattr(obj, "nbytes") and hasattr(obj, "dtype"):
        return int(obj.nbytes)
    if isinstance(obj, list | tuple):
        return sum(payload_bytes(x) for x in obj)
    if isinstance(obj, dict):
        return sum(payload_bytes(x) for x in obj.values())
    return 0


def rank_report(per_rank: list[tuple[float, float, int, int, float]]) -> str:
    """One line of each rank's particles, E-step (its own work), wait for the slowest rank, bytes sent and the part
    of its E-step spent reading images in an iteration, from (seconds, seconds, bytes, particles, seconds reading)
    per rank in rank order."""
    def cols(values, fmt):
        return " / ".join(fmt(v) for v in values)
    return (f"per rank: particles {cols([r[3] for r in per_rank], str)}, "
            f"E-step {cols([r[0] for r in per_rank], lambda v: f'{v:.2f}')} s, waiting "
            f"{cols([r[1] for r in per_rank], lambda v: f'{v:.2f}')} s, sent "
            f"{cols([r[2] for r in per_rank], lambda v: f'{v / 1e6:.1f}')} MB, of the E-step reading images "
            f"{cols([r[4] for r in per_rank], lambda v: f'{v:.2f}')} s")


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


def start_up(failure: tuple[str, int] | None) -> int:
    """The ranks' start-up checks (options read, input files present, output folder writable), made collective:
    every rank calls this once, after its own checks, with ``(error line, exit code)`` when they failed, else
    None; it returns the exit code (0: every rank passed, go on).

    Under MPI (several ranks) the ranks exchange their results, so that a check that fails on one rank only (a
    node without the data disk, a file only it cannot read) ends every rank at once rather than leaving the
    others waiting for it in their first collective: rank 0 prints the first failing rank's line (which names
    that rank and its host; how many ranks failed is added when several did) and every rank returns that exit
    code, with no MPI_Abort. Without MPI: prints the line and returns its code. Under a launcher it makes the
    communicator (MPI_Init), which the caller should have done before its checks so that their messages name
    rank and host (``rank_prefix``)."""
    w = world()
    if w.size == 1:
        if failure is None:
            return 0
        print(failure[0], file=sys.stderr, flush=True)
        return failure[1]
    results = w.allgather(failure)
    failed = [r for r, res in enumerate(results) if res is not None]
    if not failed:
        return 0
    line, code = results[failed[0]]
    if w.is_root:
        if len(failed) > 1:
            line += (f" ({len(failed)} of {w.size} ranks failed their start-up checks: ranks "
                     f"{', '.join(map(str, failed))})")
        print(line, file=sys.stderr, flush=True)
    return code


def rank_error(message: str, code: int) -> int:
    """Report an error that ends the job: under MPI (several ranks) print it and abort every rank, since the
    others would wait for this one in their next collective; else print it and return ``code``. Under a
    launcher MPI is initialised here if it was not yet (an abort needs it: a rank that exits before MPI_Init
    leaves the others waiting for it)."""
    w = _world
    if w is None and launched_by_mpi():
        try:
            w = world()
        except RuntimeError:  # no mpi4py: nothing to abort with
            w = None
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


# ----------------------------------------------------------------------------------------------------------
# What the jobs do with the communicator when they run over several MPI ranks: every rank runs the same job on its
# share of the particles (or micrographs); these helpers sum what the E-step accumulated on each rank, merge the
# per-particle results so that every rank holds the whole particle set (the M-step then runs on every rank on
# identical sums and gives identical models), and pass only rank 0's events on. With one process
# (``SingleProcess``) each of them is a no-op.
# ----------------------------------------------------------------------------------------------------------

#: EStepSums fields that are sums over particles (arrays, then scalars); the others describe the shapes.
SUMMED_ARRAYS = ("sigma2", "sumw_group", "pdf_class", "pdf_direction", "offset_sum", "xa", "aa")
SUMMED_SCALARS = ("sigma_offset", "sum_weight", "log_likelihood", "sum_pmax", "n_particles")
SHAPE_FIELDS = ("backprojectors", "n_shells", "n_groups", "n_dirs", "n_scale_groups")
#: The per-particle hidden variables the E-step sets (jobs/em.run_estep), merged from every rank.
PARTICLE_RESULTS = ("angles", "offsets_px", "classes", "pmax", "nr_significant", "log_likelihood", "residual_power")


def accumulator_grids(acc) -> list:
    """The arrays of a BackProjector (data_re, data_im, weight) or of a BackProjectorStack (one array each)."""
    return list(acc.arrays) if hasattr(acc, "arrays") else [acc.data_re, acc.data_im, acc.weight]


def gather_items(comm: SingleProcess, xp, shape: tuple, dtype, mine: dict[int, Any],
                 pinned: bool = False) -> np.ndarray:
    """Every rank's items on every rank, on the host, as one ``shape`` array (``mine``: this rank's items, index
    along the first axis -> array of ``xp``). When the ranks' items are consecutive blocks in rank order (the
    owners of classes and halves: runtime.distributed.owner_blocks) each rank's block travels once
    (allgather_rows); otherwise one sum over the ranks of a zero-filled array holding each rank's items (adding
    zeros leaves every value as its owner made it). A pickled gather of box-256 maps through the host took about 1 s
    per iteration on 2 H200s. ``pinned``: to_host's page-locked copy."""
    keys = sorted(int(i) for i in mine)
    every = comm.allgather(keys)
    if [i for ks in every for i in ks] == list(range(shape[0])):
        rows = (xp.stack([xp.asarray(mine[i]).astype(dtype, copy=False) for i in keys]) if keys
                else xp.empty((0, *shape[1:]), dtype=dtype))
        return comm.allgather_rows(rows, [len(ks) for ks in every], pinned=pinned)
    return _zero_filled_sum(comm, xp, shape, dtype, [(i, xp.asarray(a)[None]) for i, a in mine.items()], pinned)


def _zero_filled_sum(comm: SingleProcess, xp, shape: tuple, dtype, blocks: list[tuple[int, Any]],
                     pinned: bool) -> np.ndarray:
    """One sum over the ranks of a zero-filled ``shape`` array of ``xp`` holding this rank's ``blocks`` (first index
    along the first axis, rows) on the host: every rank's rows, each exactly as its owner made it."""
    full = xp.zeros(shape, dtype=dtype)
    for lo, block in blocks:
        full[lo:lo + len(block)] = block.astype(dtype, copy=False)
    comm.sum_arrays([full])
    return np.asarray(to_host(full, pinned=pinned))


def sum_estep(comm: SingleProcess, sums: EStepSums, acc, owners: list[int | None] | None = None) -> None:
    """Sum one half's E-step accumulators over the ranks, in place: every summed field of ``sums`` on every rank
    (one collective for the small arrays, one for the scalars) and the back-projector grids. ``owners``: the rank
    that reconstructs each member of ``acc`` (a stack's classes, or the one BackProjector), None for every rank;
    a member's grids are summed on its owner alone (MPI_Reduce) and hold partial sums elsewhere. Of the grids only
    the block that insertion up to the accumulators' r_max can reach travels (at low resolution a small part of
    the padded grid; the rest is zero on every rank)."""
    if comm.size == 1:
        return
    from ..compute.backprojector import insertion_reach, support_index  # noqa: PLC0415 (see TYPE_CHECKING)

    grids = accumulator_grids(acc)
    stacked = hasattr(acc, "arrays")
    n = grids[0].shape[0] if stacked else 1
    owners = [None] * n if owners is None else list(owners)
    ix = support_index(grids[0].shape[-acc.ndim:], insertion_reach(acc.pad, acc.r_max), acc.xp)
    for root, lo, hi in owner_blocks(owners):
        part = [g[lo:hi] for g in grids] if stacked else grids
        block = part if ix is None else [g[(Ellipsis, *ix)] for g in part]  # copies of the block
        if root is None:
            comm.sum_arrays(block)
        else:
            comm.reduce_arrays(block, root)
        if ix is not None and root in (None, comm.rank):
            for g, b in zip(part, block, strict=True):
                g[(Ellipsis, *ix)] = b
    comm.sum_arrays([getattr(sums, f) for f in SUMMED_ARRAYS])
    totals = comm.sum_scalars([getattr(sums, f) for f in SUMMED_SCALARS])
    for f, v in zip(SUMMED_SCALARS, totals, strict=True):
        setattr(sums, f, type(getattr(sums, f))(round(v) if f == "n_particles" else v))


def merge_particles(comm: SingleProcess, ps, mine: np.ndarray) -> None:
    """Give every rank the E-step's per-particle results of every other rank's rows (``mine`` on this one)."""
    if comm.size == 1:
        return
    for rows, values in comm.allgather((mine, [getattr(ps, f)[mine] for f in PARTICLE_RESULTS])):
        for f, v in zip(PARTICLE_RESULTS, values, strict=True):
            getattr(ps, f)[rows] = v


def describe_backends(names: list[str]) -> str:
    """"CPU (...)" for one rank; "3 MPI ranks: GPU 0 (...) x 2, GPU 1 (...)" for several."""
    if len(names) == 1:
        return names[0]
    counts = Counter(names)
    parts = [name if c == 1 else f"{name} x {c}" for name, c in counts.items()]
    return f"{len(names)} MPI ranks: " + ", ".join(parts)


def root_events(comm: SingleProcess, events: Iterator) -> Iterator:
    """Run a job's event generator on every rank and pass on rank 0's events only. At the Started event (which
    every rank reaches) rank 0 names the backends of all ranks and, in a Message, each rank's host and process
    id (what a launcher's report of a killed process names)."""
    for ev in events:
        if isinstance(ev, Started) and comm.size > 1:
            ranks = comm.gather((ev.backend, comm.host, os.getpid()))
            if comm.is_root:
                yield dataclasses.replace(ev, backend=describe_backends([b for b, _, _ in ranks]))
                yield Message("MPI ranks (host:pid): " + ", ".join(f"{r} {h}:{pid}" for r, (_, h, pid)
                                                                    in enumerate(ranks)))
            continue
        if comm.is_root:
            yield ev


# ----------------------------------------------------------------------------------------------------------
# Owners of the fixed work of an iteration: what every rank does whatever its particles (preparing each class's
# reference of each half, projecting the coarse slices, reconstructing each class of each half). Each
# reconstruction has one owner (as RELION's MPI M-step, which puts reconstruction i on rank i % (size - 1) + 1;
# here in contiguous blocks, since every rank also runs the E-step): the E-step's grids are summed on their owner
# alone, the owner runs that part of the M-step, and the finished maps are gathered by every rank. Every rank
# prepares every reference and projects every coarse slice (its own E-step needs them).
# ----------------------------------------------------------------------------------------------------------

FIXED_WORK_KINDS = ("prepare reference", "coarse projections", "reconstruction")


@dataclasses.dataclass(frozen=True)
class WorkItem:
    """One item of an iteration's fixed work: ``kind`` (FIXED_WORK_KINDS) of class ``cls`` in half ``half``."""

    kind: str
    cls: int
    half: int


#: Items per run that deal() hands out at once: images of consecutive rows are read from their stack in one read.
DEAL_RUN = 128


def deal_runs(n: int, size: int) -> int:
    """How many runs of about DEAL_RUN items deal() splits n items into: a multiple of ``size``, so that equal
    speeds give every rank the same number of runs (counts within one run of each other)."""
    return max(size, -(-max(n, 1) // (DEAL_RUN * size)) * size)


def deal_owners(n_runs: int, size: int) -> np.ndarray:
    """The rank of each of ``n_runs`` runs dealt in turn: 0, 1, ..., size - 1, 0, 1, ..."""
    return np.arange(n_runs) % size


def rebalance_owners(owner: np.ndarray, run_sizes: np.ndarray, speeds: list[float]) -> np.ndarray:
    """The runs' ranks after moving as few runs as it takes for each rank to hold about its share of the items
    (speeds[r] / sum(speeds)): a rank above its share gives runs spread evenly over those it holds (so both
    ranks keep the same mix of the set) to the ranks below theirs, in rank order. Every other run stays where
    its images are kept."""
    owner = np.asarray(owner, np.int64).copy()
    sizes = np.asarray(run_sizes, np.int64)
    size = len(speeds)
    w = np.maximum(np.asarray(speeds, np.float64), 0.0)
    w = np.full(size, 1.0 / size) if not np.isfinite(w).all() or w.sum() <= 0 else w / w.sum()
    target = w * sizes.sum()
    held = np.bincount(owner, weights=sizes, minlength=size).astype(np.float64)
    given: list[int] = []  # runs to move, in the order the givers give them
    for r in range(size):
        surplus = held[r] - target[r]
        runs = np.flatnonzero(owner == r)
        if surplus <= 0 or runs.size == 0:
            continue
        k = int(min(runs.size, np.floor(surplus / max(sizes[runs].mean(), 1.0) + 0.5)))
        if k > 0:  # k runs evenly spaced over the rank's runs
            given += runs[np.unique(np.linspace(0, runs.size - 1, k + 2)[1:-1].round().astype(np.int64))].tolist()
    for j in given:
        r = int(np.argmax(target - held))  # the rank furthest below its share
        if target[r] - held[r] <= 0:
            break
        held[owner[j]] -= sizes[j]
        owner[j] = r
        held[r] += sizes[j]
    return owner


#: The shares change only when the slowest rank's own E-step took this much longer than the fastest's (time
#: measured on shared cores is noisy: on a 2-core VM two ranks differ by about 10 % with equal shares).
REBALANCE_ABOVE = 1.15


def _slowest_beyond_noise(per_rank: list[tuple[int, float]] | None) -> int | None:
    """The rank whose own E-step took more than REBALANCE_ABOVE times the fastest's, slowest per particle; None
    when the times are within that band or a rank has none."""
    if not per_rank or any(n <= 0 or t <= 0 for n, t in per_rank):
        return None
    times = [t for _, t in per_rank]
    if max(times) <= REBALANCE_ABOVE * min(times):
        return None
    return int(np.argmin([n / t for n, t in per_rank]))


#: The shares move only after this many iterations in a row with the same rank slowest beyond REBALANCE_ABOVE.
REBALANCE_AFTER = 3


def rank_speeds(previous: list[float] | None, recent: Sequence[list[tuple[int, float]]]) -> list[float] | None:
    """Each rank's E-step speed (particles per second of its own work) from (particles, seconds) per rank of the
    iteration just done (``recent[-1]``; the iterations before it precede), averaged with the ``previous``
    estimate (equal speeds before any), when the same rank was the slowest beyond REBALANCE_ABOVE in each of the
    last REBALANCE_AFTER iterations; ``previous`` otherwise.

    Why three: a rank's cost per particle swings with its particles' data for a few iterations. On 2 H200s
    (100,000 particles, class3d K=6) one rank was 16-17 % slower in iterations 3-4 of a 25-iteration run and
    the other 10 % slower in iterations 4-5 of a 5-iteration run on the same data; the share moved after the
    two slow iterations left both ranks as fast per particle as each other and the receiving rank 0.2-0.4 s
    behind in 17 of the next 21 iterations (4.45 s of waiting, fortieth session), the move itself costing
    a read of the moved images from the disk. A persistent difference (a root rank formatting the files,
    1.3-2.3x slower per particle in the thirty-second session) still moves the shares, half way each time: a
    full move after one such iteration gave the other rank 70 % of the set and a 4.7 s wait in the next. A
    share moved for a passing difference moves back once the other rank is the slow one as long."""
    if len(recent) < REBALANCE_AFTER:
        return previous
    slowest = {_slowest_beyond_noise(per_rank) for per_rank in recent[-REBALANCE_AFTER:]}
    if len(slowest) != 1 or None in slowest:
        return previous
    now = np.array([n / t for n, t in recent[-1]], np.float64)
    now /= now.sum()
    before = (np.asarray(previous, np.float64) if previous is not None and len(previous) == len(now)
              else np.ones(len(now)))
    now = 0.5 * (now + before / before.sum())
    return [float(v) for v in now]


def owner_blocks(owners: list[int | None]) -> list[tuple[int | None, int, int]]:
    """(owner, lo, hi) of each run of equal owners in ``owners`` (None: every rank), in order."""
    out: list[tuple[int | None, int, int]] = []
    for i, o in enumerate(owners):
        if out and out[-1][0] == o:
            out[-1] = (o, out[-1][1], i + 1)
        else:
            out.append((o, i, i + 1))
    return out


def describe_owners(assignment: dict[WorkItem, tuple[int, ...]], n_classes: int, n_halves: int) -> str:
    """One line naming the rank that reconstructs each class (of each half), or that every rank does."""
    parts = []
    for h in range(n_halves):
        for o, lo, hi in owner_blocks(owners(assignment, "reconstruction", n_classes, h)):
            what = (f"class {lo + 1}" if hi - lo == 1 else f"classes {lo + 1}-{hi}") if n_classes > 1 else "the map"
            half = f" of half {h + 1}" if n_halves > 1 else ""
            parts.append(f"{what}{half} on {'every rank' if o is None else f'rank {o}'}")
    return "reconstructions (M-step): " + ", ".join(parts)


def fixed_work(n_classes: int, n_halves: int) -> tuple[WorkItem, ...]:
    """Every fixed work item of an iteration with ``n_classes`` classes in ``n_halves`` halves."""
    return tuple(WorkItem(kind, k, h) for kind in FIXED_WORK_KINDS for h in range(n_halves) for k in range(n_classes))


def assign(items: tuple[WorkItem, ...], comm: SingleProcess, owned_kinds: tuple[str, ...] = ("reconstruction",)
           ) -> dict[WorkItem, tuple[int, ...]]:
    """The ranks that do each item. Items of ``owned_kinds`` get one owner each: in (half, class) order, split
    into contiguous blocks as equal as they can be, one block per rank in rank order (K classes on K ranks: one
    each; the two halves of auto-refine on ranks 0 and 1). Every rank does the other items (each rank's E-step
    needs every prepared reference and coarse projection)."""
    everyone = tuple(range(comm.size))
    out = {item: everyone for item in items}
    for kind in owned_kinds:
        mine = sorted((w for w in items if w.kind == kind), key=lambda w: (w.half, w.cls))
        for r, block in enumerate(np.array_split(np.arange(len(mine)), comm.size)):
            for i in block:
                out[mine[i]] = (r,)
    return out


def owners(assignment: dict[WorkItem, tuple[int, ...]], kind: str, n_classes: int, half: int) -> list[int | None]:
    """The owner rank of each class's ``kind`` item in ``half``: None where every rank does it."""
    out: list[int | None] = []
    for k in range(n_classes):
        ranks = assignment[WorkItem(kind, k, half)]
        out.append(ranks[0] if len(ranks) == 1 else None)
    return out


def owned(assignment: dict[WorkItem, tuple[int, ...]], kind: str, comm: SingleProcess) -> set[tuple[int, int]]:
    """(class, half) of the items of ``kind`` that this rank does."""
    return {(w.cls, w.half) for w, ranks in assignment.items() if w.kind == kind and comm.rank in ranks}
