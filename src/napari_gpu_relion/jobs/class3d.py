"""3D classification (relion_refine without --split_random_halves; relion_algorithm.md 7).

Plain EM over K classes started from one reference: in the first iteration each particle searches only one random
class (RELION's seeding, with RELION's own draws for the seed, so each class is rebuilt from a random 1/K of the
data); tau2 of each class from its reference's power spectrum times tau2_fudge (default 4); class and direction
priors; fixed HEALPix order (global searches) or local searches with --sigma_ang. The iteration is the shared
driver (jobs/em.py) with K references: rows are (class, orientation) pairs, one GEMM for all of them. Files follow
RELION's names under the --o rootname: run_itNNN_classNNN.mrc, run_itNNN_model.star,
run_itNNN_data.star (rlnClassNumber).

--skip_align keeps the input angles and offsets: each particle is compared with every class at its own
orientation and exact offset (GivenOrientations in the shared E-step).

--firstiter_cc: iteration 1 aligns with cross-correlation against class 1 only (no noise or offset-sigma update,
the initial low-pass re-applied), its reconstruction is copied to every class and the random seeding happens in
iteration 2, as RELION does.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..compute.backend import to_host
from ..compute.class_similarity import class_report
from ..compute.fourier import lowpass_map
from ..compute.geometry import euler_to_matrix, symmetry_group
from ..compute.maximization import (
    coarse_image_size,
    normalised_direction_priors,
    update_sigma2,
    update_sigma_offset,
)
from ..compute.relion_random import relion_seed_classes
from ..compute.sampling import GivenOrientations, Sampling
from ..events import Finished, IterationFinished, IterationStarted, MapUpdated, Message
from ..io.mrc import write_mrc
from . import em, em_classification
from .common import param

JOB_NAME = "class3d"
SEEDING = "rlnGpuRelionClassSeeding"


@dataclass(frozen=True)
class Class3DOptions:
    """The options of this job beyond the shared ones."""

    ref: Path | None = param(None, "--ref", "Initial reference map (.mrc), or a STAR listing one map per class "
                             "(rlnReferenceImage, e.g. a previous run's _model.star; then K = their number)")
    K: int = param(2, "--K", "Number of classes")
    iter: int = param(25, "--iter", "Number of iterations")
    tau2_fudge: float = param(4.0, "--tau2_fudge", "Regularisation parameter T")
    healpix_order: int = param(2, "--healpix_order", "HEALPix order (2 = 15° coarse, 7.5° fine)")
    sym: str = param("C1", "--sym", "Point-group symmetry")
    ini_high: float = param(60.0, "--ini_high", "Low-pass filter of the initial reference(s) (Å); -1 = none, "
                            "start at full size (e.g. going on from a previous run's classes)")
    sigma_ang: float = param(-1.0, "--sigma_ang", "Local searches with this angular sigma (degrees); -1 = global")
    skip_align: bool = param(False, "--skip_align", "Keep the input angles and offsets; classify only")
    firstiter_cc: bool = param(False, "--firstiter_cc", "Cross-correlation against class 1 in the first iteration")
    trust_ref_size: bool = param(False, "--trust_ref_size", "Rescale a reference of another box/pixel size")


@dataclass(frozen=True)
class Params(em.EMParams, em.EMCorrections, em.EMOptions, Class3DOptions, em.EMInputs):
    CONTINUE_CHANGES = em.EMParams.CONTINUE_CHANGES + ("offset_range", "offset_step")
    # runs written before class3d took --norm and --scale, or before --subpixel_offsets, had them off
    NEWER_OPTIONS = {"norm": False, "scale": False, "subpixel_offsets": False}

    def __post_init__(self):
        self.check(needs_ref=True, healpix_order=self.healpix_order)
        if self.continue_from is not None:
            return
        symmetry_group(self.sym)
        em_classification.check_classification(self)


def run(p: Params) -> Iterator:
    yield from em.run(Class3D(p))


class Class3D(em_classification.Classification):
    name = JOB_NAME
    ndim = 3

    def __init__(self, p: Params):
        super().__init__(p)
        self.own_orientation = self.p.skip_align
        self.sym = symmetry_group(self.p.sym)
        self.ref_paths = em.reference_paths(Path(self.p.ref)) if self.p.ref is not None else []
        self.K = len(self.ref_paths) if len(self.ref_paths) > 1 else self.p.K
        # one reference copied to K classes is seeded at random; K given references are not (saved for --continue)
        self.seeding = (bool(int(self.opt.get(SEEDING, 1))) if self.continued else len(self.ref_paths) <= 1) \
            and self.K > 1
        self.check_k()
        # RELION's seeding: in iteration 1 (2 after a CC iteration 1) each particle searches one random class
        self.seed_iteration = 2 if self.p.firstiter_cc else 1
        self.input_angles, self.input_offsets = self.ps.angles.copy(), self.ps.offsets_px.copy()

    @functools.cached_property
    def seed_class(self) -> np.ndarray:
        """Each particle's class in the seeding iteration: the one RELION's own draws give it for this seed
        (compute/relion_random.py); made when that iteration runs, not for runs that never seed."""
        return relion_seed_classes(len(self.ps), self.K, self.p.random_seed)

    def optimiser_entries(self, it: em.Iteration, data, models) -> dict:
        return super().optimiser_entries(it, data, models) | {SEEDING: int(self.seeding)}

    def initial_model(self) -> em.EMModel:
        refs = [self.load_reference(q) for q in self.ref_paths]
        if self.p.ini_high > 0:
            refs = [to_host(lowpass_map(self.be.asarray(v), self.apix, self.p.ini_high)) for v in refs]  # on the device
        refs = refs * self.K if len(refs) == 1 else refs
        N = self.N
        self.state.res_shell = int(round(N * self.apix / self.p.ini_high)) if self.p.ini_high > 0 else N // 2 - 10
        return em.EMModel([np.stack(refs)], [self.initial_sigma2()], [np.full(self.K, 1.0 / self.K)], [None],
                          np.ones(len(self.ps.scale_group_names)))

    def restore(self) -> em.EMModel:
        model = self.restore_state()[0]
        refs = np.stack(em.reference_images(model.path))
        scales = self.saved_scales(model)
        pdf_dir = None if self.p.skip_align else self.saved_direction_priors(model)
        return em.EMModel([refs], [model.sigma2], [model.class_distribution], [pdf_dir], scales)

    def update_sampling(self) -> Iterator:
        st, N, p = self.state, self.N, self.p
        it_no = st.iteration
        cc = p.firstiter_cc and it_no == 1
        size = st.current_size(N)
        st.perturb_sampling(p.random_seed)
        if p.skip_align:
            smp = GivenOrientations(euler_to_matrix(*self.input_angles.T))
            self.model.pdf_dir[0] = np.ones((self.K, 1))
            coarse = size
            search = "own orientation and offset (--skip_align)"
        else:
            smp = Sampling(p.healpix_order, p.sym, None, p.offset_range, p.offset_step, perturb=st.perturb)
            if self.model.pdf_dir[0] is None:
                self.model.pdf_dir[0] = np.full((self.K, smp.n_dirs), 1.0 / smp.n_dirs)
            coarse = coarse_image_size(N, self.apix, smp.angular_step, self.diameter, size)
            local = " (local)" if p.sigma_ang > 0 else ""
            search = f"{smp.n_orient} orientations{local}, {smp.translations.shape[0]} translations"
        local_sigma = p.sigma_ang if p.sigma_ang > 0 and not p.skip_align else None
        yield Message(f"iteration {it_no}: image size {size} (coarse {coarse}), {self.K} classes x {search}"
                      f"{', random class seeding' if it_no == self.seed_iteration and self.seeding else ''}"
                      f"{', CC' if cc else ''}")
        yield IterationStarted(it_no, p.iter, it_no == p.iter, image_size=size, full_size=N,
                               angular_step=0.0 if p.skip_align else float(smp.angular_step),
                               local=local_sigma is not None)
        return em.Iteration(it_no == p.iter, cc, size, smp, coarse, local_sigma)

    def expectation_options(self, it: em.Iteration, h: int) -> dict:
        K, n, m = self.K, len(self.ps), self.model
        if it.cc and self.seeding:  # class 1 only
            class_prior = np.where(np.arange(K)[None, :] == 0, 0.0, -np.inf) * np.ones((n, 1))
        elif self.state.iteration == self.seed_iteration and self.seeding:
            class_prior = np.where(np.arange(K)[None, :] == self.seed_class[:, None], 0.0, -np.inf)
        elif self.p.skip_align:  # the class prior (with global searches it is part of the direction prior)
            with np.errstate(divide="ignore"):
                class_prior = np.broadcast_to(np.log(m.pdf_class[0]), (n, K))
        else:
            class_prior = None
        opts = {"class_log_prior": class_prior, "own_orientation": self.p.skip_align}
        if it.local_sigma is None and not self.p.skip_align:
            with np.errstate(divide="ignore"):
                opts["log_pdf_direction"] = self.be.asarray(np.log(m.pdf_class[0])[:, None] + np.log(m.pdf_dir[0]))
        return opts

    def maximization(self, it: em.Iteration) -> None:
        p, m, sums = self.p, self.model, it.sums[0]
        if p.skip_align:  # the input angles and offsets, exactly (not their round trip through matrices)
            self.ps.angles[:], self.ps.offsets_px[:] = self.input_angles, self.input_offsets
        def flattened(maps):  # on the device, in float64 as on the host, then rounded as the maps are kept (after
            maps = maps.astype(np.float64) * self.solvent_mask[None]  # a CC iteration's low-pass: one rounding)
            return maps if it.cc and p.ini_high > 0 else maps.astype(np.float32)

        # float32 maps unless a class was empty or a low-pass follows
        new_refs, it.ssnr = self.reconstruct_owned(it, self.sym.matrices, flattened if p.flatten_solvent else None)
        if not it.cc:
            m.sigma2[0] = update_sigma2(sums.sigma2, sums.sumw_group, self.N)
            self.state.sigma_offset_A = update_sigma_offset(sums.sigma_offset, sums.sum_weight)
            self.update_corrections(it.sums)
        m.pdf_class[0] = sums.pdf_class / max(sums.pdf_class.sum(), 1e-300)
        if not p.skip_align:
            m.pdf_dir[0] = normalised_direction_priors(sums.pdf_direction)
        if it.cc:  # RELION re-applies the initial low-pass after a CC iteration and copies class 1 to every class
            new_refs = np.stack([lowpass_map(v.astype(np.float64), self.apix, p.ini_high) if p.ini_high > 0 else v
                                 for v in new_refs])
            if self.seeding:
                new_refs = np.repeat(new_refs[:1], self.K, axis=0)
                m.pdf_class[0] = np.full(self.K, 1.0 / self.K)
                it.ssnr = [it.ssnr[0]] * self.K
                m.pdf_dir[0] = np.broadcast_to(m.pdf_dir[0][:1], m.pdf_dir[0].shape).copy()
        m.refs[0] = np.asarray(new_refs, np.float32)  # the values written (no copy of the gathered float32 maps)

    def write(self, it: em.Iteration) -> Iterator:
        f, i, K, apix = self.files, self.state.iteration, self.K, self.apix
        refs = self.model.refs[0]
        # written, shown and reported: views of the float32 maps, which the next M-step replaces, never changes
        maps = list(np.asarray(refs, np.float32))
        paths = [f.class_map(k + 1, i) for k in range(K)]
        for k in range(K):
            self.save(write_mrc, paths[k], maps[k], apix)
        # RELION's convention: each class's orientation distribution sums to its class distribution
        model = self.write_model(it, [q.name for q in paths],
                                 list(self.model.pdf_dir[0] * self.model.pdf_class[0][:, None]))
        data = self.write_data()
        self.write_optimiser(it, data, [model])
        self.outputs = {f"class{k + 1:03d}": paths[k] for k in range(K)} | {"model": model, "data": data}
        for k in range(K):
            yield MapUpdated(f"class{k + 1:03d}", maps[k], apix, paths[k])
        dist = ", ".join(f"{100 * d:.1f}%" for d in self.model.pdf_class[0])
        summary = self.summary(it, f"class distribution {dist}")
        yield IterationFinished(i, {f"class{k + 1:03d}": maps[k] for k in range(K)},
                                self.model.pdf_class[0].copy(), float(min(self.res_A)), None, summary)
        if it.final:
            self.report = class_report(list(refs), self.model.pdf_class[0], to_host(self.solvent_mask))
            yield Message(self.report)

    def finished(self) -> Finished:
        dist = ", ".join(f"class {k + 1}: {100 * d:.1f}%" for k, d in enumerate(self.model.pdf_class[0]))
        return Finished(self.outputs, f"{self.p.iter} iterations in {time.time() - self.t_start:.0f} s; {dist}. "
                                      f"{self.report}")

