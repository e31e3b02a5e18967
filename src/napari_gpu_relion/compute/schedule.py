"""How the EM iterations go on (RELION's MlOptimiser bookkeeping between iterations): the random perturbation of
the sampling, the image size from the resolution, the auto-refine sampling schedule (updateAngularSampling),
the hidden-variable change monitor and the convergence test (checkConvergence). One ``EMState`` holds the
scalars; jobs save it in the optimiser STAR so that --continue resumes exactly."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .fsc import resolution_shell
from .sampling import angular_step

#: RELION's minimum increase of the image size beyond the current resolution shell (pixels).
MIN_INCR_SIZE = 10


def next_perturbation(previous: float, seed: int, iteration: int) -> float:
    """RELION's random perturbation of the sampling for this iteration, in [-0.5, 0.5): one generator per
    iteration (seed + 7919 x iteration), so a continued run draws what the uninterrupted run drew."""
    rng = np.random.default_rng(seed + 7919 * iteration)
    return float(((previous + rng.uniform(0.25, 0.5)) + 0.5) % 1.0 - 0.5)


@dataclass
class EMState:
    """The optimiser's scalars between iterations (angles in degrees, offsets in pixels unless named _A)."""

    iteration: int = 0
    order: int = 2  # HEALPix order of the coarse sampling
    offset_range: float = 5.0
    offset_step: float = 2.0
    sigma_offset_A: float = 10.0
    local: bool = False
    sigma_ang: float = 0.0
    res_shell: int = 5  # current resolution (Fourier shell of the box)
    incr_size: int = MIN_INCR_SIZE
    has_high_fsc_at_limit: bool = False
    nr_iter_wo_resol_gain: int = 0
    nr_iter_wo_large_changes: int = 0
    best_res_shell: int = 0
    fine_enough: bool = False
    converged: bool = False
    acc_rot: float = 999.0
    acc_trans_A: float = 999.0
    norm_average: float = 1.0
    perturb: float = 0.0
    ave_pmax: float = 0.0
    smallest_angle_change: float = 999.0
    smallest_offset_change: float = 999.0
    last_offset_change_A: float = 0.0

    def current_size(self, box: int, final: bool = False) -> int:
        """Image size of this iteration: 2 (resolution shell + increment), at most the box (the whole box in
        the final iteration of an auto-refine)."""
        return box if final else int(min(box, 2 * (self.res_shell + self.incr_size)))

    def perturb_sampling(self, seed: int) -> None:
        self.perturb = next_perturbation(self.perturb, seed, self.iteration)

    def update_resolution(self, new_shell: int) -> None:
        """RELION updateCurrentResolution: the current shell and the count of iterations without a gain."""
        old = self.res_shell
        self.res_shell = new_shell
        gain = new_shell > self.best_res_shell
        self.best_res_shell = max(self.best_res_shell, new_shell)
        self.nr_iter_wo_resol_gain = 0 if (gain and new_shell > old) else self.nr_iter_wo_resol_gain + 1

    def update_image_size_increment(self, fsc: np.ndarray, current_size: int, box: int) -> None:
        """RELION updateImageSizeAndResolutionPointers (auto-refine): the increment beyond the resolution is the
        distance between the FSC 0.5 and 0.143 shells plus 5 (at least 10); a quarter of the box once the FSC
        at the edge of the current size was above 0.2 and <Pmax> > 0.1 (the images are too small)."""
        s143, s05 = resolution_shell(fsc, 0.143), resolution_shell(fsc, 0.5)
        self.incr_size = max(MIN_INCR_SIZE, s143 - s05 + 5)
        if fsc[min(current_size // 2 - 1, fsc.size - 1)] > 0.2:
            self.has_high_fsc_at_limit = True
        if self.ave_pmax > 0.1 and self.has_high_fsc_at_limit:
            self.incr_size = int(round(0.25 * box / 2))

    def update_changes(self, angle_change: float, offset_change_A: float, fine_angle: float,
                       fine_offset_A: float) -> None:
        """RELION's hidden-variable change monitor: an iteration has no large changes when neither the mean
        angular change nor the rms offset change beats 1/1.03 of its smallest value so far (changes below 0.4 x
        the fine sampling step count as small)."""
        small_a = angle_change / max(fine_angle, 1e-9) < 0.40
        small_o = offset_change_A / max(fine_offset_A, 1e-9) < 0.40
        no_large = (small_a or 1.03 * angle_change >= self.smallest_angle_change) and \
                   (small_o or 1.03 * offset_change_A >= self.smallest_offset_change)
        self.smallest_angle_change = min(self.smallest_angle_change, angle_change)
        self.smallest_offset_change = min(self.smallest_offset_change, offset_change_A)
        self.nr_iter_wo_large_changes = self.nr_iter_wo_large_changes + 1 if no_large else 0

    def check_convergence(self) -> None:
        """RELION checkConvergence (auto-refine): converged when the sampling is fine enough and neither the
        resolution nor the hidden variables changed in the last iteration."""
        self.converged = self.fine_enough and self.nr_iter_wo_resol_gain >= 1 and self.nr_iter_wo_large_changes >= 1

    def update_angular_sampling(self, pixel_size: float, auto_local_order: int) -> str:
        """RELION updateAngularSampling (auto-refine): once the resolution and the hidden variables have stalled,
        one HEALPix order finer and translations finer (from the accuracy estimates), local searches from
        ``auto_local_order``; "fine enough" when the fine step is below 0.75 x the rotational accuracy.
        Returns what changed, for the log ("" if nothing)."""
        if self.fine_enough or self.nr_iter_wo_resol_gain < 1 or self.nr_iter_wo_large_changes < 1:
            return ""
        fine_step = angular_step(self.order) / 2
        if fine_step < 0.75 * self.acc_rot:
            self.fine_enough = True
            return (f"angular sampling fine enough ({fine_step:g}° < 0.75 x accuracy {self.acc_rot:.2f}°): "
                    "no further increase")
        self.order += 1
        new_fine_step = angular_step(self.order) / 2
        acc_trans_px = self.acc_trans_A / pixel_size
        step = 2 * min(1.5 / pixel_size, 0.75 * acc_trans_px)
        rng = min(5.0 * self.last_offset_change_A / pixel_size, 1.3 * self.offset_range)
        rng = max(rng, 1.5 * step)
        if rng > 4 * step:
            rng /= 2
        if rng > 4 * step:
            step = rng / 4
        if step <= self.offset_step:
            self.offset_step, self.offset_range = step, rng
        self.nr_iter_wo_resol_gain = 0
        self.nr_iter_wo_large_changes = 0
        msg = (f"sampling: HEALPix order {self.order} ({angular_step(self.order):g}°, fine {new_fine_step:g}°), "
               f"translations range {self.offset_range:.2f} step {self.offset_step:.2f} px "
               f"(accuracy {self.acc_rot:.2f}°, {self.acc_trans_A:.2f} Å)")
        if self.order >= auto_local_order:
            self.local = True
        if self.local:
            self.sigma_ang = 2.0 * new_fine_step
            msg += f"; local searches, sigma {self.sigma_ang:.2f}°"
        return msg
