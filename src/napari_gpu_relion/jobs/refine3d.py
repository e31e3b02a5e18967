"""3D auto-refine (relion_refine --auto_refine --split_random_halves; relion_algorithm.md 6).

Gold-standard: the particles are split into two random halves, each refined against its own reference. Each
iteration (the driver in jobs/em.py): image sizes from the current resolution, accuracy estimates, the
automatic sampling schedule (compute/schedule.py: HEALPix order up, translations finer, local searches from
--auto_local_healpix_order), the E-step of both halves, symmetrisation, joining below 40 Å, the FSC from the
accumulators, tau2 from the FSC, MAP reconstruction, noise, offset, norm and scale updates, solvent flattening,
convergence. The final iteration uses all frequencies and joins the halves. Files follow RELION's names under
the --o rootname (io/jobdir.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..compute.accuracy import accuracy_particles, estimate_accuracy
from ..compute.backend import to_host
from ..compute.backprojector import BackProjector
from ..compute.expectation import pixel_set
from ..compute.fourier import lowpass_map
from ..compute.fsc import resolution_shell, shell_to_angstrom
from ..compute.geometry import euler_to_matrix, symmetry_group
from ..compute.maximization import (
    coarse_image_size,
    fsc_from_backprojectors,
    fsc_from_pooled,
    join_block,
    join_low_resolution,
    low_resolution_block,
    normalised_direction_priors,
    pooled_average,
    reference_sigma2,
    resolution_shell_from_ssnr,
    tau2_from_fsc,
    update_sigma2,
    update_sigma_offset,
)
from ..compute.sampling import Sampling
from ..compute.schedule import orientation_change_deg
from ..errors import InputError
from ..events import Finished, FscUpdated, IterationFinished, IterationStarted, MapUpdated, Message
from ..io.model_star import write_model_star
from ..io.mrc import write_mrc
from ..marks import memory_mark
from ..runtime.distributed import gather_items
from . import em
from .common import param

JOB_NAME = "refine3d"


@dataclass(frozen=True)
class Refine3DOptions:
    """The options of this job beyond the shared ones."""

    ref: Path | None = param(None, "--ref", "Initial reference map (.mrc)")
    ini_high: float = param(60.0, "--ini_high", "Low-pass filter of the initial reference (Å)")
    healpix_order: int = param(2, "--healpix_order", "Initial HEALPix order (2 = 15° coarse, 7.5° fine)")
    auto_local_healpix_order: int = param(4, "--auto_local_healpix_order",
                                          "Switch to local searches from this HEALPix order")
    sym: str = param("C1", "--sym", "Point-group symmetry")
    firstiter_cc: bool = param(False, "--firstiter_cc", "Cross-correlation in the first iteration")
    tau2_fudge: float = param(1.0, "--tau2_fudge", "Regularisation parameter T")
    low_resol_join_halves: float = param(40.0, "--low_resol_join_halves", "Join the halves below this (Å)")
    auto_iter_max: int = param(999, "--auto_iter_max", "Stop after this many iterations at most")
    trust_ref_size: bool = param(False, "--trust_ref_size", "Rescale a reference of another box/pixel size")


@dataclass(frozen=True)
class Params(em.EMParams, em.EMCorrections, em.EMOptions, Refine3DOptions, em.EMInputs):
    CONTINUE_CHANGES = em.EMParams.CONTINUE_CHANGES + ("auto_iter_max", "auto_local_healpix_order")
    # On by default in auto-refinement (off in RELION, which searches around offsets rounded to whole pixels): on
    # EMD-11007 at box 192 (4,000 particles, 3.09 Å) the final median angular error fell from 0.508° to 0.318° and
    # the offset error from 0.30 to 0.16 Å at the same cost (benchmarks/README.md); --no-subpixel_offsets for RELION's
    subpixel_offsets: bool = param(True, "--subpixel_offsets", "Search the translations around each particle's "
                                   "exact offset (on; RELION searches around the offset rounded to whole pixels, "
                                   "which a search range below half a pixel cannot leave: --no-subpixel_offsets "
                                   "for RELION's; docs/high_resolution.md)")

    def __post_init__(self):
        self.check(needs_ref=True, healpix_order=self.healpix_order)
        if self.continue_from is not None:
            return
        symmetry_group(self.sym)
        if self.ini_high <= 0:
            raise InputError(f"--ini_high must be > 0 (Å), got {self.ini_high}")


def run(p: Params) -> Iterator:
    yield from em.run(Refine3D(p))


class Refine3D(em.EMJob):
    name = JOB_NAME
    needs_halves = True

    def __init__(self, p: Params):
        super().__init__(p)
        self.sym = symmetry_group(self.p.sym)
        # RELION's change monitor as relion_refine_mpi (the only way RELION runs auto-refine) applies it: the
        # leader rank tests "small changes" (updateOverallChangesInHiddenVariables) against ITS sampling, which
        # it never updates (updateAngularSampling runs on the followers only; ml_optimiser_mpi.cpp), so the
        # thresholds stay 0.4 x the fine angular and offset steps of the first iteration this run does, also
        # after the order has gone up. With the current steps (single-process relion_refine) auto-refine spends
        # more iterations at every finer order for the same result (issue 15: 17+1 against RELION's 13+1).
        self.monitor_steps: tuple[float, float] | None = None
        # RELION's refinement puts every particle in class 1: in its first iteration the particles whose
        # rlnClassNumber was not 1 (all of them when the column is missing) count as changed class, so that
        # iteration and the next one both have large changes (ml_optimiser.cpp, updateOverallChanges...).
        table = self.ps.table.particles
        self.input_class_change = 0.0 if self.continued else (
            float((table["rlnClassNumber"].to_numpy(int) != 1).mean()) if "rlnClassNumber" in table else 1.0)

    def describe(self) -> str:
        return (f"auto-refining {len(self.ps)} particles ({self.halves[0].size} + {self.halves[1].size}), box "
                f"{self.N}, {self.apix:.3f} Å/px, {self.sym.name}")

    def initial_model(self) -> em.EMModel:
        # on the device: 0.7 s of iteration 1 on the host at box 256 (issue 15)
        ref0 = to_host(lowpass_map(self.be.asarray(self.load_reference(Path(self.p.ref))), self.apix, self.p.ini_high))
        s2 = self.initial_sigma2()
        self.state.start_auto_refine(self.N, self.apix, self.p.ini_high, self.p.auto_local_healpix_order)
        return em.EMModel([ref0[None].copy(), ref0[None].copy()], [s2.copy(), s2.copy()], [np.ones(1)] * 2,
                          [None, None], np.ones(len(self.ps.scale_group_names)))

    def restore(self) -> em.EMModel:
        models = self.restore_state()
        refs = [np.stack(em.reference_images(m.path)) for m in models]
        scales = self.saved_scales(models[0])
        pdfs = [self.saved_direction_priors(m) for m in models]
        if any(x is None for x in pdfs):
            pdfs = [None, None]
        return em.EMModel(refs, [m.sigma2 for m in models], [np.ones(1)] * 2, pdfs, scales)

    def max_iterations(self) -> int:
        """--auto_iter_max where it was lowered from its default (999, "until converged"), else 0."""
        default = Params.__dataclass_fields__["auto_iter_max"].default
        return int(self.p.auto_iter_max) if self.p.auto_iter_max < default else 0

    def files_iteration(self, it: em.Iteration) -> int | None:
        return None if it.final else self.state.iteration

    def accumulators(self, current_size: int):
        return BackProjector(self.N, self.p.pad, current_size / 2, ndim=3, xp=self.be.xp, dtype=np.float64)

    # ---- sampling: accuracy estimates and RELION's auto-refine schedule ----
    def accuracy(self, size: int) -> tuple[float, float]:
        """RELION calculateExpectedAngularErrors at image size ``size``: (degrees, Å) from RELION's 100
        particles against half 1's reference and noise (compute/accuracy.py)."""
        pix = pixel_set(self.N, size, self.be.xp)
        rows = accuracy_particles(self.ps.subset, self.ps.optics_group, self.p.random_seed)
        s2r = self.model.sigma2[0][self.ps.optics_group[rows]][:, to_host(pix.shell)]
        ref = self.prepared_references(size)[0][0]
        memory_mark("sampling: references prepared")
        out = estimate_accuracy(ref, pix, self.ps.angles[rows], self.ps.ctf_rows(rows), s2r, self.apix,
                                seed=self.p.random_seed, particle_ids=rows)
        memory_mark("sampling: accuracy estimate")
        return out

    def update_sampling(self) -> Iterator:
        st, N, apix = self.state, self.N, self.apix
        cc = self.p.firstiter_cc and st.iteration == 1 and not self.continued
        # RELION's order (compute/schedule.py): checkConvergence, image size, accuracy (not in a CC iteration),
        # updateAngularSampling (from iteration 2, the final one included)
        plan = st.plan_auto_refine_iteration(N, apix, self.p.auto_local_healpix_order, None if cc else self.accuracy,
                                             self.p.auto_iter_max)
        final, size = plan.final, plan.current_size
        if plan.message:
            yield Message(plan.message)
        st.perturb_sampling(self.p.random_seed)
        smp = Sampling(st.order, self.p.sym, None, st.offset_range, st.offset_step, perturb=st.perturb)
        for h in range(2):  # a new HEALPix order: uniform direction priors
            if self.model.pdf_dir[h] is None or self.model.pdf_dir[h].shape[1] != smp.n_dirs:
                self.model.pdf_dir[h] = np.full((1, smp.n_dirs), 1.0 / smp.n_dirs)
        coarse = coarse_image_size(N, apix, smp.angular_step, self.diameter, size)
        it = em.Iteration(final, cc, size, smp, coarse, st.sigma_ang if st.local else None)
        yield Message(f"iteration {st.iteration}: image size {size} (coarse {coarse}), HEALPix order {st.order} "
                      f"({smp.angular_step:g}°, fine {smp.fine_angular_step:g}°), {smp.n_orient} orientations"
                      f"{f' (local, sigma {st.sigma_ang:.2f}°)' if st.local else ''}, {smp.translations.shape[0]} "
                      f"translations (range {st.offset_range:g}, step {st.offset_step:g} px)"
                      f"{', CC' if cc else ''}{', final joined iteration' if final else ''}")
        yield IterationStarted(st.iteration, self.max_iterations(), final, converges=True, image_size=size,
                               full_size=N, angular_step=float(smp.angular_step), local=bool(st.local))
        return it

    def expectation_options(self, it: em.Iteration, h: int) -> dict:
        if it.local_sigma is not None:
            return {}
        return {"log_pdf_direction": self.be.asarray(np.log(np.maximum(self.model.pdf_dir[h], 1e-300)))}

    # ---- M-step: gold-standard FSC, tau2 and reconstruction; the other parameters ----
    def owned_kinds_of(self, it: em.Iteration) -> tuple[str, ...]:
        """Each half on its own rank (ranks 0 and 1 under MPI), except in the final iteration, whose joined map
        needs both halves' sums: there every rank sums and reconstructs both."""
        return () if it.final else self.owned_kinds

    def maximization(self, it: em.Iteration) -> None:
        p, st, m, N, comm = self.p, self.state, self.model, self.N, self.comm
        it.references = []  # the padded references are not used by this M-step: freed before its transients
        bps = it.accumulators
        own = [self.reconstruction_owners(h, it)[0] for h in (0, 1)]  # a rank, or None: every rank
        mine = [h for h in (0, 1) if own[h] in (None, comm.rank)]
        apart = len(mine) < 2 and comm.size > 1  # the halves on two ranks (the others make neither)
        for h in mine:
            bps[h].enforce_hermitian()
            if self.sym.order > 1:
                bps[h].symmetrise(self.sym.matrices)
        if not it.final and p.low_resol_join_halves > 0:
            res_A = max(p.low_resol_join_halves, shell_to_angstrom(max(st.res_shell, 1), N, self.apix))
            r_join = float(np.ceil(N * self.apix / res_A))
            if apart:
                self.join_halves_apart(bps, own, mine, r_join)
            else:
                join_low_resolution(bps[0], bps[1], r_join)
        memory_mark("M-step: Hermitian, symmetry, join")
        if apart:  # half 2 pooled on its rank, sent to half 1's, which computes the FSC for every rank
            with it.timed("the half-map FSC", self.be):
                z = [pooled_average(bps[h]) if h in mine else None for h in (0, 1)]
                if comm.rank == own[0]:
                    z[1] = self.be.xp.empty_like(z[0])
                if z[1] is not None:
                    comm.send_arrays([z[1]], own[1], own[0])
                it.fsc = comm.bcast(fsc_from_pooled(z[0], z[1], bps[0].r_max) if comm.rank == own[0] else None,
                                    root=own[0])
                del z
        else:
            with it.timed("the half-map FSC", self.be):
                it.fsc = fsc_from_backprojectors(bps[0], bps[1])
        memory_mark("M-step: half-map FSC")
        if it.final:
            # one map at a time, each on the host before the next starts
            self.unfiltered = []
            for bp in bps:
                with it.timed("reconstructing", self.be):
                    self.unfiltered.append(to_host(bp.reconstruct(None)))
                memory_mark("M-step: unfiltered half map")
            bps[0].add(bps[1])
            bps[1].release()  # half 2 is in half 1 now: its grids are freed before the joined map
            with it.timed("reconstructing", self.be):
                tau2, ssnr = tau2_from_fsc(it.fsc, reference_sigma2(bps[0]), p.tau2_fudge, joined=True)
                vol = self.finished_map(bps[0].reconstruct(tau2, p.tau2_fudge), it)
            memory_mark("M-step: joined map")
            new_refs = [vol, vol]
        else:
            part = []  # on the device: owner ranks gather them from there (NCCL), without a trip through the host
            for h in mine:
                with it.timed("reconstructing", self.be):
                    tau2, _ = tau2_from_fsc(it.fsc, reference_sigma2(bps[h]), p.tau2_fudge)
                    part.append(self.flattened_map(bps[h].reconstruct(tau2, p.tau2_fudge), it))
                memory_mark("M-step: half map")
            if apart:
                with it.timed("gathering the maps", self.be):
                    part = self.gather_halves(dict(zip(mine, part, strict=True)))
            new_refs = [self.host_map(v, it) for v in part]
            ssnr = tau2_from_fsc(it.fsc, 1.0, p.tau2_fudge)[1]  # the same for both halves (it depends on the FSC)
        it.ssnr = [ssnr]
        sums = it.sums
        if not it.cc:
            for h in range(2):
                m.sigma2[h] = update_sigma2(sums[h].sigma2, sums[h].sumw_group, N)
            st.sigma_offset_A = update_sigma_offset(sum(s.sigma_offset for s in sums), sum(s.sum_weight for s in sums))
            self.update_corrections(sums)
        for h in range(2):
            m.pdf_dir[h] = normalised_direction_priors(sums[h].pdf_direction[:1])
        m.refs = [v[None] for v in new_refs]

    def join_halves_apart(self, bps: list, own: list, mine: list, r_join: float) -> None:
        """join_low_resolution when half h is summed on rank own[h] alone: the two owners swap the block of
        their grids that holds the joined voxels (low_resolution_block: a small part of the grid) and each averages
        its own half, which gives both the values of the one-process join."""
        names = ("data_re", "data_im", "weight")
        ix, sel = low_resolution_block(bps[0].weight.shape, bps[0].pad, r_join, self.be.xp)
        blocks = [[getattr(bps[h], a)[ix] for a in names] for h in (0, 1)]  # copies (the other's: overwritten)
        self.comm.send_arrays(blocks[0], own[0], own[1])
        self.comm.send_arrays(blocks[1], own[1], own[0])
        for h in mine:
            for a, v in zip(names, join_block(blocks[h], blocks[1 - h], sel), strict=True):
                getattr(bps[h], a)[ix] = v

    def gather_halves(self, mine: dict[int, np.ndarray]) -> list[np.ndarray]:
        """Both half maps on every rank, on the host, from their owners (``mine``: this rank's, half -> flattened
        map on its device), as a float32 pair through gather_items: rounded to float32 once, as host_map rounds
        them, and adding zeros leaves them exact."""
        shape = (2,) + tuple(self.model.refs[0][0].shape)
        host = gather_items(self.comm, self.be.xp, shape, np.float32, mine)
        return [host[0], host[1]]

    def finished_map(self, vol, it: em.Iteration) -> np.ndarray:
        """A reconstructed half (or joined) map (float32, on the job's device) as the next reference, on the host:
        host_map of flattened_map."""
        return self.host_map(self.flattened_map(vol, it), it)

    def flattened_map(self, vol, it: em.Iteration):
        """A reconstructed map (float32, on the job's device) solvent flattened there (--flatten_solvent, not in
        the final iteration). float32 x float32 is exact in float64, so the product rounded once to float32 equals
        the former host path's float64 product rounded to float32."""
        if self.p.flatten_solvent and not it.final:
            vol = vol * self.be.asarray(self.solvent_mask)
        return vol

    def host_map(self, vol, it: em.Iteration) -> np.ndarray:
        """A flattened map (device or host) on the host as the float32 map that is written (EMModel.refs), with
        the initial low-pass again after a CC iteration."""
        vol = np.asarray(to_host(vol), np.float32)
        if it.cc:  # RELION re-applies the initial low-pass after a CC iteration
            vol = np.asarray(lowpass_map(vol.astype(np.float64), self.apix, self.p.ini_high), np.float32)
        return vol  # the values written (float32: EMModel.refs)

    def update_resolution(self, it: em.Iteration) -> None:
        st = self.state
        A_old = euler_to_matrix(*it.old_angles.T)
        A_new = euler_to_matrix(*self.ps.angles.T)
        self.angle_change = float(np.mean(orientation_change_deg(A_old, A_new, self.sym.matrices)))
        self.offset_change = float(np.sqrt(((self.ps.offsets_px - it.old_offsets) ** 2).sum() / (2 * len(self.ps))))
        self.offset_change *= self.apix
        # RELION updateCurrentResolution: at most shell N/2 - 1; unchanged after a CC iteration
        res_shell = st.res_shell if it.cc else min(resolution_shell_from_ssnr(it.ssnr[0]), self.N // 2 - 1)
        # incr_size, the change monitor (every iteration), the resolution counter and checkConvergence; RELION's
        # <Pmax> for the image size is half 1's (rank 1 broadcasts it)
        first = self.monitor_steps is None  # this run's first iteration
        if first:
            self.monitor_steps = (it.sampling.fine_angular_step, it.sampling.fine_offset_step * self.apix)
        class_change = self.input_class_change if first else 0.0
        st.finish_auto_refine_iteration(res_shell, it.fsc, it.current_size, float(self.ps.pmax[self.halves[0]].mean()),
                                        self.angle_change, self.offset_change, *self.monitor_steps, class_change)
        # what the log, the viewer, the model STARs' rlnEstimatedResolution and the end report: where the
        # gold-standard FSC drops below 0.143, a dip skipped as RELION skips one in its current resolution (which
        # drives the schedule: its SSNR rule, about the FSC's 0.5 during the run). With the first drop, a run whose
        # FSC dipped below 0.143 near 6.7 Å and rose again ended "final resolution 6.72 Å", while RELION printed
        # 3.45 Å for its own run of the same particles (EMD-11007, box 256, 1,000 particles; benchmarks/HISTORY.md)
        self.fsc_drop_shell = resolution_shell(it.fsc, 0.143)
        self.res_shell_reported = resolution_shell(it.fsc, 0.143, skip_dips=True)
        self.fsc_drop_A = shell_to_angstrom(max(self.fsc_drop_shell, 1), self.N, self.apix)
        self.res_A = shell_to_angstrom(max(self.res_shell_reported, 1), self.N, self.apix)

    def check_convergence(self, it: em.Iteration) -> bool:
        # RELION checkConvergence ran in finish_auto_refine_iteration: state.converged makes the next iteration
        # the final one
        return it.final

    # ---- files and events ----
    def write(self, it: em.Iteration) -> Iterator:
        st, N, apix, f = self.state, self.N, self.apix, self.files
        i = self.files_iteration(it)
        maps = [f.class_map(1)] if it.final else [f.class_map(1, i, half=h) for h in (1, 2)]
        models = [f.model()] if it.final else [f.model(i, half=h) for h in (1, 2)]
        # written and shown: the float32 maps, which the next M-step replaces, never changes
        vols = [np.asarray(self.model.refs[h][0], np.float32) for h in range(len(maps))]
        for h, path in enumerate(maps):
            self.save(write_mrc, path, vols[h], apix)
        for h, path in enumerate(models):
            self._write_model(path, maps[h], h, it)
        data = self.save_data_star(f.data(i))
        if it.final:
            for h in range(2):
                self.save(write_mrc, f.unfiltered_half_map(h + 1), self.unfiltered[h].astype(np.float32), apix)
        self.write_optimiser(it, data, models)
        summary = (f"resolution {self.res_A:.2f} Å (FSC 0.143), image size {it.current_size}, angular change "
                   f"{self.angle_change:.2f}°, offset change {self.offset_change:.2f} Å, <Pmax> {st.ave_pmax:.3f}")
        if self.res_shell_reported != self.fsc_drop_shell:  # a dip skipped (update_resolution)
            yield Message(f"  the FSC dipped below 0.143 at {self.fsc_drop_A:.2f} Å and rose above it again: the "
                          f"resolution is {self.res_A:.2f} Å, counted as RELION counts its own")
        for h, name in enumerate(["class001"] if it.final else ["half1", "half2"]):
            yield MapUpdated(name, vols[h], apix, maps[h])
        yield FscUpdated(np.arange(N // 2 + 1) / (N * apix), {"gold-standard FSC": it.fsc}, self.res_A)
        yield IterationFinished(st.iteration, {}, None, self.res_A, it.fsc, summary)

    def _write_model(self, path: Path, ref_path: Path, h: int, it: em.Iteration) -> None:
        st, N, apix, p = self.state, self.N, self.apix, self.p
        sh = np.arange(N // 2 + 1)
        # rlnCurrentResolution is RELION's current resolution (the shell before the SSNR first drops below 1, which
        # sets the next image size and the no-gain counter: what RELION reads back), not the FSC-0.143 estimate,
        # which is the class's rlnEstimatedResolution and the FSC curve's (res_A)
        general = {"rlnReferenceDimensionality": 3, "rlnDataDimensionality": 2, "rlnOriginalImageSize": N,
                   "rlnCurrentResolution": shell_to_angstrom(max(st.res_shell, 1), N, apix),
                   "rlnCurrentImageSize": it.current_size,
                   "rlnPaddingFactor": p.pad, "rlnIsHelix": 0, "rlnFourierSpaceInterpolator": 1,
                   "rlnMinRadiusNnInterpolation": 10, "rlnPixelSize": apix, "rlnNrClasses": 1, "rlnNrBodies": 1,
                   "rlnNrGroups": len(self.model.scales), "rlnTau2FudgeFactor": p.tau2_fudge,
                   "rlnNormCorrectionAverage": st.norm_average, "rlnSigmaOffsetsAngst": st.sigma_offset_A,
                   "rlnOrientationalPriorMode": 1 if st.local else 0, "rlnSigmaPriorRotAngle": st.sigma_ang,
                   "rlnSigmaPriorTiltAngle": st.sigma_ang, "rlnSigmaPriorPsiAngle": st.sigma_ang,
                   "rlnLogLikelihood": float(self.ps.log_likelihood.sum()), "rlnAveragePmax": st.ave_pmax}
        classes = pd.DataFrame({"rlnReferenceImage": [ref_path.name], "rlnClassDistribution": [1.0],
                                "rlnAccuracyRotations": [st.acc_rot], "rlnAccuracyTranslationsAngst": [st.acc_trans_A],
                                "rlnEstimatedResolution": [self.res_A], "rlnOverallFourierCompleteness": [1.0]})
        res_col = np.where(sh > 0, N * apix / np.maximum(sh, 1), 999.0)
        curve = pd.DataFrame({"rlnSpectralIndex": sh, "rlnResolution": sh / (N * apix),
                              "rlnAngstromResolution": res_col, "rlnSsnrMap": it.ssnr[0][: sh.size],
                              "rlnGoldStandardFsc": it.fsc})
        self.save(write_model_star, path, general, classes, [curve], self.model.sigma2[h].copy(),
                  self.model.scales.copy(), list(self.ps.scale_group_names), [self.model.pdf_dir[h][0].copy()], N,
                  apix)

    def finished(self) -> Finished:
        f = self.files
        outputs = {"map": f.class_map(1), "half1": f.unfiltered_half_map(1), "half2": f.unfiltered_half_map(2),
                   "model": f.model(), "data": f.data()}
        return Finished(outputs, f"final resolution {self.res_A:.2f} Å (gold-standard FSC 0.143) after "
                                 f"{self.state.iteration} iterations in {time.time() - self.t_start:.0f} s; map "
                                 f"{outputs['map']}")
