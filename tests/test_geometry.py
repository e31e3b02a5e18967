"""Euler angles, rotation distances and point groups (napari_gpu_relion.compute.geometry)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from scipy.spatial.transform import Rotation

from napari_gpu_relion.compute.geometry import (
    SymmetryGroup,
    angular_distance_deg,
    direction_operators,
    euler_to_matrix,
    matrix_to_euler,
    rotation_about_axis,
    rotation_angle_deg,
    symmetry_group,
    symmetry_matrices,
    view_direction,
)
from napari_gpu_relion.errors import InputError


def _rz(a):
    c, s = np.cos(np.deg2rad(a)), np.sin(np.deg2rad(a))
    return np.array([[c, s, 0.0], [-s, c, 0.0], [0.0, 0.0, 1.0]])


def _ry(b):
    c, s = np.cos(np.deg2rad(b)), np.sin(np.deg2rad(b))
    return np.array([[c, 0.0, -s], [0.0, 1.0, 0.0], [s, 0.0, c]])


@pytest.fixture(scope="module")
def angles():
    rng = np.random.default_rng(7)
    n = 500
    return rng.uniform(-180, 180, n), np.rad2deg(np.arccos(rng.uniform(-1, 1, n))), rng.uniform(-180, 180, n)


# ---------------------------------------------------------------------------------------------------------
# Euler angles
# ---------------------------------------------------------------------------------------------------------

def test_euler_equals_product_of_passive_rotations(angles):
    rot, tilt, psi = angles
    A = euler_to_matrix(rot, tilt, psi)
    assert A.shape == (rot.size, 3, 3) and A.dtype == np.float64
    for i in range(0, rot.size, 25):
        expected = _rz(psi[i]) @ _ry(tilt[i]) @ _rz(rot[i])
        np.testing.assert_allclose(A[i], expected, atol=1e-14)


def test_euler_equals_transpose_of_scipy_zyz(angles):
    rot, tilt, psi = angles
    ref = Rotation.from_euler("ZYZ", np.stack([rot, tilt, psi], 1), degrees=True).as_matrix()
    np.testing.assert_allclose(euler_to_matrix(rot, tilt, psi), np.swapaxes(ref, 1, 2), atol=1e-13)


def test_third_row_is_view_direction(angles):
    rot, tilt, psi = angles
    A = euler_to_matrix(rot, tilt, psi)
    d = view_direction(rot, tilt)
    np.testing.assert_allclose(A[:, 2, :], d, atol=1e-14)
    t, r = np.deg2rad(tilt), np.deg2rad(rot)
    np.testing.assert_allclose(d, np.stack([np.sin(t) * np.cos(r), np.sin(t) * np.sin(r), np.cos(t)], 1),
                               atol=1e-15)


def test_matrices_are_orthonormal_with_det_one(angles):
    A = euler_to_matrix(*angles)
    np.testing.assert_allclose(A @ np.swapaxes(A, 1, 2), np.broadcast_to(np.eye(3), A.shape), atol=1e-14)
    np.testing.assert_allclose(np.linalg.det(A), 1.0, atol=1e-14)


def test_euler_broadcasting_and_scalars():
    assert euler_to_matrix(10.0, 20.0, 30.0).shape == (3, 3)
    A = euler_to_matrix(np.zeros((5, 1)), np.linspace(0, 90, 4)[None, :], 7.0)
    assert A.shape == (5, 4, 3, 3)
    np.testing.assert_allclose(A[2, 3], euler_to_matrix(0.0, 90.0, 7.0), atol=1e-15)
    np.testing.assert_allclose(euler_to_matrix(0, 0, 0), np.eye(3), atol=0)


def test_round_trip_random(angles):
    rot, tilt, psi = angles
    A = euler_to_matrix(rot, tilt, psi)
    r2, t2, p2 = matrix_to_euler(A)
    np.testing.assert_allclose(euler_to_matrix(r2, t2, p2), A, atol=1e-12)
    # Generic tilt: the angles themselves come back (rot, psi in (-180, 180]).
    wrap = lambda a: (a + 180.0) % 360.0 - 180.0  # noqa: E731
    np.testing.assert_allclose(wrap(r2 - rot), 0, atol=1e-9)
    np.testing.assert_allclose(t2, tilt, atol=1e-9)
    np.testing.assert_allclose(wrap(p2 - psi), 0, atol=1e-9)
    assert np.all((t2 >= 0) & (t2 <= 180))


def test_matrix_to_euler_uses_relion_formulas_off_gimbal(angles):
    A = euler_to_matrix(*angles)
    r2, _, p2 = matrix_to_euler(A)
    np.testing.assert_allclose(r2, np.rad2deg(np.arctan2(A[:, 2, 1], A[:, 2, 0])), atol=1e-9)
    np.testing.assert_allclose(p2, np.rad2deg(np.arctan2(A[:, 1, 2], -A[:, 0, 2])), atol=1e-9)


@pytest.mark.parametrize("tilt", [0.0, 180.0, 1e-9, 180.0 - 1e-9, 1e-6, 179.999999, -0.0])
def test_round_trip_gimbal(tilt):
    rots = np.array([-170.0, -45.0, 0.0, 33.0, 180.0])
    psis = np.array([-120.0, 0.0, 10.0, 90.0, 179.0])
    rr, pp = np.meshgrid(rots, psis)
    A = euler_to_matrix(rr, tilt, pp)
    r2, t2, p2 = matrix_to_euler(A)
    np.testing.assert_allclose(euler_to_matrix(r2, t2, p2), A, atol=1e-10)
    if tilt in (0.0, 180.0):  # the gimbal rule: rot = 0, tilt exact, psi carries everything
        assert np.all(r2 == 0.0) and np.all(t2 == tilt)


def test_matrix_to_euler_shape_and_scalar():
    r, t, p = matrix_to_euler(euler_to_matrix(10.0, 20.0, 30.0))
    assert np.shape(r) == () and abs(r - 10) < 1e-12 and abs(t - 20) < 1e-12 and abs(p - 30) < 1e-12


def test_rotation_angle_and_distance():
    A = euler_to_matrix(0.0, 0.0, 0.0)
    assert abs(angular_distance_deg(A, euler_to_matrix(30.0, 0.0, 0.0)) - 30.0) < 1e-12
    assert abs(angular_distance_deg(A, euler_to_matrix(0.0, 179.0, 0.0)) - 179.0) < 1e-9
    assert abs(rotation_angle_deg(rotation_about_axis((1, 2, 3), 1e-7)) - 1e-7) < 1e-15
    rng = np.random.default_rng(3)
    R = Rotation.random(50, random_state=rng)
    Q = Rotation.random(50, random_state=rng)
    expected = np.rad2deg((R * Q.inv()).magnitude())
    got = angular_distance_deg(R.as_matrix(), Q.as_matrix())
    np.testing.assert_allclose(got, expected, atol=1e-9)


@pytest.mark.parametrize("name", ["C4", "D7", "O", "I3", "CS", "D3H", "TH"])
def test_distance_with_symmetry_is_zero_for_mates(name):
    S = symmetry_matrices(name)
    rng = np.random.default_rng(11)
    A = Rotation.random(20, random_state=rng).as_matrix()
    flip = np.diag([-1.0, -1.0, 1.0])
    for s in S:
        if np.linalg.det(s) > 0:
            mate = A @ s.T
        else:  # the proper pose giving the same image: Rz(180)·A·(−S)ᵀ
            mate = flip @ A @ (-s).T
        assert np.all(angular_distance_deg(mate, A, sym=S) < 1e-6)
    B = Rotation.random(20, random_state=rng).as_matrix()
    assert np.all(angular_distance_deg(A, B, sym=name) <= angular_distance_deg(A, B) + 1e-9)


def test_improper_mate_gives_identical_projection_geometry():
    """Pose Rz(180)·A·(−S)ᵀ maps image coordinates to map points that are S-images of A's (same line
    integrals for a map with V(Sx) = V(x))."""
    S = symmetry_matrices("CS")[1]
    A = euler_to_matrix(23.0, 61.0, -17.0)
    mate = np.diag([-1.0, -1.0, 1.0]) @ A @ (-S).T
    r = np.random.default_rng(0).normal(size=(10, 3))
    # A point r of the mate's image frame samples V at mateᵀ r; it must be S times A's sample of r' = r with
    # z flipped (the same ray, traversed the other way).
    flip_z = r * np.array([1.0, 1.0, -1.0])
    np.testing.assert_allclose((mate.T @ r.T).T, (S @ A.T @ flip_z.T).T, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# Point groups
# ---------------------------------------------------------------------------------------------------------

ORDERS = {
    "C1": 1, "C2": 2, "C4": 4, "C7": 7, "C12": 12, "CI": 2, "CS": 2, "C3V": 6, "C4V": 8, "C3H": 6, "C6H": 12,
    "S2": 2, "S4": 4, "S6": 6, "S8": 8, "D1": 2, "D2": 4, "D3": 6, "D7": 14, "D2V": 8, "D3V": 12, "D5V": 20,
    "D2H": 8, "D3H": 12, "D6H": 24, "T": 12, "TD": 24, "TH": 24, "O": 24, "OH": 48,
    "I": 60, "I1": 60, "I2": 60, "I3": 60, "I4": 60, "IH": 120, "I1H": 120, "I2H": 120, "I3H": 120,
    "I4H": 120,
}


@pytest.mark.parametrize("name,order", sorted(ORDERS.items()))
def test_group_order_closure_inverse(name, order):
    S = symmetry_matrices(name)
    assert S.shape == (order, 3, 3) and S.dtype == np.float64
    np.testing.assert_allclose(S[0], np.eye(3), atol=0)
    np.testing.assert_allclose(S @ np.swapaxes(S, 1, 2), np.broadcast_to(np.eye(3), S.shape), atol=1e-12)
    det = np.linalg.det(S)
    np.testing.assert_allclose(np.abs(det), 1.0, atol=1e-12)
    improper = name in ("CI", "CS") or name.endswith(("V", "H")) or name in ("TD", "TH", "OH") or \
        name.startswith("S")
    assert np.sum(det < 0) == (order // 2 if improper else 0)
    flat = S.reshape(order, 9)

    def members(M):  # index of each matrix of M in S (−1 if absent)
        d = np.abs(M.reshape(-1, 1, 9) - flat[None]).max(axis=2)
        return np.where(d.min(axis=1) < 1e-9, d.argmin(axis=1), -1)

    products = np.einsum("aij,bjk->abik", S, S).reshape(-1, 3, 3)
    assert np.all(members(products) >= 0), "not closed under products"
    assert np.all(members(np.swapaxes(S, 1, 2)) >= 0), "inverse missing"
    assert len(np.unique(members(S))) == order, "duplicate members"


def _has_rotation(S, axis, fold):
    axis = np.asarray(axis, float) / np.linalg.norm(axis)
    target = rotation_about_axis(axis, 360.0 / fold)
    return np.abs(S - target).max(axis=(1, 2)).min() < 1e-5


def _has_mirror(S, normal):
    n = np.asarray(normal, float) / np.linalg.norm(normal)
    return np.abs(S - (np.eye(3) - 2 * np.outer(n, n))).max(axis=(1, 2)).min() < 1e-5


# RELION's generator lists (symmetries.cpp), decimals as RELION writes them.
RELION_GENERATORS = {
    "C5": ([(5, (0, 0, 1))], []),
    "D7": ([(7, (0, 0, 1)), (2, (1, 0, 0))], []),
    "C4V": ([(4, (0, 0, 1))], [(0, 1, 0)]),
    "C4H": ([(4, (0, 0, 1))], [(0, 0, 1)]),
    "D3V": ([(3, (0, 0, 1)), (2, (1, 0, 0))], [(1, 0, 0)]),
    "D3H": ([(3, (0, 0, 1)), (2, (1, 0, 0))], [(0, 0, 1)]),
    "CS": ([], [(0, 0, 1)]),
    "T": ([(3, (0, 0, 1)), (2, (0, 0.816496, 0.577350))], []),
    "TD": ([(3, (0, 0, 1)), (2, (0, 0.816496, 0.577350))], [(1.4142136, 2.4494897, 0.0)]),
    "TH": ([(3, (0, 0, 1)), (2, (0, -0.816496, -0.577350))], []),
    "O": ([(3, (0.5773502, 0.5773502, 0.5773502)), (4, (0, 0, 1))], []),
    "OH": ([(3, (0.5773502, 0.5773502, 0.5773502)), (4, (0, 0, 1))], [(0, 1, 1)]),
    "I2": ([(2, (0, 0, 1)), (5, (0.525731114, 0, 0.850650807)), (3, (0, 0.356822076, 0.934172364))], []),
    "I1": ([(2, (1, 0, 0)), (5, (0.85065080702670, 0, -0.5257311142635)), (3, (0.9341723640, 0.3568220765, 0))],
           []),
    "I3": ([(2, (-0.5257311143, 0, 0.8506508070)), (5, (0, 0, 1)),
            (3, (-0.4911234778630044, 0.3568220764705179, 0.7946544753759428))], []),
    "I4": ([(2, (0.5257311143, 0, 0.8506508070)), (5, (0.8944271932547096, 0, 0.4472135909903704)),
            (3, (0.4911234778630044, 0.3568220764705179, 0.7946544753759428))], []),
    "I2H": ([(2, (0, 0, 1)), (5, (0.525731114, 0, 0.850650807))], [(1, 0, 0)]),
    "I1H": ([(2, (1, 0, 0))], [(0, 0, -1)]),
    "I3H": ([(5, (0, 0, 1))], [(0.850650807, 0, 0.525731114)]),
    "I4H": ([(2, (0.5257311143, 0, 0.8506508070))], [(0.850650807, 0, -0.525731114)]),
}


@pytest.mark.parametrize("name", sorted(RELION_GENERATORS))
def test_generator_axes_as_relion_lists(name):
    S = symmetry_matrices(name)
    rots, mirrors = RELION_GENERATORS[name]
    for fold, axis in rots:
        assert _has_rotation(S, axis, fold), f"{name}: no {fold}-fold about {axis}"
        # The axis is fixed by a member of that order.
        a = np.asarray(axis, float) / np.linalg.norm(axis)
        fixed = np.linalg.norm(S @ a - a, axis=1) < 1e-5
        angles = rotation_angle_deg(S[fixed & (np.linalg.det(S) > 0)])
        assert np.any(np.abs(angles - 360.0 / fold) < 1e-4)
    for normal in mirrors:
        assert _has_mirror(S, normal), f"{name}: no mirror normal to {normal}"
    if name == "CI" or name == "TH":
        assert np.abs(S + np.eye(3)).max(axis=(1, 2)).min() < 1e-12


def test_sn_and_ci_follow_relion():
    S = symmetry_matrices("S6")  # C3 about z + inversion
    assert _has_rotation(S, (0, 0, 1), 3)
    assert np.abs(S + np.eye(3)).max(axis=(1, 2)).min() < 1e-12
    assert np.abs(symmetry_matrices("CI")[1] + np.eye(3)).max() < 1e-15


def _same_set(S1, S2):
    d = np.abs(S1.reshape(-1, 1, 9) - S2.reshape(1, -1, 9)).max(axis=2)
    return S1.shape == S2.shape and bool(np.all(d.min(axis=1) < 1e-9))


def test_icosahedral_settings():
    sets = {k: symmetry_matrices(k) for k in ("I1", "I2", "I3", "I4")}
    for a, b in itertools.combinations(sets, 2):
        assert not _same_set(sets[a], sets[b]), f"{a} and {b} are the same"
    assert _same_set(symmetry_matrices("I"), sets["I2"])
    assert _same_set(symmetry_matrices("IH"), symmetry_matrices("I2H"))
    # I1 = I2 turned 90° about z; I3, I4 = I2 turned ∓atan(1/φ) about y. I3 and I4 have a 5-fold on z.
    theta = np.rad2deg(np.arctan(2.0 / (1.0 + 5**0.5)))  # atan(1/φ) = 31.7175°
    for name, R in (("I1", rotation_about_axis((0, 0, 1), 90)), ("I3", rotation_about_axis((0, 1, 0), -theta)),
                    ("I4", rotation_about_axis((0, 1, 0), theta))):
        assert _same_set(R @ sets["I2"] @ R.T, sets[name]), name
    for name in ("I3", "I4"):
        assert _has_rotation(sets[name], (0, 0, 1), 5)
    for name in ("I1", "I2"):  # 2-folds on x, y and z
        for ax in np.eye(3):
            assert _has_rotation(sets[name], ax, 2)
    # I1 and I2 differ by where the 5-folds nearest z lie: yz-plane (I1) vs xz-plane (I2).
    phi = (1 + 5**0.5) / 2
    assert _has_rotation(sets["I1"], (0, 1, phi), 5) and not _has_rotation(sets["I1"], (1, 0, phi), 5)
    assert _has_rotation(sets["I2"], (1, 0, phi), 5) and not _has_rotation(sets["I2"], (0, 1, phi), 5)


def test_names_case_insensitive_and_group_object():
    assert _same_set(symmetry_matrices("c4"), symmetry_matrices("C4"))
    assert _same_set(symmetry_matrices(" d7 "), symmetry_matrices("D7"))
    assert _same_set(symmetry_matrices("i3h"), symmetry_matrices("I3H"))
    g = symmetry_group("o")
    assert isinstance(g, SymmetryGroup) and g.name == "O" and g.order == 24 and g.matrices.shape == (24, 3, 3)
    assert g.is_proper and not symmetry_group("OH").is_proper
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.order = 3  # frozen
    with pytest.raises(ValueError):
        g.matrices[0, 0, 0] = 2.0  # read-only
    m = symmetry_matrices("C2")
    m[0, 0, 0] = 5.0  # a copy: the cached group is unchanged
    assert symmetry_matrices("C2")[0, 0, 0] == 1.0


def test_direction_operators():
    assert direction_operators(symmetry_matrices("I")).shape == (60, 3, 3)
    assert direction_operators(symmetry_matrices("IH")).shape == (60, 3, 3)
    assert direction_operators(symmetry_matrices("CI")).shape == (1, 3, 3)
    ops = direction_operators(symmetry_matrices("CS"))  # mirror z acts on directions as a 2-fold about z
    assert ops.shape == (2, 3, 3) and _has_rotation(ops, (0, 0, 1), 2)
    assert np.all(np.linalg.det(direction_operators(symmetry_matrices("D4H"))) > 0)


@pytest.mark.parametrize("bad", ["X3", "C0", "S3", "I5", "", "D", "C4X", "TT", "O2", "IHH", "7"])
def test_unknown_names_raise_input_error(bad):
    with pytest.raises(InputError) as e:
        symmetry_matrices(bad)
    assert "C1" in str(e.value) or "order" in str(e.value) or "even" in str(e.value) or "name" in str(e.value)


def test_unknown_name_lists_valid_forms():
    with pytest.raises(InputError, match="Dnh"):
        symmetry_group("Q2")


@pytest.mark.gpu
def test_cupy_round_trip():
    cp = pytest.importorskip("cupy")
    from napari_gpu_relion.compute import backend

    if not backend.gpu_available():
        pytest.skip("no usable GPU")
    rot = cp.asarray([10.0, -50.0, 170.0])
    A = euler_to_matrix(rot, cp.asarray([0.0, 45.0, 180.0]), cp.asarray([5.0, 6.0, 7.0]))
    assert isinstance(A, cp.ndarray)
    r, t, p = matrix_to_euler(A)
    assert isinstance(r, cp.ndarray)
    np.testing.assert_allclose(cp.asnumpy(euler_to_matrix(r, t, p)), cp.asnumpy(A), atol=1e-12)


def test_small_turns_are_the_rotation_vectors_of_a_local_search():
    """The 27 neighbours of a local rotation search equal scipy's rotation-vector turns, and include turns about
    x (which Euler-angle steps near the identity cannot make)."""
    from scipy.spatial.transform import Rotation

    from napari_gpu_relion.compute.geometry import small_turns

    s = 4.0
    v = np.radians(s) * np.array([(a, b, c) for a in (-1, 0, 1) for b in (-1, 0, 1) for c in (-1, 0, 1)])
    T = small_turns(s)
    np.testing.assert_allclose(T, Rotation.from_rotvec(v).as_matrix(), atol=1e-14)
    about_x = T[[i for i, w in enumerate(v) if w[0] > 0 and w[1] == 0 and w[2] == 0][0]]
    assert np.isclose(np.degrees(np.arccos(about_x[1, 1])), s) and np.allclose(about_x[0], [1, 0, 0])
