"""The registry of our fused GPU ops, built ahead of the jobs that use them.

Each fused op (a CUDA kernel of ``compute.gpu_kernels`` or ``compute.gpu_posterior``, or a pair of them) is listed
once with the compute function that runs it, its NumPy twin (the array code the same function runs on NumPy
arrays, or a direct NumPy statement), its specialisations and a small example of its inputs. Like RELION's kernels
(a finite set of template instantiations), every one takes its sizes at run time: a specialisation is a dtype or
a flag (a stacked reference, weights or counts), never a box size, class count or batch shape, so the set is
finite and known here. ``build`` compiles and loads every specialisation through CuPy's public API (a raw
module's ``compile()``, an elementwise kernel's call on the example's arrays); ``napari-gpu-relion warmup`` runs
it first, and every GPU job runs it in a background thread while it reads its particles (``kernel_preload``), so
that none of these kernels is compiled or loaded in an iteration. tests/test_kernel_registry.py walks the
registry: every kernel of the sources is listed, and on a GPU every op equals its twin.

CuPy's own kernels that the E-step calls (its ufuncs, ``take``, scatters and CUB reductions) are not ours to
declare: they are specialised by CuPy on dtypes, the number of dimensions left after merging contiguous axes and
the reduction's length. The package ships the list of those the EM jobs compile (``cupy_kernels``), compiled ahead
by ``warmup`` or, on a machine where they never were, by a job's background thread.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..compute import backprojector, expectation, gpu_kernels, gpu_posterior, projector
from ..compute.backend import raw_module, to_host
from ..compute.sample_prior import SampleLogPrior


@dataclass(frozen=True)
class FusedOp:
    """One fused GPU op: ``run(xp, inputs)`` computes it with arrays of module ``xp`` (CuPy: the fused kernels;
    NumPy: the array code, or ``twin`` where it is given), ``example(rng, flag)`` makes the host inputs of one
    specialisation, and ``close`` says how near the GPU's result must be to the twin's (``"exact"``, or a relative
    tolerance: float64 atomics add in no fixed order, FFTs round differently)."""

    name: str
    kernels: tuple[str, ...]  # CUDA function names (raw modules) or ElementwiseKernel names
    source: str  # the module holding them
    specialisations: tuple[str, ...]  # flags passed to ``example``
    example: Callable[[np.random.Generator, str], dict]
    run: Callable[[object, dict], object]
    twin: Callable[[dict], object] | None = None  # None: ``run`` on NumPy arrays is the twin
    close: str | float = "exact"


def _device(xp, inputs: dict) -> dict:
    return {k: (xp.asarray(v) if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}


# ---------------------------------------------------------------------------------------------------- examples


def _projection_example(rng, flag: str) -> dict:
    N = 16
    K = 2 if flag == "stacked" else 1
    vols = rng.normal(size=(K, N, N, N))
    A = np.stack([np.linalg.qr(rng.normal(size=(3, 3)))[0] for _ in range(5)]).astype(np.float32)
    pix = expectation.pixel_set(N, N)
    return {"vols": vols, "A": A, "kx": pix.kx, "ky": pix.ky, "index": rng.integers(0, K, 5) if K > 1 else None}


def _projection_run(xp, inp: dict):
    d = _device(xp, inp)
    refs = [projector.prepare_reference(d["vols"][k], pad=2) for k in range(d["vols"].shape[0])]
    ref = refs[0] if len(refs) == 1 else projector.stack_references(refs)
    return projector.project_pixels(ref, d["A"], d["kx"], d["ky"], index=d["index"])


def _stacked_projection_example(rng, flag: str) -> dict:
    inp = _projection_example(rng, flag)
    pix = expectation.pixel_set(16, 12)  # a coarse size below the box: its corners beyond radius 6 are zeroed
    inp.update(kx=pix.kx, ky=pix.ky, zero=pix.beyond_radius, source=rng.integers(0, 5, (3, 7)),
               width=expectation.gemm_width(pix.npix) + 16)
    return inp


def _stacked_projection_run(xp, inp: dict):
    """[stacked | power] of the rows ``source`` (I, n): the fused kernel on the GPU, on NumPy the array code it
    replaces (the complex slices, their zeroed corners, as_slices and a take)."""
    d = _device(xp, inp)
    refs = [projector.prepare_reference(d["vols"][k], pad=2) for k in range(d["vols"].shape[0])]
    ref = refs[0] if len(refs) == 1 else projector.stack_references(refs)
    if xp is np:
        P = projector.project_pixels(ref, d["A"], d["kx"], d["ky"], index=d["index"])
        if d["zero"] is not None:
            P[:, d["zero"]] = 0
        S = expectation.as_slices(P, d["width"]).take(d["source"])
        stacked, power = S.stacked.reshape(-1, d["width"]), S.power.reshape(-1, P.shape[1])
    else:
        stacked, power = gpu_kernels.project_stacked(ref.data, d["A"], d["kx"], d["ky"], ref.pad, ref.pad * ref.r_max,
                                                     d["source"], d["width"], index=d["index"], zero=d["zero"])
    return xp.concatenate([stacked, power], axis=1)


def _shifted_example(rng, flag: str) -> dict:
    g = (rng.normal(size=(5, 300)) + 1j * rng.normal(size=(5, 300))).astype(np.complex64)
    return {"g": g, "ramps": np.exp(1j * rng.uniform(0, 2 * np.pi, (9, 300))).astype(np.complex64),
            "width": 2 * 300 + (16 if flag == "padded" else 0)}


def _shifted_twin(inp: dict):
    """[Re | Im | zeros] of g e_t with each float32 product rounded before the sum (the kernel's order; NumPy's
    complex product may fuse a multiply and an add, one rounding less, on CPUs with FMA units)."""
    g, r = inp["g"], inp["ramps"]
    K = g.shape[1]
    gr, gi, rr, ri = g.real[:, None, :], g.imag[:, None, :], r.real[None], r.imag[None]
    out = np.zeros(g.shape[:1] + r.shape[:1] + (max(2 * K, inp["width"]),), np.float32)
    out[..., :K] = gr * rr - gi * ri
    out[..., K:2 * K] = gr * ri + gi * rr
    return out


def _conj_shifted_example(rng, flag: str) -> dict:
    return {"U": rng.normal(size=(5, 9, 600)).astype(np.float32),
            "ramps": np.exp(1j * rng.uniform(0, 2 * np.pi, (9, 300))).astype(np.complex64)}


def _conj_shifted_twin(inp: dict):
    U, K = inp["U"].astype(np.float64), inp["ramps"].shape[1]
    return ((U[..., :K] - 1j * U[..., K:2 * K]) * inp["ramps"][None]).sum(axis=1)


def _insertion_example(rng, flag: str) -> dict:
    N, R = 16, 6
    pix = expectation.pixel_set(N, N)
    A = np.stack([np.linalg.qr(rng.normal(size=(3, 3)))[0] for _ in range(R)])
    values = (rng.normal(size=(R, pix.kx.size)) + 1j * rng.normal(size=(R, pix.kx.size))).astype(np.complex64)
    return {"N": N, "A": A, "kx": pix.kx, "ky": pix.ky, "values": values, "weights": rng.random((R, pix.kx.size))}


def _insertion_run(xp, inp: dict):
    d = _device(xp, inp)
    bp = backprojector.BackProjector(d["N"], pad=2, ndim=3, xp=xp)
    bp.insert_pixels(d["A"], d["kx"], d["ky"], d["values"], d["weights"])
    return xp.stack([bp.data_re, bp.data_im, bp.weight])


def _binned_example(rng, flag: str) -> dict:
    idx = rng.integers(0, 40, 5000)
    return {"index": idx, "weights": None if flag == "counts" else rng.normal(size=(3, idx.size)), "nbins": 37}


def _binned_twin(inp: dict):
    idx, w, nb = inp["index"], inp["weights"], inp["nbins"]
    keep = idx < nb
    rows = np.ones((1, idx.size)) if w is None else np.atleast_2d(w)
    return np.stack([np.bincount(idx[keep], r[keep], minlength=nb)[:nb] for r in rows])


def _segment_example(rng, flag: str) -> dict:
    return {"rows": rng.integers(-1, 30, 700), "values": rng.normal(size=(700, 300)).astype(np.float32), "n": 28}


def _segment_twin(inp: dict):
    rows, vals, n = inp["rows"], inp["values"], inp["n"]
    out = np.zeros((n, vals.shape[1]), np.float64)
    keep = (rows >= 0) & (rows < n)
    np.add.at(out, rows[keep], vals[keep].astype(np.float64))
    return out


def _finish_example(rng, flag: str) -> dict:
    return {"cross": rng.normal(size=(7, 5, 300)).astype(np.float32) * 1e3,
            "pnorm": rng.random((7, 1, 300)).astype(np.float32) * 1e4}


def _any_example(rng, flag: str) -> dict:
    return {"a": rng.random((5, 21, 300)) < 0.02}


def _posterior_example(rng, flag: str) -> dict:
    I, R, C = 4, 30, 24
    return {"diff2": (rng.random((I, R, C)) * 40).astype(np.float32), "table": -rng.random((I, 1, C)) * 3,
            "column": None if flag == "no column" else -rng.random((1, C)), "row_group": R}


def _posterior_run(xp, inp: dict):
    d = _device(xp, inp)
    prior = SampleLogPrior(d["table"], row_group=d["row_group"], column=d["column"])
    w = expectation.posterior_weights(d["diff2"], prior, adaptive_fraction=0.999)
    return xp.stack([w.w.astype(np.float64), w.significant.astype(np.float64)])


def _significant_example(rng, flag: str) -> dict:
    p = rng.random((6, 500)).astype(np.float32)
    p[p < 0.3] = 0
    return {"p": p, "wsig": rng.random(6) * 0.5, "weights": flag == "weights"}


def _significant_twin(inp: dict):
    p, ws = inp["p"], inp["wsig"].astype(np.float32)[:, None]
    sig = (p >= ws) & (p > 0)
    return np.stack([sig, np.where(sig, p, 0)]) if inp["weights"] else sig


def _significant_run(xp, inp: dict):
    d = _device(xp, inp)
    sig, w = gpu_posterior.significant_weights(d["p"].copy(), d["wsig"], d["weights"])
    return xp.stack([sig, w]) if d["weights"] else sig


def _sort_example(rng, flag: str) -> dict:
    v = rng.random((9, 400)).astype(np.float32)
    v[:, ::7] = -1.0
    return {"vals": v}


REGISTRY: tuple[FusedOp, ...] = (
    FusedOp("projection", ("project_gather",), "gpu_kernels", ("one reference", "stacked"), _projection_example,
            _projection_run, close=2e-5),
    FusedOp("projection into the score layout", ("project_stacked",), "gpu_kernels", ("one reference", "stacked"),
            _stacked_projection_example, _stacked_projection_run, close=2e-5),
    FusedOp("shifted images", ("ngr_stacked_shifted",), "gpu_kernels", ("exact width", "padded"), _shifted_example,
            lambda xp, d: expectation.stacked_shifted(*(_device(xp, d)[k] for k in ("g", "ramps", "width"))),
            _shifted_twin),
    FusedOp("shifted sum of conjugates", ("ngr_sum_conj_shifted",), "gpu_kernels", ("float32",),
            _conj_shifted_example,
            lambda xp, d: expectation.sum_conj_shifted(*(_device(xp, d)[k] for k in ("U", "ramps"))),
            _conj_shifted_twin, close=1e-5),
    FusedOp("insertion", ("insert_splat",), "gpu_kernels", ("one grid",), _insertion_example, _insertion_run,
            close=1e-9),
    FusedOp("binned sum", ("binned_sum",), "gpu_kernels", ("weights", "counts"), _binned_example,
            lambda xp, d: gpu_kernels.binned_sum(*(_device(xp, d)[k] for k in ("index", "weights", "nbins"))),
            _binned_twin, close=1e-12),
    FusedOp("segment rows sum", ("segment_rows_sum",), "gpu_kernels", ("float32",), _segment_example,
            lambda xp, d: gpu_kernels.segment_rows_sum(*(_device(xp, d)[k] for k in ("rows", "values", "n"))),
            _segment_twin, close=1e-5),
    FusedOp("finish scores", ("ngr_finish_scores",), "gpu_kernels", ("float32",), _finish_example,
            lambda xp, d: gpu_kernels.finish_scores(*(_device(xp, d)[k] for k in ("cross", "pnorm"))),
            lambda d: d["pnorm"] - 2.0 * d["cross"]),
    FusedOp("any over middle", ("ngr_any_over_middle",), "gpu_kernels", ("bool",), _any_example,
            lambda xp, d: gpu_kernels.any_over_middle(_device(xp, d)["a"]), lambda d: d["a"].any(axis=1)),
    FusedOp("posterior weights", ("lw_maxsum", "lw_normalise_select"), "gpu_posterior", ("column", "no column"),
            _posterior_example, _posterior_run, close=2e-6),
    FusedOp("significant weights", ("ngr_significant", "ngr_significant_weights"), "gpu_posterior",
            ("mask", "weights"), _significant_example, _significant_run, _significant_twin),
    FusedOp("rows sorted descending", ("ngr_row_desc_key", "ngr_row_desc_value"), "gpu_posterior", ("float32",),
            _sort_example, lambda xp, d: gpu_posterior.sort_rows_descending(_device(xp, d)["vals"]),
            lambda d: -np.sort(-np.maximum(d["vals"], 0), axis=1)),
)

#: The raw CUDA sources of the registry, compiled as wholes (one module each).
RAW_SOURCES = {"gpu_kernels": gpu_kernels._SOURCE, "gpu_posterior": gpu_posterior._SOURCE}  # noqa: SLF001

#: A __global__ function of a raw source, or the name of an elementwise kernel (ours all start with "ngr_").
_KERNEL_NAMES = re.compile(r'__global__\s+void\s+(\w+)|"(ngr_\w+)"')


def kernels_in_sources() -> set[str]:
    """Every CUDA kernel defined in the fused ops' modules: the __global__ functions of their raw sources and the
    names of their elementwise kernels (read from the files, so that a kernel added without a registry entry is
    seen)."""
    names = set()
    for mod in (gpu_kernels, gpu_posterior):
        text = Path(mod.__file__).read_text()
        names |= {a or b for a, b in _KERNEL_NAMES.findall(text)}
    return names


def run_op(op: FusedOp, xp, flag: str, seed: int = 0):
    """The op's result (on the host) for its example of specialisation ``flag``, with arrays of module ``xp``
    (the twin when ``xp`` is NumPy and the op has one)."""
    inputs = op.example(np.random.default_rng(seed), flag)
    if xp is np and op.twin is not None:
        return np.asarray(op.twin(inputs))
    return to_host(op.run(xp, inputs))


def build(device: int, stop: Callable[[], bool] = lambda: False) -> dict:
    """Compile (or, with CuPy's kernel cache filled, load) every specialisation of every fused op on GPU
    ``device``: each raw source's module by ``RawModule.compile()``, then each op on its example inputs (which
    loads its elementwise kernels and the functions it fetches). Returns what it did: ops built and seconds."""
    import cupy as cp  # noqa: PLC0415

    t0, built = time.perf_counter(), 0
    with cp.cuda.Device(device):
        for source in RAW_SOURCES.values():
            raw_module(source).compile()
        for op in REGISTRY:
            for flag in op.specialisations:
                if stop():
                    return {"ops": built, "seconds": time.perf_counter() - t0, "stopped": True}
                run_op(op, cp, flag)
                built += 1
        cp.cuda.Device(device).synchronize()
    return {"ops": built, "seconds": time.perf_counter() - t0, "stopped": False}
