"""CuPy vs NumPy agreement on fresh random data (run on a GPU machine: pytest -m gpu)."""

import numpy as np
import pytest

from napari_gpu_relion.compute.backend import gpu_available

pytestmark = pytest.mark.gpu

if not gpu_available():
    pytest.skip("no usable CUDA GPU with CuPy", allow_module_level=True)

import cupy as cp  # noqa: E402

from napari_gpu_relion.compute.backprojector import BackProjector  # noqa: E402
from napari_gpu_relion.compute.ctf import CtfParams, ctf_half_grid  # noqa: E402
from napari_gpu_relion.compute.fourier import rfft_centered  # noqa: E402
from napari_gpu_relion.compute.geometry import euler_to_matrix  # noqa: E402
from napari_gpu_relion.compute.projector import prepare_reference, project  # noqa: E402


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_projector_cupy_matches_numpy():
    rng = np.random.default_rng()
    vol = rng.normal(size=(48, 48, 48))
    ang = rng.uniform([-180, 0, -180], [180, 180, 180], (64, 3))
    A = euler_to_matrix(*ang.T)
    cpu = project(prepare_reference(vol), A)
    gpu = project(prepare_reference(cp.asarray(vol)), cp.asarray(A)).get()
    assert _rel(gpu, cpu) < 1e-5


def test_backprojection_and_reconstruction_cupy_matches_numpy():
    rng = np.random.default_rng()
    N = 32
    imgs = rng.normal(size=(200, N, N)).astype(np.float32)
    ang = rng.uniform([-180, 0, -180], [180, 180, 180], (200, 3))
    A = euler_to_matrix(*ang.T)
    ctf = CtfParams(rng.uniform(1e4, 2e4, 200), rng.uniform(1e4, 2e4, 200), rng.uniform(-180, 180, 200))
    maps = []
    for xp in (np, cp):
        F = rfft_centered(xp.asarray(imgs), 2)
        c = ctf_half_grid(ctf, N, 2.0, xp=xp)
        bp = BackProjector(N, 2, xp=xp)
        bp.insert_images(xp.asarray(A), F * c, c * c)
        bp.enforce_hermitian()
        bp.symmetrise(np.array([np.eye(3), np.diag([-1.0, -1.0, 1.0])]))
        m = bp.reconstruct(tau2=xp.full(N // 2 + 1, 0.01))
        maps.append(m if xp is np else m.get())
    assert _rel(maps[1], maps[0]) < 1e-4
