"""How the EM iterations go on (RELION's MlOptimiser bookkeeping between iterations): the random perturbation of
the sampling, the image size from the resolution, the auto-refine sampling schedule (updateAngularSampling),
the hidden-variable change monitor and the convergence test (checkConvergence). One ``EMState`` holds the
scalars; jobs save it in the optimiser STAR so that --continue resumes exactly.

Auto-refine runs one iteration as RELION 5's relion_refine_mpi does (MlOptimiserMpi::iterate / ::expectation):

    before the E-step (``EMState.plan_auto_refine_iteration``):
        checkConvergence (decided at the end of the previous iteration: this iteration is the final one)
        updateImageSizeAndResolutionPointers (image size)
        calculateExpectedAngularErrors (every iteration but a CC one, the first and the final included)
        updateAngularSampling (from iteration 2 on, the final one included)
    after the M-step (``EMState.finish_auto_refine_iteration``):
        incr_size and has_high_fsc_at_limit from the gold-standard FSC
        updateOverallChangesInHiddenVariables (every iteration, the first and a CC one included)
        updateCurrentResolution
        checkConvergence (for the next iteration)

docs/relion_schedule.md derives the schedule by hand for scripted inputs (tests/test_schedule.py checks it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import relion_random
from .sampling import angular_step

#: RELION's --incr_size default: shells beyond the current resolution in the images (pixels).
MIN_INCR_SIZE = 10
#: RELION's MAX_NR_ITER_WO_RESOL_GAIN and MAX_NR_ITER_WO_LARGE_HIDDEN_VARIABLE_CHANGES (ml_optimiser.h).
MAX_NR_ITER_WO_RESOL_GAIN = 1
MAX_NR_ITER_WO_LARGE_HIDDEN_VARIABLE_CHANGES = 1
#: The starting values of RELION's smallest changes so far (classes: a count; offsets Å; orientations degrees),
#: also what a finer sampling resets them to.
NO_SMALLEST_CLASS_CHANGE = 9999999
NO_SMALLEST_CHANGE = 999.0
#: RELION's adaptive oversampling of auto-refine (--oversampling 1): fine steps are half the coarse ones.
OVERSAMPLING = 1


def round_half_away(x: float) -> int:
    """RELION's ROUND: to the nearest integer, halves away from zero."""
    return int(math.floor(x + 0.5)) if x >= 0 else -int(math.floor(-x + 0.5))


def next_perturbation(previous: float, seed: int, iteration: int) -> float:
    """RELION's random perturbation of the sampling for this iteration (0: the setup draw), in sampling steps in
    [-0.5, 0.5]: RELION's own draws for this seed (compute/relion_random.py), which depend only on the seed and
    the iteration, so a continued run draws what the uninterrupted run drew."""
    return relion_random.next_perturbation(previous, seed, iteration)


def fsc_crossing(fsc: np.ndarray, threshold: float) -> int:
    """The first shell (counting from 0) whose FSC is below ``threshold``, -1 when none is: RELION's fsc05 and
    fsc0143 in MlOptimiserMpi::iterate, from which incr_size is raised."""
    below = np.flatnonzero(np.asarray(fsc, np.float64) < threshold)
    return int(below[0]) if below.size else -1


def resolution_angular_step(res_shell: int, box: int, pixel_size: float, diameter_A: float) -> float:
    """The angular step (degrees) that the current resolution asks for, 360 / ceil(pi D / res) (RELION
    updateAngularSampling's myresol_angstep, used only with --auto_resol_angles)."""
    res_inv_A = res_shell / (box * pixel_size)
    return 360.0 / max(1, math.ceil(math.pi * diameter_A * res_inv_A))


def orientation_change_deg(A_old: np.ndarray, A_new: np.ndarray, sym_matrices: np.ndarray | None = None,
                           chunk: int = 4096) -> np.ndarray:
    """Per particle, RELION's change of orientation (HealpixSampling::calculateAngularDistance): the mean over
    the three rows of the rotation matrices (the image axes in the map frame) of the angle between old and new
    row, in degrees, the smallest over the symmetry mates of the old pose. This is not the rotation angle: an
    in-plane turn by t gives 2t/3, a small turn about a random axis about pi/4 of it. ``A_old``, ``A_new``
    (n, 3, 3); ``sym_matrices`` (s, 3, 3) with the identity (improper members act as in
    geometry.angular_distance_deg: the proper pose with the same image)."""
    A_old = np.asarray(A_old, np.float64).reshape(-1, 3, 3)
    A_new = np.asarray(A_new, np.float64).reshape(-1, 3, 3)
    S = np.eye(3)[None] if sym_matrices is None else np.asarray(sym_matrices, np.float64).reshape(-1, 3, 3)
    det = np.linalg.det(S)
    P = S * np.sign(det)[:, None, None]
    flip = np.where(det < 0, -1.0, 1.0)
    F = np.ones((S.shape[0], 3, 1))
    F[:, :2, 0] = flip[:, None]  # Rz(180) on the left for improper members
    out = np.empty(A_old.shape[0])
    for i0 in range(0, A_old.shape[0], chunk):
        a, b = A_old[i0:i0 + chunk], A_new[i0:i0 + chunk]
        mates = np.einsum("nij,skj->snik", a, P) * F[:, None]  # (s, n, 3, 3): F . A_old . P^T
        cos = np.clip(np.einsum("snik,nik->sni", mates, b), -1.0, 1.0)
        out[i0:i0 + chunk] = np.degrees(np.arccos(cos)).mean(axis=-1).min(axis=0)
    return out


@dataclass(frozen=True)
class AutoRefinePlan:
    """What one auto-refine iteration runs with (before its E-step)."""

    final: bool  # checkConvergence: the joined, full-size last iteration
    current_size: int  # pixels
    message: str  # what updateAngularSampling changed ("" if nothing)


@dataclass
class EMState:
    """The optimiser's scalars between iterations (angles in degrees, offsets in pixels unless named _A)."""

    iteration: int = 0
    order: int = 2  # HEALPix order of the coarse sampling
    offset_range: float = 5.0
    offset_step: float = 2.0  # coarse step (the fine step is half of it)
    sigma_offset_A: float = 10.0
    local: bool = False
    sigma_ang: float = 0.0
    res_shell: int = 5  # current resolution (Fourier shell of the box)
    incr_size: int = MIN_INCR_SIZE
    has_high_fsc_at_limit: bool = False
    nr_iter_wo_resol_gain: int = 0
    nr_iter_wo_large_changes: int = 0
    best_res_shell: int = 0  # for information only, as RELION's best_resol_thus_far
    fine_enough: bool = False
    converged: bool = False
    acc_rot: float = 999.0
    acc_trans_A: float = 999.0
    norm_average: float = 1.0
    perturb: float = 0.0
    ave_pmax: float = 0.0
    smallest_angle_change: float = NO_SMALLEST_CHANGE  # degrees
    smallest_offset_change: float = NO_SMALLEST_CHANGE  # Å
    smallest_class_change: int = NO_SMALLEST_CLASS_CHANGE
    last_angle_change: float = 999.0  # degrees (RELION's current_changes_optimal_orientations)
    last_offset_change_A: float = 0.0  # rms, Å (current_changes_optimal_offsets)

    # ---- sizes and resolution ----
    def current_size(self, box: int, final: bool = False) -> int:
        """RELION updateImageSizeAndResolutionPointers: 2 (resolution shell + increment) pixels, at most the
        box; the increment is ROUND(box/8) while <Pmax> > 0.1 and the FSC was once above 0.2 at the edge of
        the images (far from convergence), else incr_size. The whole box in the final iteration."""
        if final:
            return int(box)
        big = self.ave_pmax > 0.1 and self.has_high_fsc_at_limit
        incr = round_half_away(0.25 * box / 2) if big else self.incr_size
        return int(min(box, 2 * (self.res_shell + incr)))

    def perturb_sampling(self, seed: int) -> None:
        self.perturb = next_perturbation(self.perturb, seed, self.iteration)

    def start_auto_refine(self, box: int, pixel_size: float, ini_high_A: float, auto_local_order: int) -> None:
        """Before iteration 1: the resolution of the low-passed reference, ROUND(N p / ini_high) (RELION
        updateCurrentResolution at iteration 0), and local searches from the start when the initial HEALPix
        order is already at --auto_local_healpix_order, sigma = 2 x the fine step (initialiseGeneral)."""
        self.res_shell = round_half_away(box * pixel_size / ini_high_A)
        if self.order >= auto_local_order:
            self.local = True
            self.sigma_ang = 2.0 * angular_step(self.order + OVERSAMPLING)

    def update_resolution(self, new_shell: int) -> None:
        """RELION updateCurrentResolution: one more iteration without a resolution gain unless the new shell
        is beyond the current one (the previous iteration's, not the best so far)."""
        if new_shell > self.res_shell:
            self.nr_iter_wo_resol_gain = 0
        else:
            self.nr_iter_wo_resol_gain += 1
        self.res_shell = int(new_shell)
        self.best_res_shell = max(self.best_res_shell, int(new_shell))

    def update_image_size_increment(self, fsc: np.ndarray, current_size: int) -> None:
        """From this iteration's gold-standard FSC (MlOptimiserMpi::iterate): incr_size is raised (never
        lowered) to the distance between the first shells below 0.143 and below 0.5, plus 5; the FSC at shell
        current_size/2 - 1 above 0.2 sets has_high_fsc_at_limit for good."""
        self.incr_size = max(self.incr_size, fsc_crossing(fsc, 0.143) - fsc_crossing(fsc, 0.5) + 5)
        if not self.has_high_fsc_at_limit:
            edge = min(current_size // 2 - 1, len(fsc) - 1)
            self.has_high_fsc_at_limit = bool(fsc[edge] > 0.2)

    # ---- hidden-variable changes and convergence ----
    def update_changes(self, angle_change: float, offset_change_A: float, fine_angle: float,
                       fine_offset_A: float, class_change: float = 0.0) -> None:
        """RELION updateOverallChangesInHiddenVariables: an iteration without large changes has the fraction
        of class changes x 1.03 at least its smallest so far, and the same for the mean orientation change
        (degrees) and rms offset change (Å) unless that is below 0.4 x the fine angular / offset step. The
        smallest class change starts at 9999999, so the first iteration (and the first after a finer
        sampling, which resets it) always has large changes."""
        small_a = fine_angle > 0 and angle_change / fine_angle < 0.40
        small_o = fine_offset_A > 0 and offset_change_A / fine_offset_A < 0.40
        no_large = (1.03 * class_change >= self.smallest_class_change
                    and (small_o or 1.03 * offset_change_A >= self.smallest_offset_change)
                    and (small_a or 1.03 * angle_change >= self.smallest_angle_change))
        self.nr_iter_wo_large_changes = self.nr_iter_wo_large_changes + 1 if no_large else 0
        if class_change < self.smallest_class_change:
            self.smallest_class_change = round_half_away(class_change)
        self.smallest_offset_change = min(self.smallest_offset_change, offset_change_A)
        self.smallest_angle_change = min(self.smallest_angle_change, angle_change)
        self.last_angle_change = angle_change
        self.last_offset_change_A = offset_change_A

    def check_convergence(self, auto_ignore_angles: bool = False) -> None:
        """RELION checkConvergence: converged (for good) once the sampling is fine enough and the last
        iteration gained no resolution and changed the hidden variables little (or --auto_ignore_angles).
        The next iteration is then the final one."""
        hidden = auto_ignore_angles or self.nr_iter_wo_large_changes >= MAX_NR_ITER_WO_LARGE_HIDDEN_VARIABLE_CHANGES
        stalled = self.nr_iter_wo_resol_gain >= MAX_NR_ITER_WO_RESOL_GAIN and hidden
        self.converged = self.converged or (self.fine_enough and stalled)

    # ---- the sampling schedule ----
    def update_angular_sampling(self, pixel_size: float, auto_local_order: int, *, box: int = 0,
                                diameter_A: float = 0.0, auto_resol_angles: bool = False,
                                auto_ignore_angles: bool = False) -> str:
        """RELION updateAngularSampling (auto-refine, one class). Only when the resolution has stalled
        (or, with --auto_resol_angles, the resolution asks for a finer step and the next order is not the
        first local one) and the hidden variables have stalled (or --auto_ignore_angles):

        * the fine angular step already below 0.75 x acc_rot: fine enough (re-decided every time);
        * else one HEALPix order finer; translations: step 2 min(1.5 Å, 0.75 acc_trans), range 5 x the last
          rms offset change, at most 1.3 x the old range, at least 1.5 x the step, halved if above 4 steps,
          then the step a quarter of the range if still above; never a coarser step than now (then step and
          range stay); the counters and the smallest changes restart; local searches from
          ``auto_local_order`` on, sigma = 2 x the new fine step.

        Returns what changed, for the log ("" if nothing)."""
        fine_step = angular_step(self.order + OVERSAMPLING)
        proceed_res = self.nr_iter_wo_resol_gain >= MAX_NR_ITER_WO_RESOL_GAIN
        if auto_resol_angles and box > 0 and diameter_A > 0:
            res_step = resolution_angular_step(self.res_shell, box, pixel_size, diameter_A)
            proceed_res = proceed_res or (res_step < fine_step and self.order + 1 != auto_local_order)
        proceed_hidden = auto_ignore_angles or \
            self.nr_iter_wo_large_changes >= MAX_NR_ITER_WO_LARGE_HIDDEN_VARIABLE_CHANGES
        if not (proceed_res and proceed_hidden):
            return ""
        if fine_step < 0.75 * self.acc_rot:
            self.fine_enough = True
            return (f"angular sampling fine enough ({fine_step:g}° < 0.75 x accuracy {self.acc_rot:.2f}°): "
                    "no further increase")
        self.fine_enough = False
        # translations, in Å as RELION's sampling holds them
        old_step_A, old_range_A = self.offset_step * pixel_size, self.offset_range * pixel_size
        step_A = min(1.5, 0.75 * self.acc_trans_A) * 2**OVERSAMPLING
        range_A = min(1.3 * old_range_A, 5.0 * self.last_offset_change_A)
        range_A = max(range_A, 1.5 * step_A)
        if range_A > 4.0 * step_A:
            range_A /= 2.0
        if range_A > 4.0 * step_A:
            step_A = range_A / 4.0
        if step_A > old_step_A:  # never coarser
            step_A, range_A = old_step_A, old_range_A
        self.offset_step, self.offset_range = step_A / pixel_size, range_A / pixel_size
        self.order += 1
        new_fine_step = angular_step(self.order + OVERSAMPLING)
        self.nr_iter_wo_resol_gain = 0
        self.nr_iter_wo_large_changes = 0
        self.smallest_class_change = NO_SMALLEST_CLASS_CHANGE
        self.smallest_offset_change = NO_SMALLEST_CHANGE
        self.smallest_angle_change = NO_SMALLEST_CHANGE
        msg = (f"sampling: HEALPix order {self.order} ({angular_step(self.order):g}°, fine {new_fine_step:g}°), "
               f"translations range {self.offset_range:.2f} step {self.offset_step:.2f} px "
               f"(accuracy {self.acc_rot:.2f}°, {self.acc_trans_A:.2f} Å)")
        if self.order >= auto_local_order:
            self.local = True
            self.sigma_ang = 2.0 * new_fine_step
            msg += f"; local searches, sigma {self.sigma_ang:.2f}°"
        return msg

    # ---- one auto-refine iteration, in RELION's order ----
    def plan_auto_refine_iteration(self, box: int, pixel_size: float, auto_local_order: int,
                                   accuracy: Callable[[int], tuple[float, float]] | None,
                                   auto_iter_max: int = 999, **sampling_options) -> AutoRefinePlan:
        """The steps before the E-step of iteration ``self.iteration`` (see the module docstring).
        ``accuracy(current_size)`` returns (acc_rot degrees, acc_trans Å); None skips the estimate (a CC
        iteration). Past ``auto_iter_max`` the iteration is the final one (RELION just stops there; we still
        join the halves so that the run has its final map)."""
        final = self.converged or self.iteration > auto_iter_max
        size = self.current_size(box, final)
        if accuracy is not None:
            self.acc_rot, self.acc_trans_A = accuracy(size)
        msg = ""
        if self.iteration > 1:
            msg = self.update_angular_sampling(pixel_size, auto_local_order, **sampling_options)
        return AutoRefinePlan(final, size, msg)

    def finish_auto_refine_iteration(self, res_shell: int, fsc: np.ndarray, current_size: int, ave_pmax: float,
                                     angle_change: float, offset_change_A: float, fine_angle: float,
                                     fine_offset_A: float, class_change: float = 0.0,
                                     auto_ignore_angles: bool = False) -> None:
        """The steps after the M-step (see the module docstring): ``res_shell`` the new resolution shell (the
        same shell after a CC iteration), ``fsc`` this iteration's gold-standard FSC, ``ave_pmax`` <Pmax> of
        half 1, the changes of this iteration (degrees, Å) and the fine steps it searched (degrees, Å)."""
        self.ave_pmax = float(ave_pmax)
        self.update_image_size_increment(fsc, current_size)
        self.update_changes(angle_change, offset_change_A, fine_angle, fine_offset_A, class_change)
        self.update_resolution(res_shell)
        self.check_convergence(auto_ignore_angles)
