"""What 2D and 3D classification share on top of the EM driver (jobs/em.py): their option checks, the
per-class resolution, the fixed number of iterations, the model and data STARs and the iteration summary."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pandas as pd

from ..compute.backend import warm_pinned
from ..compute.fsc import shell_to_angstrom
from ..compute.maximization import reconstruct_classes, references_tau2, resolution_shell_from_ssnr
from ..errors import InputError
from ..io.model_star import write_model_star
from . import em


def check_classification(p) -> None:
    """Clear errors for the classification options (before any work; --tau2_fudge with the options a --continue
    may change, EMParams.check_values)."""
    if p.K < 1:
        raise InputError(f"--K must be at least 1, got {p.K}")
    if p.iter < 1:
        raise InputError(f"--iter must be at least 1, got {p.iter}")


class Classification(em.EMJob):
    """relion_refine without gold-standard halves: K classes, a fixed number of iterations (--iter)."""

    ndim = 3
    K = 1

    def check_k(self) -> None:
        if self.K > len(self.ps):
            raise InputError(f"--K {self.K} is larger than the number of particles ({len(self.ps)})",
                             path=str(self.p.i))
        if self.continued and int(self.opt["rlnCurrentIteration"]) >= self.p.iter:
            raise InputError(f"nothing to continue: the run already has {int(self.opt['rlnCurrentIteration'])} "
                             f"iterations; give --iter larger than that", path=str(self.p.continue_from))

    def warm_pinned_maps(self) -> None:
        """Page-locked blocks for the M-step's class maps (K float32 maps of the references' shape, the float32 maps
        the M-step returns) made in a background thread while the first E-step runs, as many as the first two
        iterations take (the model's and the new maps; later ones find freed blocks): each first copy of six
        box-256 maps waited 0.29-0.34 s for cudaHostAlloc in class3d's iterations 1 and 2 on an H200."""
        refs = self.model.refs[0] if self.model is not None and self.model.refs else None
        if not self.be.is_gpu or refs is None or len(refs) == 0:
            return
        shape = (len(refs),) + tuple(refs[0].shape)
        if not self.pinned_maps(int(np.prod(shape)) * 4):
            return
        threading.Thread(target=warm_pinned, args=(shape, np.float32, 2, self.be.device), name="pinned maps",
                         daemon=True).start()

    def reconstruct_owned(self, it: em.Iteration, sym_matrices=None, finish=None) -> tuple[np.ndarray, list]:
        """The M-step's class maps (one host array, classes first) and SSNRs of every class, in class order: this
        rank reconstructs its block of classes (all of them without MPI; reconstruct_classes with the tau2 of the
        references this iteration aligned to), ``finish(maps)`` on the device, then every rank gathers the others'
        blocks."""
        lo, hi = self.my_classes(0, it)
        maps, ssnr = None, []
        if hi > lo:
            with it.timed("reconstructing", self.be):
                maps, ssnr = reconstruct_classes(it.accumulators[0].block(lo, hi),
                                                 references_tau2(it.references[0][lo:hi]), self.p.tau2_fudge,
                                                 it.sums[0].pdf_class[lo:hi], self.model.refs[0][lo:hi], sym_matrices)
                if finish is not None:
                    maps = finish(maps)
        with it.timed("the maps to the host" if self.comm.size == 1 else "gathering the maps", self.be):
            every = self.gather_class_maps(0, maps, it)  # one copy to the host
            ssnr = self.gather_classes(0, list(ssnr), it)
        return every, list(ssnr)

    def describe(self) -> str:
        kind = "2D classes" if self.ndim == 2 else "classes"
        return (f"classifying {len(self.ps)} particles into {self.K} {kind}"
                + (f", continuing after iteration {self.state.iteration}" if self.continued else ""))

    def update_resolution(self, it: em.Iteration) -> None:
        """Resolution of each class from its SSNR_MAP; the image size follows the best class."""
        N = self.N
        self.res_shells = [min(resolution_shell_from_ssnr(s, gold_standard=False), N // 2) for s in it.ssnr]
        if not it.cc:
            self.state.res_shell = max(self.res_shells)
        self.res_A = [shell_to_angstrom(max(r, 1), N, self.apix) for r in self.res_shells]
        self.changed = float((self.ps.classes != it.old_classes).mean()) if self.state.iteration > 1 else 1.0

    def check_convergence(self, it: em.Iteration) -> bool:
        return it.final

    def write_data(self) -> Path:
        return self.save_data_star(self.files.data(self.state.iteration))

    def write_model(self, it: em.Iteration, reference_names: list[str], pdf_orient: list[np.ndarray],
                    class_columns: dict | None = None) -> Path:
        """run_itNNN_model.star: general block, class table (reference, distribution, resolution and, in 2D, the
        class offset priors rlnClassPriorOffsetX/Y in Å; ``class_columns``: more columns, one value per class),
        SSNR_MAP per class, noise spectra, group scales, orientation distributions."""
        m, ps, N, apix = self.model, self.ps, self.N, self.apix
        pdf_class = m.pdf_class[0]
        general = {"rlnReferenceDimensionality": self.ndim, "rlnDataDimensionality": 2, "rlnOriginalImageSize": N,
                   "rlnCurrentResolution": float(min(self.res_A)), "rlnCurrentImageSize": it.current_size,
                   "rlnPaddingFactor": self.p.pad, "rlnPixelSize": apix, "rlnNrClasses": len(pdf_class),
                   "rlnNrBodies": 1, "rlnNrGroups": len(m.scales), "rlnTau2FudgeFactor": self.p.tau2_fudge,
                   "rlnNormCorrectionAverage": self.state.norm_average,
                   "rlnSigmaOffsetsAngst": self.state.sigma_offset_A,
                   "rlnLogLikelihood": float(ps.log_likelihood.sum()), "rlnAveragePmax": float(ps.pmax.mean())}
        classes = pd.DataFrame({"rlnReferenceImage": list(reference_names), "rlnClassDistribution": pdf_class,
                                "rlnEstimatedResolution": self.res_A})
        for label, values in (class_columns or {}).items():
            classes[label] = list(values)
        if m.prior_offsets_A is not None:
            classes["rlnClassPriorOffsetX"] = m.prior_offsets_A[:, 0]
            classes["rlnClassPriorOffsetY"] = m.prior_offsets_A[:, 1]
        sh = np.arange(N // 2 + 1)
        curves = [pd.DataFrame({"rlnSpectralIndex": sh, "rlnResolution": sh / (N * apix), "rlnSsnrMap": s[: sh.size]})
                  for s in it.ssnr]
        path = self.files.model(self.state.iteration)
        self.save(write_model_star, path, general, classes, curves, m.sigma2[0].copy(), m.scales.copy(),
                  list(ps.scale_group_names), [np.array(d, copy=True) for d in pdf_orient], N, apix)
        return Path(path)

    def summary(self, it: em.Iteration, distribution: str) -> str:
        pdf = self.model.pdf_class[0]
        empty = [k + 1 for k in range(len(pdf)) if pdf[k] < 1e-6]
        return (f"{distribution}; resolution {min(self.res_A):.1f} Å; {100 * self.changed:.1f}% of particles changed "
                f"class; <Pmax> {self.ps.pmax.mean():.3f}; E-step {it.seconds_estep:.1f} s, batch {it.plan.batch}"
                + (f"; empty class(es): {empty}" if empty else ""))
