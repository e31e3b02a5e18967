"""Results do not depend on how particles are grouped into batches: the noise that fills the area outside the
particle mask is drawn per particle (compute/noise.py), not per batch, so refine3d, class3d and class2d give the
same angles and classes for any --batch (to float rounding). This is also what MPI ranks will rely on."""

from pathlib import Path

import numpy as np
import pytest
import starfile

from napari_gpu_relion.compute.geometry import angular_distance_deg, euler_to_matrix
from napari_gpu_relion.compute.noise import counter_normal
from napari_gpu_relion.errors import InputError
from napari_gpu_relion.jobs import class2d, class3d, refine3d
from napari_gpu_relion.jobs.simulate import make_sample_data

ANG = ("rlnAngleRot", "rlnAngleTilt", "rlnAnglePsi")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_sample_data(tmp_path_factory.mktemp("batches"), box=32, angpix=6.0, n_particles=160, snr=0.2,
                            diameter=134.4, ini_high=60.0, n_micrographs=0)


def _particles(star: Path):
    return starfile.read(star)["particles"]


def _same(a, b) -> tuple[float, float]:
    """Fractions of particles with the same orientation (< 0.01°) and the same class."""
    A = euler_to_matrix(*(a[c].to_numpy() for c in ANG))
    B = euler_to_matrix(*(b[c].to_numpy() for c in ANG))
    same_angle = float((angular_distance_deg(A, B) < 0.01).mean())
    return same_angle, float((a["rlnClassNumber"].to_numpy() == b["rlnClassNumber"].to_numpy()).mean())


def test_counter_noise_is_per_particle_and_standard_normal():
    """The same particle gets the same noise whatever else is in its batch; the values are N(0, 1) (1.3 million
    draws: mean within 0.005, variance within 0.01, neighbours uncorrelated within 0.005)."""
    g = counter_normal(11, np.arange(300), (2, 32, 17))
    part = counter_normal(11, np.array([7, 299, 0]), (2, 32, 17))
    np.testing.assert_array_equal(part, g[[7, 299, 0]])
    assert not np.allclose(counter_normal(12, np.arange(3), (2, 32, 17)), g[:3])
    big = counter_normal(3, np.arange(1000), (1300,)).reshape(-1)
    assert abs(big.mean()) < 0.005 and abs(big.var() - 1) < 0.01
    assert abs(np.corrcoef(big[:-1], big[1:])[0, 1]) < 0.005


def test_class2d_classes_do_not_depend_on_the_batch(data, tmp_path):
    """K=4, one iteration, noise-filled masks: batches of 160, 50 and 13 particles give the same classes and
    in-plane angles for >= 99.5 % of the particles (with the noise drawn per batch, 5-11 % of the particles changed
    class between batch sizes, as reported in issue 16)."""
    out = {}
    for b in (160, 50, 13):
        list(class2d.run(class2d.Params(i=data / "particles.star", o=tmp_path / f"b{b}" / "run", K=4, iter=1,
                                        ctf=True, particle_diameter=150.0, batch=b, cpu=True)))
        out[b] = _particles(tmp_path / f"b{b}" / "run_it001_data.star")
    for b in (50, 13):
        same_angle, same_class = _same(out[160], out[b])
        assert same_angle >= 0.995 and same_class >= 0.995, (b, same_angle, same_class)


@pytest.mark.slow
def test_class3d_and_refine3d_do_not_depend_on_the_batch(data, tmp_path):
    """class3d (K=2, 2 iterations) and refine3d (one iteration and the final one), noise-filled masks: the same
    angles and classes for >= 99.5 % of the particles with batches of 160 and 37."""
    for b in (160, 37):
        list(class3d.run(class3d.Params(i=data / "particles.star", ref=data / "reference.mrc",
                                        o=tmp_path / f"c{b}" / "run", K=2, iter=2, healpix_order=1, ctf=True,
                                        particle_diameter=150.0, batch=b, cpu=True)))
        list(refine3d.run(refine3d.Params(i=data / "particles.star", ref=data / "reference.mrc",
                                          o=tmp_path / f"r{b}" / "run", healpix_order=1, auto_iter_max=1, ctf=True,
                                          particle_diameter=150.0, batch=b, cpu=True)))
    for name in ("c{}/run_it002_data.star", "r{}/run_data.star"):
        same_angle, same_class = _same(_particles(tmp_path / name.format(160)), _particles(tmp_path / name.format(37)))
        assert same_angle >= 0.995 and same_class >= 0.995, (name, same_angle, same_class)


def test_a_batch_below_one_is_refused(data, tmp_path):
    with pytest.raises(InputError, match="--batch"):
        class2d.Params(i=data / "particles.star", o=tmp_path / "x" / "run", batch=-5)
    with pytest.raises(InputError, match="--batch"):
        refine3d.Params(continue_from=tmp_path / "any_optimiser.star", batch=-1)
    with pytest.raises(InputError, match="--j must be at least 1 thread"):
        class3d.Params(i=data / "particles.star", ref=data / "reference.mrc", o=tmp_path / "y" / "run", j=-2)


def test_tf32_on_the_cpu_says_it_has_no_effect_and_changes_nothing(data, tmp_path):
    """--tf32 is a GPU option (tests/test_gpu.py checks that it rounds there): on the CPU the job says it has no
    effect and gives bit-identical results."""
    from napari_gpu_relion.events import Message  # noqa: PLC0415

    out, said = {}, {}
    for tf32 in (False, True):
        events = list(class2d.run(class2d.Params(i=data / "particles.star", o=tmp_path / f"t{tf32}" / "run", K=4,
                                                 iter=1, ctf=True, particle_diameter=150.0, cpu=True, tf32=tf32)))
        said[tf32] = [e.text for e in events if isinstance(e, Message) and "--tf32" in e.text]
        out[tf32] = _particles(tmp_path / f"t{tf32}" / "run_it001_data.star")
    assert said == {False: [], True: ["--tf32 has no effect on the CPU: NumPy computes in float32"]}
    for c in (*ANG, "rlnClassNumber", "rlnOriginXAngst", "rlnMaxValueProbDistribution"):
        np.testing.assert_array_equal(out[False][c].to_numpy(), out[True][c].to_numpy(), err_msg=c)


@pytest.mark.slow
def test_cpu_threads_give_the_same_refinement_to_the_bit(data, tmp_path):
    """--j 1 and --j 3: the same angles, offsets and maps to the bit, local searches from the start (HEALPix order
    2): the projections into the score layout and the insertions in chunks run in threads, added in order."""
    from napari_gpu_relion.events import Message
    from napari_gpu_relion.io.mrc import read_mrc

    said = []
    for j in (1, 3):
        said += [e.text for e in refine3d.run(refine3d.Params(
            i=data / "particles.star", ref=data / "reference.mrc", o=tmp_path / f"j{j}" / "run", healpix_order=2,
            auto_local_healpix_order=2, auto_iter_max=1, ctf=True, particle_diameter=150.0, cpu=True, j=j))
            if isinstance(e, Message)]
    assert any("iteration 1: image size" in t and "(local, sigma" in t for t in said)
    a, b = (_particles(tmp_path / f"j{j}" / "run_data.star") for j in (1, 3))
    for c in (*ANG, "rlnOriginXAngst", "rlnOriginYAngst"):
        np.testing.assert_array_equal(a[c].to_numpy(), b[c].to_numpy())
    for name in ("run_class001.mrc", "run_half1_class001_unfil.mrc"):
        np.testing.assert_array_equal(read_mrc(tmp_path / "j1" / name).data, read_mrc(tmp_path / "j3" / name).data)
