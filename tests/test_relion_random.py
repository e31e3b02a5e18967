"""RELION's random draws (compute/relion_random.py) against the C library itself and against RELION 5.0.1's files."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
from pathlib import Path

import numpy as np
import pytest

from napari_gpu_relion.compute import relion_random as rr
from napari_gpu_relion.compute.schedule import next_perturbation

RELION = json.loads((Path(__file__).parent / "data" / "relion5_class3d_draws.json").read_text())


def _glibc():
    """The C library when it is glibc (its rand() is the generator RELION's Linux builds draw from), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):
        return None
    return libc


def test_the_first_rand_after_srand_is_glibcs():
    libc = _glibc()
    if libc is None:
        pytest.skip("the C library here is not glibc")
    seeds = np.concatenate([np.random.default_rng(0).integers(0, 2**32, 3000),
                            [0, 1, 2, 3, 2**31 - 1, 2**31, 2**31 + 5, 2**32 - 1]])
    expected = []
    for s in seeds:
        libc.srand(ctypes.c_uint(int(s)))
        expected.append(libc.rand())
    np.testing.assert_array_equal(rr.glibc_first_rand(seeds), np.array(expected))


def test_mt19937_is_the_standard_generator():
    """The C++ standard: a default-seeded (5489) std::mt19937's 10000th output is 4123659995."""
    g = rr._MT19937(5489)
    out = [g() for _ in range(10000)]
    assert out[:2] == [3499211612, 581869302] and out[-1] == 4123659995


def test_class_seeds_are_relions_for_every_particle():
    """RELION's iteration-1 class of each of its 2,000 particles (seed 1, K=2), and RELION's iteration-1 class sizes
    for seeds 1-3 and K=2 and 4 (the sizes repeat between seeds: seed s+1 takes seed s's rand() sequence shifted by
    one particle)."""
    relion = np.array([int(c) - 1 for c in RELION["it001_classes_in_star_order"]])
    ours = rr.relion_seed_classes(RELION["n"], RELION["K"], RELION["seed"])
    np.testing.assert_array_equal(ours, relion)
    for key, sizes in RELION["it001_class_sizes_sorted"].items():
        K, seed = int(key[1]), int(key.split("seed")[1])
        got = np.bincount(rr.relion_seed_classes(RELION["n"], K, seed), minlength=K)
        assert sorted(got.tolist()) == sizes, key


def test_sampling_perturbations_are_relions():
    """RELION's rlnSamplingPerturbInstance of iterations 1-6 (seed 1), written with 6 digits."""
    p, ours = 0.0, []
    for it in range(7):
        p = next_perturbation(p, RELION["seed"], it)
        ours.append(p)
    np.testing.assert_allclose(ours[1:], RELION["rlnSamplingPerturbInstance_it001_to_it006"], atol=6e-6)


def test_sampling_perturbations_are_relions_for_other_seeds():
    """RELION's rlnSamplingPerturbInstance of iterations 0-11 of auto-refines with --random_seed 1-4: the
    setup draw (iteration 0) is the same for every seed (RELION sets up its sampling before it seeds the C library),
    the later ones follow the seed."""
    runs = json.loads((Path(__file__).parent / "data" / "relion5_refine3d_perturbations.json").read_text())
    for key, relion in runs["rlnSamplingPerturbInstance_it000_to_it011"].items():
        p, ours = 0.0, []
        for it in range(len(relion)):
            p = next_perturbation(p, int(key[4:]), it)
            ours.append(p)
        np.testing.assert_allclose(ours, relion, atol=6e-6, err_msg=key)


@pytest.mark.parametrize("n", [1, 2, 7, 10, 65535, 65536, 70001])
def test_particle_orders_are_permutations_that_follow_the_seed(n):
    """Both of libstdc++'s shuffle paths (pairs of swaps below 65,536 elements, one swap per draw above) give a
    permutation; another seed another one. Only the first path is checked against RELION's files (2,000
    particles, above)."""
    a = rr.relion_particle_order(n, 3)
    np.testing.assert_array_equal(np.sort(a), np.arange(n))
    if n >= 7:
        assert not np.array_equal(a, rr.relion_particle_order(n, 4))


def test_perturbations_wrap_into_the_closed_interval():
    assert rr.wrap_perturbation(0.5) == 0.5 and rr.wrap_perturbation(-0.5) == -0.5
    assert rr.wrap_perturbation(0.75) == pytest.approx(-0.25) and rr.wrap_perturbation(-0.9) == pytest.approx(0.1)
    steps = [rr.perturbation_step(11, it) for it in range(50)]
    assert all(0.25 <= s <= 0.5 for s in steps)
