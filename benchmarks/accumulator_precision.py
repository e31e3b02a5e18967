"""float32 against float64 back-projection accumulators (issue 21: "float32 accumulators where float64 is not
needed (show the error it adds)").

The accumulators (compute/backprojector.py: data real and imaginary parts and weight on the padded half grid)
are float64 in every job; BackProjector(dtype=np.float32) halves them (24 -> 12 bytes per voxel: 12 GiB less
for the two halves at box 1024, pad 1). The terms added into them are float32 already (complex64 slices,
float32 trilinear and CTF weights); what float32 changes is the rounding of the sums. Two float32 cases:

* ``float32 (chunk sums)``: the code path as it runs on the CPU (scatter-add by ``bincount``, which sums each
  insertion chunk in float64 and rounds once into the float32 grid);
* ``float32 (every add rounded)``: every term added in float32 one at a time (``np.add.at``), as the GPU's atomic
  float32 ``scatter_add`` does (in another order): the worse case and the one a GPU run would have.

Simulated particles (compute/simulate.py: pseudo-atomic phantom, CTF, SNR 0.05, true orientations) are inserted
with their CTF weights into all three accumulators, which are reconstructed unregularised (BackProjector
.reconstruct, float64 arithmetic from the accumulators on, and float64 maps: the float32 rounding of the maps
the jobs write, a relative 3e-8, would hide the accumulators' own). Reported: the relative error of each float32 map
against the float64 map (L2 over the box), 1 - FSC between them (smallest over the shells), the largest change
of the map's FSC against the truth, and for scale the float64 maps' own rounding (the same particles inserted in
reverse order).

Run: python benchmarks/accumulator_precision.py --n 2000 20000 --box 32 \
         --out benchmarks/results/accumulator_precision_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from napari_gpu_relion.compute import backprojector as BPmod
from napari_gpu_relion.compute import simulate as sim
from napari_gpu_relion.compute.backprojector import BackProjector
from napari_gpu_relion.compute.ctf import ctf_half_grid
from napari_gpu_relion.compute.fourier import phase_shift_2d, rfft_centered
from napari_gpu_relion.compute.fsc import fsc
from napari_gpu_relion.compute.geometry import euler_to_matrix


@contextmanager
def every_add_rounded():
    """Back-projection adds every term into the grid one at a time in the grid's dtype (np.add.at), as atomic
    adds on a GPU do, instead of summing each chunk first (bincount)."""
    plain = BPmod._scatter_add

    def one_at_a_time(target_flat, idx, vals):
        np.add.at(target_flat, idx, vals.astype(target_flat.dtype))

    BPmod._scatter_add = one_at_a_time
    try:
        yield
    finally:
        BPmod._scatter_add = plain


def particles(n: int, box: int, pixel_size: float, snr: float, seed: int):
    """Insertion inputs of n simulated particles at their true orientations: matrices, CTF-weighted
    complex64 slices (as the E-step hands them over) and float32 CTF^2 weights; and the true map."""
    ph = sim.pseudo_atomic_phantom(diameter_A=0.75 * box * pixel_size, n_atoms=150, seed=seed)
    truth = sim.phantom_volume(ph, box, pixel_size).astype(np.float64)
    parts = sim.simulate_particles(n, box, pixel_size, phantom=ph, snr=snr, seed=seed + 1, max_shift_px=2.0)
    A = euler_to_matrix(*parts.angles.T)
    F = phase_shift_2d(rfft_centered(parts.images.astype(np.float64), 2), parts.origins_px, box)
    c = ctf_half_grid(parts.ctf, box, pixel_size).astype(np.float64)
    return A, (F * c).astype(np.complex64), (c * c).astype(np.float32), truth


def reconstruct(box: int, pad: int, A, F, W, dtype, order=None):
    bp = BackProjector(box, pad, dtype=dtype)
    idx = np.arange(len(A)) if order is None else order
    for a in range(0, len(idx), 200):  # batches of particles, as the E-step inserts them
        sel = idx[a:a + 200]
        bp.insert_images(A[sel], F[sel], W[sel])
    bp.enforce_hermitian()
    return bp.reconstruct(out_dtype=np.float64)  # float64 maps: the jobs' float32 output rounding left out


def compare(n: int = 2000, box: int = 32, pad: int = 2, pixel_size: float = 3.0, snr: float = 0.05,
            seed: int = 0) -> dict:
    A, F, W, truth = particles(n, box, pixel_size, snr, seed)
    t = time.time()
    ref = reconstruct(box, pad, A, F, W, np.float64)
    seconds = {"float64": time.time() - t}
    maps = {"float64 (reverse order)": reconstruct(box, pad, A, F, W, np.float64, order=np.arange(n)[::-1])}
    t = time.time()
    maps["float32 (chunk sums)"] = reconstruct(box, pad, A, F, W, np.float32)
    seconds["float32 (chunk sums)"] = time.time() - t
    with every_add_rounded():
        t = time.time()
        maps["float32 (every add rounded)"] = reconstruct(box, pad, A, F, W, np.float32)
        seconds["float32 (every add rounded)"] = time.time() - t
        maps["float64 (every add rounded)"] = reconstruct(box, pad, A, F, W, np.float64)
    f_ref = fsc(ref, truth)
    out = {"n": n, "box": box, "pad": pad, "snr": snr, "seed": seed,
           "accumulator_bytes_per_voxel": {"float64": 24, "float32": 12},
           "fsc_float64_vs_truth_at_half_nyquist": float(f_ref[box // 4]), "cases": {}}
    for name, m in maps.items():
        f_pair = fsc(m, ref)
        out["cases"][name] = {
            "relative_error_vs_float64": float(np.linalg.norm(m - ref) / np.linalg.norm(ref)),
            "max_abs_error_over_max": float(np.abs(m - ref).max() / np.abs(ref).max()),
            "one_minus_min_fsc_vs_float64": float(1.0 - f_pair[1:].min()),
            "max_change_of_fsc_vs_truth": float(np.abs(fsc(m, truth) - f_ref).max()),
            "seconds": round(seconds[name], 2) if name in seconds else None}
    written = ref.astype(np.float32).astype(np.float64)  # what float32 output alone does to the float64 map
    out["float32_output_rounding_relative"] = float(np.linalg.norm(written - ref) / np.linalg.norm(ref))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[2000])
    ap.add_argument("--box", type=int, default=32)
    ap.add_argument("--pad", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rows = [compare(n, a.box, a.pad, seed=a.seed) for n in a.n]
    res = {"device": f"CPU (NumPy {np.__version__})", "host": platform.node(), "date": time.strftime("%Y-%m-%d"),
           "results": rows}
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
