"""2D classification (relion_refine with 2D references, EM variant; relion_algorithm.md 7).

On 5 simulated views + 20 % noise junk (tests/test_class2d.py) the junk goes to its own classes and every
view's class averages to > 0.9 correlation with its true projection; similar views can share a class.

K class averages from random-subset averages with RELION's blob initialisation; each iteration the shared driver
(jobs/em.py) runs one E-step with InPlaneSampling (rows are (class, psi) pairs, one GEMM for all classes and
in-plane angles, translations as phase ramps), then per class a MAP reconstruction of the 2D average with tau2
from the class's power spectrum times tau2_fudge (default 2), per-class offset priors, optional soft masking and
centring of the classes. Files follow RELION under the --o rootname: run_itNNN_classes.mrcs,
run_itNNN_model.star (class distribution and resolution), run_itNNN_data.star (rlnClassNumber, rlnAnglePsi,
offsets).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..compute.masks import soft_spherical_mask
from ..compute.maximization import (
    class_offset_priors,
    coarse_image_size,
    update_sigma2,
    update_sigma_offset,
)
from ..compute.references2d import initial_class_averages, references_from_maps
from ..compute.sampling import InPlaneSampling
from ..errors import InputError
from ..events import ClassAveragesUpdated, Finished, IterationFinished, IterationStarted, Message
from ..io.mrc import write_mrc
from . import em, em_classification
from .common import param

JOB_NAME = "class2d"
#: RELION uses up to 1000 random particles for the starting class averages.
INITIAL_PARTICLES = 1000


@dataclass(frozen=True)
class Class2DOptions:
    """The options of this job beyond the shared ones."""

    K: int = param(50, "--K", "Number of classes")
    iter: int = param(25, "--iter", "Number of iterations")
    tau2_fudge: float = param(2.0, "--tau2_fudge", "Regularisation parameter T")
    psi_step: float = param(12.0, "--psi_step", "Coarse in-plane step (degrees); the fine step is half")
    ini_high: float = param(-1.0, "--ini_high", "Low-pass of the initial classes (Å); -1 = 0.07 digital frequency")
    center_classes: bool = param(False, "--center_classes", "Centre the class averages on their mass each iteration")
    sort_classes: bool = param(False, "--sort_classes", "Number the classes by decreasing class distribution")


@dataclass(frozen=True)
class Params(em.EMParams, em.EMCorrections, em.EMOptions, Class2DOptions, em.EMInputs):
    CONTINUE_CHANGES = em.EMParams.CONTINUE_CHANGES + ("offset_range", "offset_step", "center_classes")
    # runs written before class2d took --norm and --scale, or before --subpixel_offsets, had them off
    NEWER_OPTIONS = {"norm": False, "scale": False, "subpixel_offsets": False}

    def __post_init__(self):
        self.check(needs_ref=False)
        if self.continue_from is not None:
            return
        em_classification.check_classification(self)
        if not 0 < self.psi_step <= 180:
            raise InputError(f"--psi_step must be in (0, 180] degrees, got {self.psi_step}")


def run(p: Params) -> Iterator:
    yield from em.run(Class2D(p))


class Class2D(em_classification.Classification):
    name = JOB_NAME
    ndim = 2

    def __init__(self, p: Params):
        super().__init__(p)
        self.K = self.p.K
        self.check_k()
        self.ini_high = self.p.ini_high if self.p.ini_high > 0 else self.apix / 0.07
        self.circle = soft_spherical_mask(self.N, self.mask_r, em.MASK_EDGE, 2).astype(np.float64)

    def initial_model(self) -> em.EMModel:
        ps = self.ps
        rng = np.random.default_rng(self.p.random_seed + 11)
        rows = np.sort(rng.permutation(len(ps))[:INITIAL_PARTICLES])
        refs = initial_class_averages(self.be.asarray(ps.images(rows)), ps.offsets_px[rows], ps.ctf_rows(rows),
                                      self.K, self.apix, self.diameter / self.apix, self.mask_r, self.ini_high, rng,
                                      self.p.pad, em.MASK_EDGE)
        self.state.res_shell = int(round(self.N * self.apix / self.ini_high))
        return em.EMModel([refs], [self.initial_sigma2()], [np.full(self.K, 1.0 / self.K)], [np.ones((self.K, 1))],
                          np.ones(len(ps.scale_group_names)), np.zeros((self.K, 2)))

    def restore(self) -> em.EMModel:
        model = self.restore_state()[0]
        refs = np.stack(em.reference_images(model.path))
        scales = self.saved_scales(model)
        return em.EMModel([refs], [model.sigma2], [model.class_distribution], [np.ones((self.K, 1))], scales,
                          model.prior_offsets_A())

    def update_sampling(self) -> Iterator:
        st, N, p = self.state, self.N, self.p
        size = st.current_size(N)
        st.perturb_sampling(p.random_seed)
        smp = InPlaneSampling(p.psi_step, p.offset_range, p.offset_step, perturb=st.perturb)
        coarse = coarse_image_size(N, self.apix, smp.psi_step_actual, self.diameter, size, kappa=1.5)
        yield Message(f"iteration {st.iteration}: image size {size} (coarse {coarse}), {self.K} classes x {smp.n_psi} "
                      f"psi x {smp.translations.shape[0]} translations")
        yield IterationStarted(st.iteration, p.iter, st.iteration == p.iter, image_size=size, full_size=N,
                               angular_step=float(smp.psi_step_actual))
        return em.Iteration(st.iteration == p.iter, False, size, smp, coarse, None)

    def expectation_options(self, it: em.Iteration, h: int) -> dict:
        with np.errstate(divide="ignore"):
            log_prior = np.log(self.model.pdf_class[0])[:, None]  # (K, 1): the class prior
        # the offset prior in Å throughout: RELION's arithmetic (the default of the 3D jobs) is checked against
        # RELION only without class offset priors (issue 16); with them it moved our class priors away from their
        # particles' mean offsets (tests/test_class2d.py), so 2D keeps the documented units until it is checked
        return {"log_pdf_direction": self.be.asarray(log_prior), "class_offset_prior_A": self.model.prior_offsets_A,
                "relion_offset_prior": False}

    def expectation(self, it: em.Iteration) -> Iterator:
        yield from super().expectation(it)
        angles = self.ps.angles  # 2D: the in-plane angle is rot + psi of the Euler triple (tilt 0)
        angles[:, 2] = (angles[:, 0] + angles[:, 2] + 180.0) % 360.0 - 180.0
        angles[:, :2] = 0.0

    def maximization(self, it: em.Iteration) -> None:
        p, m, sums = self.p, self.model, it.sums[0]
        circle = self.be.asarray(self.circle)

        def references(maps):  # on the device, before the maps come to the host (each rank its block of classes)
            return references_from_maps(maps, circle, p.offset_range, p.flatten_solvent, p.center_classes)

        m.refs[0], it.ssnr = self.reconstruct_owned(it, finish=references)
        m.sigma2[0] = update_sigma2(sums.sigma2, sums.sumw_group, self.N)
        self.state.sigma_offset_A = update_sigma_offset(sums.sigma_offset, sums.sum_weight)
        self.update_corrections(it.sums)
        m.pdf_class[0] = sums.pdf_class / max(sums.pdf_class.sum(), 1e-300)
        m.prior_offsets_A = class_offset_priors(sums.offset_sum, sums.pdf_class)

    def update_resolution(self, it: em.Iteration) -> None:
        if self.p.sort_classes:  # number the classes by decreasing distribution (the particles' classes too)
            m = self.model
            order = np.argsort(-m.pdf_class[0], kind="stable")
            rank = np.empty(self.K, dtype=np.int64)
            rank[order] = np.arange(self.K)
            m.refs[0], m.pdf_class[0], m.prior_offsets_A = m.refs[0][order], m.pdf_class[0][order], \
                m.prior_offsets_A[order]
            it.ssnr = [it.ssnr[k] for k in order]
            self.ps.classes[:] = rank[self.ps.classes]
            if self.state.iteration > 1:
                it.old_classes = rank[it.old_classes]
        super().update_resolution(it)

    def write(self, it: em.Iteration) -> Iterator:
        f, i, K, apix = self.files, self.state.iteration, self.K, self.apix
        refs, pdf = self.model.refs[0].astype(np.float32), self.model.pdf_class[0]
        stack = f.classes_stack(i)
        self.save(write_mrc, stack, refs, apix, stack=True)
        model = self.write_model(it, [f"{k + 1:06d}@{stack.name}" for k in range(K)], [np.array([d]) for d in pdf])
        data = self.write_data()
        self.write_optimiser(it, data, [model])
        self.outputs = {"classes": stack, "model": model, "data": data}
        largest = ", ".join(f"{100 * d:.1f}%" for d in np.sort(pdf)[::-1][:5])
        summary = self.summary(it, f"largest classes {largest}")
        yield ClassAveragesUpdated("classes", refs, pdf.copy(), np.asarray(self.res_A), apix, stack)
        yield IterationFinished(i, {"classes": refs}, pdf.copy(), float(min(self.res_A)), None, summary)

    def finished(self) -> Finished:
        pdf = self.model.pdf_class[0]
        return Finished(self.outputs, f"{self.p.iter} iterations in {time.time() - self.t_start:.0f} s; "
                                      f"{int((pdf >= 1e-6).sum())} of {self.K} classes hold particles")
