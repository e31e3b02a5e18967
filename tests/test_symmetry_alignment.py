"""Putting a C1 map onto a point group's axes and applying the group (compute/symmetry_alignment.py), against
maps made symmetric by construction and then turned and shifted by known amounts."""

import numpy as np
import pytest

from napari_gpu_relion.compute import symmetry_alignment as sa
from napari_gpu_relion.compute.geometry import euler_to_matrix, symmetry_generators, symmetry_group

N = 40
R0 = euler_to_matrix(37.0, 71.0, 113.0)  # the unknown turn of the test maps
SHIFT = np.array([1.5, -2.0, 1.0])  # and their shift (z, y, x voxels)


def _blobs(seed: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    z, y, x = np.indices((N, N, N)) - N // 2
    vol = np.zeros((N, N, N))
    for _ in range(12):
        c = rng.uniform(-9, 9, 3)
        vol += np.exp(-((z - c[0]) ** 2 + (y - c[1]) ** 2 + (x - c[2]) ** 2) / (2 * 2.0**2))
    return vol


def _cc(a, b) -> float:
    return float(np.corrcoef(np.ravel(a), np.ravel(b))[0, 1])


def test_symmetrize_with_quarter_turns_equals_the_average_of_exact_grid_rotations():
    """C4 about z turns the grid onto itself (about voxel N // 2), so the average must equal the mean of the
    four np.rot90 copies in the (y, x) plane, away from the box edge that the turn moves out of the box."""
    vol = _blobs()
    got = sa.symmetrize(vol, symmetry_group("C4").matrices, order=1)
    c = N // 2
    inner = vol[:, 1:, 1:]  # indices -c+1 .. c-1 around the centre: symmetric, so rot90 is the turn about c
    want = np.mean([np.rot90(inner, k, axes=(1, 2)) for k in range(4)], axis=0)
    np.testing.assert_allclose(got[:, 1:, 1:][:, 2:-2, 2:-2], want[:, 2:-2, 2:-2], atol=1e-12)
    assert not np.allclose(got[c], vol[c], atol=1e-3)  # the map itself is not C4-symmetric


@pytest.mark.slow
@pytest.mark.parametrize("sym", ["C3", "D2"])
def test_a_turned_and_shifted_symmetric_map_is_put_back_on_the_axes(sym):
    matrices = symmetry_group(sym).matrices
    truth = sa.symmetrize(_blobs(), matrices)
    given = sa._shift(sa.rotate_map(truth, R0, 3), SHIFT)
    out, al = sa.align_and_symmetrize(given, sym, 4.0, resolution_A=16.0, box=24, step_deg=15.0)
    assert al["score_unaligned"] < 0.7 < 0.97 < al["score"]  # not symmetric as given; symmetric once turned
    # the group's axes in the given map are R0's images of the canonical ones; the found turn takes them back
    # onto coordinate axes (any of D2's three 2-folds may become z: all are D2 frames)
    back = al["matrix"] @ R0
    err = np.degrees(np.arccos(np.clip(np.abs(back).max(axis=1), -1, 1)))
    if sym.startswith("C"):
        assert err[2] < 1.5, err  # the n-fold axis on z (either way up)
    else:
        assert err.max() < 1.5, err
    # and the symmetrised output is the truth up to what the search cannot see (Cn: a turn about z and the axis
    # upside down; D2: which 2-fold goes on z, a cube rotation) and a shift along the axis: compare centred copies
    t = sa._shift(truth, sa.center_of_mass_shift(truth))
    o = sa._shift(out, sa.center_of_mass_shift(out))
    if sym.startswith("C"):
        flips = [np.eye(3), np.diag([1.0, -1.0, -1.0])]
        turns = [euler_to_matrix(0.0, 0.0, a) @ f for f in flips for a in np.arange(0, 120, 2.0)]
    else:
        turns = list(symmetry_group("O").matrices)
    best = max(_cc(sa.rotate_map(t, T, 3), o) for T in turns)
    assert best > 0.95, best


def test_generators_make_the_whole_group():
    for sym in ("C1", "C7", "D3", "T", "O", "I2"):
        g = symmetry_group(sym)
        gens = symmetry_generators(sym)
        assert len(gens) <= 3
        members = [np.eye(3)]
        changed = True
        while changed:
            changed = False
            for A in list(members):
                for s in gens:
                    B = s @ A
                    if not any(np.allclose(B, m, atol=1e-6) for m in members):
                        members.append(B)
                        changed = True
        assert len(members) == g.order, (sym, len(members))


def test_the_turn_about_z_repeats_with_the_group():
    assert sa.z_period_deg(symmetry_group("C1").matrices) == 360.0
    assert sa.z_period_deg(symmetry_group("C5").matrices) == pytest.approx(72.0)
    assert sa.z_period_deg(symmetry_group("D4").matrices) == pytest.approx(90.0)
    assert sa.z_period_deg(symmetry_group("I3").matrices) == pytest.approx(72.0)  # I3: 5-fold on z
