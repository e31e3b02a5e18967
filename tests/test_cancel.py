"""Cancel points (issue 18) without Qt: a job running in a cancel scope stops within 2 s of Cancel even inside
one long E-step batch on the CPU, leaves only complete files, and gives bit-identical results with the cancel
points as without them."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from napari_gpu_relion.cancel import cancel_scope, check_cancel
from napari_gpu_relion.compute import expectation as ex
from napari_gpu_relion.errors import JobCancelled
from napari_gpu_relion.events import Message, Progress
from napari_gpu_relion.jobs import class2d, refine3d

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data"


def tutorial_refine3d(out: Path) -> refine3d.Params:
    """Step 8 of docs/tutorial.md on the sample particles (CPU)."""
    return refine3d.Params(i=SAMPLE / "particles.star", o=out / "run", ref=SAMPLE / "reference.mrc", ctf=True,
                           particle_diameter=160, flatten_solvent=True, healpix_order=1, auto_local_healpix_order=3,
                           cpu=True)


def test_check_cancel_raises_only_inside_a_cancelled_scope():
    check_cancel()  # no scope (the command line): a no-op
    flag = threading.Event()
    with cancel_scope(flag.is_set):
        check_cancel()
        flag.set()
        with pytest.raises(JobCancelled):
            check_cancel()
        seen = []
        t = threading.Thread(target=lambda: seen.append(check_cancel()))  # another thread: not this job's scope
        t.start()
        t.join()
        assert seen == [None]
    check_cancel()  # the scope has ended


@pytest.mark.parametrize("shared", [False, True])
def test_batched_matmul_in_blocks_is_bit_identical_to_one_matmul(monkeypatch, shared):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((37, 9, 50)).astype(np.float32)
    b = rng.standard_normal((50, 12) if shared else (37, 50, 12)).astype(np.float32)
    calls = []
    monkeypatch.setattr(ex, "CPU_BLOCK_FLOPS", 2.0 * 9 * 50 * 12 * 5)  # blocks of 5 particles
    out = ex.batched_matmul(a, b, lambda: calls.append(1))
    np.testing.assert_array_equal(out, np.matmul(a, b))
    assert len(calls) == 7  # between the 8 blocks


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "note.txt"}


def test_class2d_results_are_bit_identical_with_the_cancel_points(tmp_path):
    from napari_gpu_relion.jobs.simulate import make_sample_data

    data = make_sample_data(tmp_path / "data", box=32, angpix=6.0, n_particles=60, snr=0.2, diameter=134.4,
                            ini_high=60.0, n_micrographs=0)
    params = {"i": data / "particles.star", "K": 3, "iter": 1, "ctf": True, "particle_diameter": 150.0, "cpu": True}
    list(class2d.run(class2d.Params(o=tmp_path / "plain" / "run", **params)))
    calls = []
    with cancel_scope(lambda: bool(calls.append(1))):  # checked, never cancelled
        events = list(class2d.run(class2d.Params(o=tmp_path / "checked" / "run", **params)))
    assert len(calls) > 10  # the cancel points were reached inside the E-step
    progress = [e for e in events if isinstance(e, Progress)]  # and the progress says "iteration 1 of 1"
    assert progress and all((e.iteration, e.iterations) == (1, 1) for e in progress)
    assert progress[-1].iteration_fraction == 1.0
    plain, checked = _files(tmp_path / "plain"), _files(tmp_path / "checked")
    assert sorted(plain) == sorted(checked) and any(n.endswith(".mrcs") for n in plain)
    for name in plain:
        if name.endswith(".star"):  # STARs name their own folder
            assert plain[name].replace(b"/plain/", b"/checked/") == checked[name], name
        else:  # MRC: the data bit for bit (the header's label holds the time of writing)
            assert plain[name][1024:] == checked[name][1024:] and len(plain[name]) > 1024, name


def test_cancel_stops_refine3d_on_the_cpu_within_2_s_inside_an_estep_batch(tmp_path):
    """The tutorial's 3D auto-refine on the CPU: Cancel 1 s into iteration 1's E-step (one batch holds the whole
    half set, which takes 10-40 s here) stops the job within 2 s; it wrote no iteration file, and no temporary."""
    cancel = threading.Event()
    events: list = []
    outcome: dict = {}

    def work() -> None:
        with cancel_scope(cancel.is_set):
            try:
                for ev in refine3d.run(tutorial_refine3d(tmp_path)):
                    events.append(ev)
            except JobCancelled:
                outcome["cancelled"] = time.perf_counter()

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    deadline = time.perf_counter() + 60
    while not any(isinstance(e, Message) and e.text.startswith("memory plan") for e in events):
        assert time.perf_counter() < deadline and thread.is_alive()
        time.sleep(0.02)
    time.sleep(1.0)
    assert not any(isinstance(e, Progress) for e in events)  # still inside half 1's first (and only) batch
    t0 = time.perf_counter()
    cancel.set()
    thread.join(10)
    assert not thread.is_alive() and "cancelled" in outcome
    assert outcome["cancelled"] - t0 < 2.0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["note.txt"]  # nothing half-written: no iteration files, no temporaries
