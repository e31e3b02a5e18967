"""The registry of fused GPU ops (runtime/kernels.py): every kernel of the sources is declared, every op's twin
agrees with an independent NumPy calculation on the CPU, and on a GPU every op of every specialisation equals its
twin (pyTME's backend test is the model: one walk over the registry instead of one test per kernel)."""

from __future__ import annotations

import numpy as np
import pytest

from napari_gpu_relion.compute.backend import gpu_available
from napari_gpu_relion.runtime import kernels


def test_every_kernel_of_the_sources_is_in_the_registry_once():
    declared = [name for op in kernels.REGISTRY for name in op.kernels]
    assert len(declared) == len(set(declared))
    assert set(declared) == kernels.kernels_in_sources()
    assert all(op.specialisations for op in kernels.REGISTRY)


def test_the_twins_equal_direct_calculations():
    """The explicit twins against loops that add one value at a time in float64 (the ops without an explicit twin
    are twinned by the array code, which the science tests check)."""
    by_name = {op.name: op for op in kernels.REGISTRY}
    rng = np.random.default_rng(3)
    inp = by_name["binned sum"].example(rng, "weights")
    want = np.zeros((3, inp["nbins"]))
    for r in range(3):
        for i, k in enumerate(inp["index"]):
            if k < inp["nbins"]:
                want[r, k] += inp["weights"][r, i]
    np.testing.assert_allclose(by_name["binned sum"].twin(inp), want, rtol=1e-12)
    inp = by_name["segment rows sum"].example(rng, "float32")
    want = np.zeros((inp["n"], inp["values"].shape[1]))
    for e, r in enumerate(inp["rows"]):
        if 0 <= r < inp["n"]:
            want[r] += inp["values"][e]
    np.testing.assert_allclose(by_name["segment rows sum"].twin(inp), want, rtol=1e-12)
    inp = by_name["shifted images"].example(rng, "padded")
    got, K = by_name["shifted images"].twin(inp), inp["g"].shape[1]
    exact = inp["g"].astype(np.complex128)[:, None, :] * inp["ramps"].astype(np.complex128)[None]
    np.testing.assert_allclose(got[..., :K], exact.real, rtol=0, atol=1e-6 * np.abs(exact).max())
    np.testing.assert_allclose(got[..., K:2 * K], exact.imag, rtol=0, atol=1e-6 * np.abs(exact).max())
    assert got.shape[-1] == inp["width"] > 2 * K and not got[..., 2 * K:].any()
    inp = by_name["rows sorted descending"].example(rng, "float32")
    got = by_name["rows sorted descending"].twin(inp)
    assert (np.diff(got, axis=1) <= 0).all() and got.min() == 0.0
    np.testing.assert_array_equal(np.sort(got, axis=1), np.sort(np.maximum(inp["vals"], 0), axis=1))


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU with CuPy")
@pytest.mark.parametrize("op,flag", [(op, f) for op in kernels.REGISTRY for f in op.specialisations],
                         ids=lambda v: v.name if isinstance(v, kernels.FusedOp) else v)
def test_every_fused_op_equals_its_twin(op, flag):
    import cupy as cp  # noqa: PLC0415

    got = kernels.run_op(op, cp, flag, seed=11)
    want = kernels.run_op(op, np, flag, seed=11)
    assert got.shape == want.shape
    if op.close == "exact":
        np.testing.assert_array_equal(got, want)
    else:
        scale = max(float(np.abs(want).max(initial=0)), 1e-30)
        np.testing.assert_allclose(got, want, rtol=op.close, atol=op.close * scale)


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU with CuPy")
def test_build_compiles_every_specialisation():
    report = kernels.build(0)
    assert report["ops"] == sum(len(op.specialisations) for op in kernels.REGISTRY) and not report["stopped"]
