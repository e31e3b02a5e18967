"""napari-gpu-relion warmup: its sets and runs (the compilation itself needs a GPU: benchmarks/kernel_compiles.py)."""

from __future__ import annotations

import pytest

from napari_gpu_relion.errors import InputError
from napari_gpu_relion.jobs import refine3d, warmup
from napari_gpu_relion.jobs.simulate import make_sample_data


@pytest.mark.parametrize("boxes", ["31", "16", "32,a", ""])
def test_bad_boxes_are_refused_in_one_line(boxes):
    with pytest.raises(InputError, match="--boxes"):
        warmup.Params(boxes=boxes)


def test_sets_keep_the_particle_and_grow_to_real_job_sizes():
    sets = warmup.warmup_sets("32,96")
    assert [s["box"] for s in sets] == [32, 96]
    assert [s["n_particles"] for s in sets] == [200, 1000]
    assert {round(s["box"] * s["angpix"], 9) for s in sets} == {192.0}  # the same 192 Å box at both samplings


def test_the_medium_set_runs_relions_whole_auto_refine_schedule(tmp_path):
    data = make_sample_data(tmp_path / "d", box=32, angpix=6.0, n_particles=12, n_micrographs=0)
    full = dict((name, p) for name, _, p in warmup._runs(data, tmp_path / "o", "0", full=True))
    short = dict((name, p) for name, _, p in warmup._runs(data, tmp_path / "o", "0", full=False))
    name = next(n for n in full if n.startswith("3D auto-refine, global"))
    default_max = refine3d.Params.__dataclass_fields__["auto_iter_max"].default
    assert (full[name].healpix_order, full[name].auto_local_healpix_order, full[name].auto_iter_max) == \
        (2, 4, default_max)  # to convergence and the final iteration, as a user's run
    assert short[name].auto_iter_max == 3
    # RELION's GUI passes --norm --scale to every job: the classification's per-class scale sums are compiled too
    cls = next(p for n, p in full.items() if n.startswith("3D classification"))
    assert cls.norm and cls.scale and cls.K > 1


def test_without_a_gpu_nothing_is_compiled():
    if warmup.backend_for(warmup.Params()).is_gpu:
        pytest.skip("a GPU is present: the run would compile")
    events = list(warmup.run(warmup.Params(gpu=None)))
    assert "no GPU" in events[-1].summary
