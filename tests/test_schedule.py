"""RELION's auto-refine schedule (compute/schedule.py) and accuracy estimate (compute/accuracy.py), driven by
scripted per-iteration inputs. Every expected number below is derived by hand from RELION 5.0.1's rules
(MlOptimiser::updateAngularSampling, checkConvergence, updateCurrentResolution,
updateImageSizeAndResolutionPointers, updateOverallChangesInHiddenVariables, calculateExpectedAngularErrors;
docs/relion_schedule.md walks through the derivations). No images: fast."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from napari_gpu_relion.compute import accuracy as acc
from napari_gpu_relion.compute.ctf import CtfParams, ctf_from_frequencies
from napari_gpu_relion.compute.expectation import pixel_set
from napari_gpu_relion.compute.geometry import euler_to_matrix, symmetry_matrices
from napari_gpu_relion.compute.projector import prepare_reference, project_pixels
from napari_gpu_relion.compute.sampling import angular_step
from napari_gpu_relion.compute.schedule import (
    EMState,
    fsc_crossing,
    orientation_change_deg,
    resolution_angular_step,
)

BOX, APIX = 128, 2.54  # the issue's data: 70S ribosome, box 128, 2.54 Å/px


@dataclass
class Step:
    """What one iteration reports: the accuracy estimated before its E-step (degrees, Å), and after its
    M-step the resolution shell, mean orientation change (degrees) and rms offset change (Å)."""

    acc_rot: float
    acc_trans_A: float
    res: int = 0
    angle: float = 0.0
    offset_A: float = 0.0


def fsc_curve(res: int, n: int = BOX // 2 + 1) -> np.ndarray:
    """An FSC that crosses 0.5 at shell res + 1 and 0.143 at res + 2 (incr_size stays 10)."""
    f = np.zeros(n)
    f[:res + 1] = 0.9
    f[res + 1] = 0.3
    return f


def run_schedule(script: list[Step], *, order: int = 2, auto_local: int = 4, firstiter_cc: bool = True,
                 ave_pmax: float = 0.05, **options) -> list[dict]:
    """Drive EMState as jobs/refine3d.py does (plan before the E-step, finish after the M-step) and record
    the decisions of each iteration until the final one."""
    st = EMState(order=order, offset_range=5.0, offset_step=2.0)
    st.start_auto_refine(BOX, APIX, 60.0, auto_local)
    trace = []
    for s in script:
        st.iteration += 1
        cc = firstiter_cc and st.iteration == 1
        sizes = []

        def accuracy(size, s=s, sizes=sizes):
            sizes.append(size)
            return s.acc_rot, s.acc_trans_A

        plan = st.plan_auto_refine_iteration(BOX, APIX, auto_local, None if cc else accuracy, **options)
        trace.append(dict(it=st.iteration, order=st.order, local=st.local, sigma=st.sigma_ang, size=plan.current_size,
                          range_A=st.offset_range * APIX, step_A=st.offset_step * APIX, final=plan.final,
                          fine_enough=st.fine_enough, acc_sizes=sizes, changed=bool(plan.message)))
        if plan.final:
            break
        st.finish_auto_refine_iteration(st.res_shell if cc else s.res, fsc_curve(s.res), plan.current_size, ave_pmax,
                                        s.angle, s.offset_A, angular_step(st.order) / 2, st.offset_step / 2 * APIX)
    return trace


# The issue's RELION run: 5 iterations at 7.5°, 2 at 3.75°, then 2 per local step, 14 + the final one. Inputs
# (accuracies falling, resolution rising then stalling, changes shrinking) that make RELION's rules do that.
ISSUE_SCRIPT = [
    Step(0, 0, 5, 40.0, 3.0),  # 1: CC iteration, no accuracy; resolution stays at ini_high
    Step(8.0, 5.0, 12, 20.0, 2.0),
    Step(4.0, 3.0, 16, 8.0, 1.5),
    Step(3.0, 2.5, 18, 5.0, 1.2),
    Step(2.5, 2.0, 18, 4.9, 1.2),  # 5: no gain; changes within 3% of the smallest
    Step(2.0, 2.0, 19, 2.0, 0.8),  # 6: order 3
    Step(1.8, 1.6, 19, 1.4, 0.5),
    Step(1.6, 1.2, 21, 1.0, 0.4),  # 8: order 4, local searches
    Step(1.5, 1.0, 21, 0.7, 0.3),
    Step(1.4, 0.9, 22, 0.5, 0.25),  # 10: order 5
    Step(1.2, 0.8, 22, 0.3, 0.2),
    Step(1.2, 0.8, 23, 0.25, 0.2),  # 12: order 6
    Step(1.1, 0.8, 23, 0.18, 0.2),
    Step(1.0, 0.8, 23, 0.17, 0.18),  # 14: fine enough (0.46875 < 0.75)
    Step(0.9, 0.7),  # 15: final
]


def test_issue_trace_5_at_7p5_2_at_3p75_then_2_per_local_step():
    trace = run_schedule(ISSUE_SCRIPT)
    assert [t["order"] for t in trace] == [2] * 5 + [3] * 2 + [4] * 2 + [5] * 2 + [6] * 4
    assert [t["final"] for t in trace] == [False] * 14 + [True]
    assert [t["local"] for t in trace] == [False] * 7 + [True] * 8
    # sigma = 2 x the fine step of the new order: 2 x 1.875, 2 x 0.9375, 2 x 0.46875
    assert [t["sigma"] for t in trace] == [0.0] * 7 + [3.75] * 2 + [1.875] * 2 + [0.9375] * 4
    # image size 2 (previous resolution + 10), the whole box in the final iteration
    assert [t["size"] for t in trace] == [30, 30, 44, 52, 56, 56, 58, 58, 62, 62, 64, 64, 66, 66, 128]
    # translations (Å): step 2 min(1.5, 0.75 acc_trans), range 5 x last rms change clamped to [1.5 step, 1.3 old]
    want = [(12.7, 5.08)] * 5 + [(6.0, 3.0)] * 2 + [(2.7, 1.8)] * 2 + [(2.025, 1.35)] * 2 + [(1.8, 1.2)] * 4
    np.testing.assert_allclose([(t["range_A"], t["step_A"]) for t in trace], want, rtol=1e-12)
    # accuracy: every iteration but the CC one, at that iteration's size (the final's whole box included)
    assert [t["acc_sizes"] for t in trace] == [[]] + [[t["size"]] for t in trace[1:]]
    assert [t["fine_enough"] for t in trace] == [False] * 13 + [True] * 2
    assert [t["it"] for t in trace if t["changed"]] == [6, 8, 10, 12, 14, 15]  # 14, 15: "fine enough"


def test_a_finer_sampling_lasts_at_least_two_iterations():
    """A finer sampling resets the smallest class change to 9999999, so its first iteration always has 'large'
    changes (1.03 x 0 < 9999999) however small the angles and offsets moved: order 3 at iteration 4 cannot be
    left at iteration 5, only at 6."""
    script = [Step(0, 0, 5, 40.0, 3.0), Step(8.0, 5.0, 12, 20.0, 2.0),
              Step(2.0, 2.0, 12, 19.8, 1.95),  # no gain, changes within 3%: order 3 next
              Step(2.0, 2.0, 12, 1.0, 0.3),  # 4: order 3; changes below 0.4 x the fine steps, no gain
              Step(1.5, 1.0, 12, 1.0, 0.3),  # 5: still order 3
              Step(1.5, 1.0, 12, 0.5, 0.3)]  # 6: order 4
    assert [t["order"] for t in run_schedule(script)] == [2, 2, 2, 3, 3, 4]


def test_final_iteration_still_updates_the_sampling():
    """RELION calls updateAngularSampling in the final iteration too: an accuracy estimated at the whole box
    that is finer than 0.46875 / 0.75 = 0.625° makes the final iteration one HEALPix order finer."""
    script = ISSUE_SCRIPT[:-1] + [Step(0.6, 0.5)]
    last = run_schedule(script)[-1]
    assert last["final"] and last["order"] == 7 and not last["fine_enough"]
    assert last["sigma"] == pytest.approx(2 * 360 / (6 * 2**8))
    # step 2 min(1.5, 0.375) = 0.75 Å; range max(min(1.3 x 1.8, 5 x 0.18), 1.5 x 0.75) = 1.125 Å
    assert (last["range_A"], last["step_A"]) == pytest.approx((1.125, 0.75))


def test_no_firstiter_cc_iteration_one_estimates_accuracy_and_monitors_changes():
    """Without --firstiter_cc the accuracy is estimated in iteration 1 too, and iteration 1's resolution gain
    counts; the change monitor runs from iteration 1 (always 'large' there: no smallest class change yet)."""
    script = [Step(9.0, 6.0, 12, 40.0, 3.0), Step(8.0, 5.0, 12, 41.0, 3.0), Step(2.0, 2.0, 14, 2.0, 1.0)]
    trace = run_schedule(script, firstiter_cc=False)
    assert trace[0]["acc_sizes"] == [30]
    # it 2: no gain, changes within 3% of iteration 1's -> it 3 refines (it would not, were it 1 unmonitored)
    assert [t["order"] for t in trace] == [2, 2, 3]


def test_local_searches_from_the_start_when_the_initial_order_is_the_local_one():
    st = EMState(order=4)
    st.start_auto_refine(BOX, APIX, 60.0, 4)
    assert st.local and st.sigma_ang == 2 * 1.875
    assert st.res_shell == 5  # ROUND(128 x 2.54 / 60 = 5.42)
    st3 = EMState(order=3)
    st3.start_auto_refine(BOX, APIX, 60.0, 4)
    assert not st3.local and st3.sigma_ang == 0.0


def test_resolution_gain_is_against_the_previous_iteration_not_the_best():
    """updateCurrentResolution: 12, 11, 12 counts a gain in the third (12 > 11) although 12 is no new best."""
    st = EMState(res_shell=10)
    counts = []
    for shell in (12, 11, 12, 12, 13):
        st.update_resolution(shell)
        counts.append(st.nr_iter_wo_resol_gain)
    assert counts == [0, 1, 0, 1, 0]
    assert st.res_shell == 13 and st.best_res_shell == 13


def test_image_size_increment_rules():
    st = EMState(res_shell=20)
    f = np.zeros(65)
    f[:10] = 0.9
    f[10:22] = 0.3  # 0.5 crossed at 10, 0.143 at 22: incr = 22 - 10 + 5 = 17
    st.update_image_size_increment(f, current_size=2 * 30)
    assert st.incr_size == 17 and not st.has_high_fsc_at_limit  # FSC[29] = 0
    assert st.current_size(BOX) == 2 * (20 + 17)
    g = fsc_curve(20)  # crossings 21 and 22: 6 < 17, incr_size never goes down
    st.update_image_size_increment(g, current_size=2 * 30)
    assert st.incr_size == 17
    # FSC above 0.2 at shell current_size/2 - 1 = 19 (for size 40): has_high_fsc_at_limit, for good
    h = np.zeros(65)
    h[:19], h[19] = 0.9, 0.25
    st.update_image_size_increment(h, current_size=42)  # shell 20: 0
    assert not st.has_high_fsc_at_limit
    st.update_image_size_increment(h, current_size=40)
    assert st.has_high_fsc_at_limit and st.incr_size == 17
    st.update_image_size_increment(np.zeros(65), current_size=40)
    assert st.has_high_fsc_at_limit
    # with it, <Pmax> > 0.1 asks for ROUND(box / 8) shells instead of incr_size, without changing incr_size
    st.ave_pmax = 0.2
    assert st.current_size(BOX) == 2 * (20 + 16) and st.current_size(100) == 2 * (20 + 13)  # ROUND(12.5)
    assert st.current_size(200) == 2 * (20 + 25)
    st.ave_pmax = 0.05
    assert st.current_size(BOX) == 2 * (20 + 17) and st.incr_size == 17
    assert st.current_size(BOX, final=True) == BOX
    # an FSC above 0.143 everywhere has no 0.143 crossing (-1): incr_size keeps its value
    assert fsc_crossing(np.full(65, 0.9), 0.143) == -1 and fsc_crossing(h, 0.143) == 20 and fsc_crossing(h, 0.5) == 19
    assert fsc_crossing(np.r_[0.1, np.ones(64)], 0.143) == 0
    st.update_image_size_increment(np.r_[np.ones(5), np.full(60, 0.3)], current_size=40)
    assert st.incr_size == 17


def test_hidden_variable_change_monitor():
    st = EMState()
    fine_a, fine_o = 7.5, 2.54  # degrees, Å
    st.update_changes(10.0, 2.0, fine_a, fine_o)  # first: the smallest class change is still 9999999
    assert st.nr_iter_wo_large_changes == 0 and st.smallest_class_change == 0
    st.update_changes(9.8, 2.0, fine_a, fine_o)  # 1.03 x 9.8 = 10.09 >= 10: not large
    assert st.nr_iter_wo_large_changes == 1
    st.update_changes(9.0, 2.0, fine_a, fine_o)  # 9.27 < 9.8 and 9 > 0.4 x 7.5: large
    assert st.nr_iter_wo_large_changes == 0
    st.update_changes(2.9, 1.0, fine_a, fine_o)  # both below 0.4 x their fine step: small
    assert st.nr_iter_wo_large_changes == 1
    st.update_changes(3.1, 0.5, fine_a, fine_o)  # 3.1 > 0.4 x 7.5 but 1.03 x 3.1 >= 2.9: not large
    assert st.nr_iter_wo_large_changes == 2
    st.update_changes(0.1, 0.1, fine_a, fine_o, class_change=0.6)  # classes moved: 0.618 >= 0 still fine
    assert st.nr_iter_wo_large_changes == 3 and st.smallest_class_change == 0
    # a finer sampling resets the smallest changes: the next iteration has large changes whatever they are
    st.nr_iter_wo_resol_gain, st.acc_rot, st.acc_trans_A = 1, 1.0, 1.0
    assert st.update_angular_sampling(APIX, 4)
    assert (st.smallest_class_change, st.smallest_angle_change, st.smallest_offset_change) == (9999999, 999, 999)
    st.update_changes(0.0, 0.0, fine_a / 2, fine_o)
    assert st.nr_iter_wo_large_changes == 0


def test_angular_sampling_needs_both_counters_and_fine_enough_is_decided_again():
    st = EMState(order=3, acc_rot=6.0, acc_trans_A=3.0)
    st.nr_iter_wo_resol_gain, st.nr_iter_wo_large_changes = 1, 0
    assert st.update_angular_sampling(APIX, 4) == "" and st.order == 3
    st.nr_iter_wo_resol_gain, st.nr_iter_wo_large_changes = 0, 1
    assert st.update_angular_sampling(APIX, 4) == "" and st.order == 3
    st.nr_iter_wo_resol_gain = 1
    st.update_angular_sampling(APIX, 4)  # 3.75 < 0.75 x 6 = 4.5: fine enough, counters kept
    assert st.fine_enough and st.order == 3 and st.nr_iter_wo_resol_gain == 1
    st.check_convergence()
    assert st.converged
    st2 = EMState(order=3, acc_rot=6.0, acc_trans_A=3.0, fine_enough=True, nr_iter_wo_resol_gain=1,
                  nr_iter_wo_large_changes=1)
    st2.acc_rot = 4.0  # 3.75 < 3.0 no longer: one order finer after all
    st2.update_angular_sampling(APIX, 4)
    assert not st2.fine_enough and st2.order == 4 and st2.local and st2.nr_iter_wo_resol_gain == 0
    st2.check_convergence()
    assert not st2.converged


def test_translation_step_and_range_rules():
    # range halved once: 1.3 x 12.7 = 16.51 Å > 4 x 3 Å -> 8.255 Å, step 2 x 1.5 = 3 Å
    st = EMState(order=2, offset_range=5.0, offset_step=2.0, acc_rot=0.5, acc_trans_A=4.0,
                 nr_iter_wo_resol_gain=1, nr_iter_wo_large_changes=1, last_offset_change_A=10.0)
    st.update_angular_sampling(APIX, 4)
    assert (st.offset_range * APIX, st.offset_step * APIX) == pytest.approx((8.255, 3.0))
    # still above 4 steps after halving: step = range / 4 (1 Å/px: range 26 -> 13, step 0.6 -> 3.25)
    st = EMState(order=2, offset_range=20.0, offset_step=4.0, acc_rot=0.5, acc_trans_A=0.4,
                 nr_iter_wo_resol_gain=1, nr_iter_wo_large_changes=1, last_offset_change_A=10.0)
    st.update_angular_sampling(1.0, 4)
    assert (st.offset_range, st.offset_step) == pytest.approx((13.0, 3.25))
    # never coarser: the same with a 2 Å step now keeps step and range
    st = EMState(order=2, offset_range=20.0, offset_step=2.0, acc_rot=0.5, acc_trans_A=0.4,
                 nr_iter_wo_resol_gain=1, nr_iter_wo_large_changes=1, last_offset_change_A=10.0)
    st.update_angular_sampling(1.0, 4)
    assert (st.offset_range, st.offset_step, st.order) == (20.0, 2.0, 3)
    # at least 1.5 steps: a tiny last change gives range 1.5 x 3 Å
    st = EMState(order=2, offset_range=5.0, offset_step=2.0, acc_rot=0.5, acc_trans_A=4.0,
                 nr_iter_wo_resol_gain=1, nr_iter_wo_large_changes=1, last_offset_change_A=0.01)
    st.update_angular_sampling(APIX, 4)
    assert st.offset_range * APIX == pytest.approx(4.5)


def test_auto_resol_angles_and_auto_ignore_angles():
    # D = 300 Å, shell 20 at 325.12 Å: 360 / ceil(pi 300 20 / 325.12) = 360 / 58 = 6.21° < 7.5°
    assert resolution_angular_step(20, BOX, APIX, 300.0) == pytest.approx(360 / 58)
    st = EMState(order=2, acc_rot=0.5, acc_trans_A=2.0, res_shell=20, nr_iter_wo_large_changes=1)
    assert st.update_angular_sampling(APIX, 4) == ""  # resolution still improving
    assert st.update_angular_sampling(APIX, 4, box=BOX, diameter_A=300.0, auto_resol_angles=True)
    assert st.order == 3
    # at order 3 (3.75°) shell 40 asks for 360 / 116 = 3.10°, but not into the first local order (3 + 1 = 4)
    st.res_shell, st.nr_iter_wo_large_changes = 40, 1
    assert st.update_angular_sampling(APIX, 4, box=BOX, diameter_A=300.0, auto_resol_angles=True) == ""
    assert st.update_angular_sampling(APIX, 5, box=BOX, diameter_A=300.0, auto_resol_angles=True)
    assert st.order == 4
    st.order, st.local, st.nr_iter_wo_large_changes = 3, False, 0
    # --auto_ignore_angles: the hidden-variable counter is not needed, for the sampling nor for convergence
    st.nr_iter_wo_resol_gain, st.nr_iter_wo_large_changes = 1, 0
    assert st.update_angular_sampling(APIX, 4, auto_ignore_angles=True) and st.order == 4
    st.fine_enough, st.nr_iter_wo_resol_gain = True, 1
    st.check_convergence()
    assert not st.converged
    st.check_convergence(auto_ignore_angles=True)
    assert st.converged


def test_orientation_change_is_relions_mean_axis_angle():
    rng = np.random.default_rng(1)
    A = euler_to_matrix(*rng.uniform([-180, 0, -180], [180, 180, 180], (50, 3)).T)
    # an in-plane turn by 3°: two image axes turn by 3°, the viewing direction not at all
    A_psi = np.einsum("ij,njk->nik", euler_to_matrix(0.0, 0.0, 3.0), A)
    np.testing.assert_allclose(orientation_change_deg(A, A_psi), 2.0, atol=1e-6)
    # a turn by t about a map axis n: each row r turns by acos(cos t + (1 - cos t) (r.n)^2)
    n = np.array([1.0, 2.0, 2.0]) / 3.0
    t = np.radians(10.0)
    K = np.array([[0, -n[2], n[1]], [n[2], 0, -n[0]], [-n[1], n[0], 0]])
    R = np.eye(3) + np.sin(t) * K + (1 - np.cos(t)) * K @ K
    want = np.degrees(np.arccos(np.cos(t) + (1 - np.cos(t)) * np.einsum("nij,j->ni", A, n) ** 2)).mean(-1)
    np.testing.assert_allclose(orientation_change_deg(A, A @ R), want, atol=1e-6)
    # symmetry: a 180° turn about the map's z is no change in C2; in C1 row r turns by acos(2 r_z^2 - 1)
    Rz = euler_to_matrix(180.0, 0.0, 0.0)
    want = np.degrees(np.arccos(np.clip(2 * A[:, :, 2] ** 2 - 1, -1, 1))).mean(-1)
    np.testing.assert_allclose(orientation_change_deg(A, A @ Rz), want, atol=1e-5)
    np.testing.assert_allclose(orientation_change_deg(np.eye(3)[None], Rz[None]), 120.0, atol=1e-6)
    np.testing.assert_allclose(orientation_change_deg(A, A @ Rz, symmetry_matrices("C2")), 0.0, atol=1e-5)


# ---- the accuracy estimate ----

def test_error_ladders_are_relions():
    """RELION's loop adds 0.05 below 0.2°, 0.1 below 1°, 0.2 below 2°, 0.5 below 5°, 1 below 10°, 2 below 20°,
    then 5 (shifts 0.1/0.2/0.5/1/2 px below 1/2/5/10 px), in float64: 0.05 x 4 lands on 0.2 (not below it),
    ten 0.1 steps land just below 1.0, so 1.1 follows, and the ladder runs on 0.1 above the round numbers."""
    want_rot = ([0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.3, 1.5, 1.7, 1.9, 2.1, 2.6, 3.1,
                 3.6, 4.1, 4.6, 5.1] + [6.1, 7.1, 8.1, 9.1, 10.1, 12.1, 14.1, 16.1, 18.1, 20.1, 25.1])
    np.testing.assert_allclose(acc.ANGLE_ERRORS, want_rot, atol=1e-9)
    assert acc.ANGLE_UNRESOLVED == pytest.approx(30.1)
    want_shift = [0.1 * i for i in range(1, 11)] + [1.1, 1.3, 1.5, 1.7, 1.9, 2.1, 2.6, 3.1, 3.6, 4.1, 4.6, 5.1, 6.1,
                                                   7.1, 8.1, 9.1]
    np.testing.assert_allclose(acc.SHIFT_ERRORS, want_shift, atol=1e-9)
    assert acc.SHIFT_UNRESOLVED == pytest.approx(10.1)


def test_accuracy_particles_follow_relions_random_order():
    subset = np.array([1, 2] * 100 + [1] * 20)  # 120 in half 1, 100 in half 2
    og = np.zeros(subset.size, int)
    og[::3] = 1  # two optics groups
    rows = acc.accuracy_particles(subset, og, seed=3)
    assert rows.size == 100 and np.all(subset[rows] == 1)
    assert np.all(np.diff(og[rows]) >= 0)  # sorted by optics group: the first 100 are from group 0 first
    assert np.count_nonzero(og[rows] == 0) == min(100, np.count_nonzero((subset == 1) & (og == 0)))
    np.testing.assert_array_equal(rows, acc.accuracy_particles(subset, og, seed=3))  # fixed for the run
    assert not np.array_equal(rows, np.flatnonzero(subset == 1)[:100])  # not the first in file order
    small = np.array([1, 2] * 30)  # 60 particles: 30 of half 1, then 30 of half 2
    r = acc.accuracy_particles(small, np.zeros(60, int), seed=0)
    assert r.size == 60 and np.all(small[r[:30]] == 1) and np.all(small[r[30:]] == 2)


def _reference(n: int = 24, seed: int = 0):
    rng = np.random.default_rng(seed)
    v = rng.normal(size=(n, n, n))
    k = np.fft.fftfreq(n)
    g = np.exp(-(k[:, None, None] ** 2 + k[None, :, None] ** 2 + k[None, None, :] ** 2) / (2 * 0.08**2))
    v = np.real(np.fft.ifftn(np.fft.fftn(v) * g))
    return prepare_reference(v, 2, r_max=n / 2)


def _relion_loop(ref, pix, angle, ctf, sigma2, pid, seed, mode):
    """calculateExpectedAngularErrors for one particle, as RELION's while loop: grow the error, project anew
    (or shift by a phase ramp), stop once sum |C (F1 - F2)|^2 / (2 sigma2) > ln 100 or past the cap."""
    u = np.random.default_rng(seed + pid).random()
    w = np.where(pix.shell >= 1, 1.0 / (2.0 * sigma2), 0.0)
    c = np.ones(pix.npix) if ctf is None else np.asarray(
        ctf_from_frequencies(ctf, pix.kx / (pix.box * 1.0), pix.ky / (pix.box * 1.0)), np.float64)[0]
    F1 = project_pixels(ref, euler_to_matrix(*angle)[None], pix.kx, pix.ky)[0].astype(np.complex128)
    err, snr = 0.0, 0.0
    while snr <= acc.LN100:
        if mode == "rot":
            err += 0.05 if err < 0.2 else 0.1 if err < 1 else 0.2 if err < 2 else 0.5 if err < 5 else \
                1.0 if err < 10 else 2.0 if err < 20 else 5.0
            if err > 30:
                break
            a2 = np.array(angle, float)
            a2[0 if u < 0.3333 else 1 if u < 0.6667 else 2] += err
            F2 = project_pixels(ref, euler_to_matrix(*a2)[None], pix.kx, pix.ky)[0].astype(np.complex128)
        else:
            err += 0.1 if err < 1 else 0.2 if err < 2 else 0.5 if err < 5 else 1.0 if err < 10 else 2.0
            if err > 10:
                break
            k = pix.kx if u < 0.5 else pix.ky
            F2 = F1 * np.exp(-2j * np.pi * k * err / pix.box)
        snr = float((np.abs(c * (F1 - F2)) ** 2 * w).sum())
    return err


@pytest.mark.parametrize("with_ctf", [False, True])
def test_accuracy_estimate_equals_relions_loop(with_ctf):
    ref = _reference()
    pix = pixel_set(24, 20)  # a current size below the box
    rng = np.random.default_rng(5)
    n = 6
    angles = rng.uniform([-180, 20, -180], [180, 160, 180], (n, 3))
    ids = np.array([3, 17, 4, 99, 12, 40])
    power = np.abs(project_pixels(ref, euler_to_matrix(*angles.T), pix.kx, pix.ky)) ** 2
    shell_power = np.bincount(pix.shell, weights=power.mean(0)) / np.bincount(pix.shell)
    noise = np.array([1.0, 25.0, 400.0, 1e6, 2500.0, 100.0])  # errors from the fine end to the cap of the ladder
    sigma2 = 0.02 * noise[:, None] * shell_power[pix.shell][None, :]  # particle 3 is hopeless: 30.1° and 10.1 px
    ctf = CtfParams(defocus_u=rng.uniform(8000, 20000, n), defocus_v=rng.uniform(8000, 20000, n),
                    defocus_angle=rng.uniform(0, 180, n)) if with_ctf else None
    got_rot, got_trans_A = acc.estimate_accuracy(ref, pix, angles, ctf, sigma2, 1.0, seed=7, particle_ids=ids,
                                                 max_values=5000)  # several chunks
    rot = [_relion_loop(ref, pix, angles[i], None if ctf is None else ctf.subset([i]), sigma2[i], ids[i], 7, "rot")
           for i in range(n)]
    sh = [_relion_loop(ref, pix, angles[i], None if ctf is None else ctf.subset([i]), sigma2[i], ids[i], 7, "shift")
          for i in range(n)]
    assert rot[3] == pytest.approx(30.1) and sh[3] == pytest.approx(10.1)
    assert max(np.delete(rot, 3)) < 30 and max(np.delete(sh, 3)) < 10  # the others resolve on the ladder,
    assert len(set(rot)) == n and len(set(sh)) >= 5  # at errors from 0.1 to 25
    assert got_rot == pytest.approx(np.mean(rot), abs=1e-9)
    assert got_trans_A == pytest.approx(np.mean(sh), abs=1e-9)
    # in Å: the same errors times the pixel size
    _, trans2 = acc.estimate_accuracy(ref, pix, angles, ctf, sigma2, 2.5, seed=7, particle_ids=ids)
    if ctf is None:
        assert trans2 == pytest.approx(2.5 * got_trans_A)


def test_more_signal_gives_finer_accuracy():
    ref = _reference()
    pix = pixel_set(24, 24)
    angles = np.random.default_rng(2).uniform([-180, 20, -180], [180, 160, 180], (8, 3))
    s2 = np.ones((8, pix.npix))
    coarse = acc.estimate_accuracy(ref, pix, angles, None, 1e-2 * s2, 1.0)
    fine = acc.estimate_accuracy(ref, pix, angles, None, 1e-4 * s2, 1.0)
    assert fine[0] < coarse[0] and fine[1] < coarse[1]
    assert math.isfinite(coarse[0]) and coarse[0] <= 30.1


@pytest.mark.parametrize("seed", range(12))
def test_the_sampling_perturbation_follows_relions_draws(seed):
    """RELION's HealpixSampling adds U(0.25, 0.5) x its factor (0.5) to the perturbation once at setup and once per
    iteration, wrapped into [-0.5, 0.5) sampling steps: iteration 1's, the second draw, lies in [-0.5, 0), and each
    later one moves by 0.25-0.5 (modulo 1). The perturbation of a job's iteration 0 is that setup draw."""
    st = EMState()
    values = []
    for it in range(6):
        st.iteration = it
        st.perturb_sampling(seed)
        values.append(st.perturb)
    assert 0.25 <= values[0] < 0.5 and -0.5 <= values[1] < 0.0
    steps = (np.diff(values) % 1.0)
    assert np.all((steps >= 0.25 - 1e-12) & (steps < 0.5 + 1e-12)), values
    assert all(-0.5 <= v < 0.5 for v in values)


RELION_LOG = Path(__file__).parent / "data" / "relion5_autorefine_emd11007_box192_log.txt"


def _relion_iterations(path: Path) -> list[dict]:
    """The 'Auto-refine:' lines of a RELION 5.0.1 relion_refine_mpi run, per iteration: what it printed at the
    iteration's start (resolution and change counters after the previous iteration, the accuracy it estimated, the
    sampling it chose) and whether it entered the final iteration."""
    its: list[dict] = []
    pats = {"res": r"Resolution= ([\d.]+) \(no gain for (\d+) iter\)",
            "changes": r"Changes in angles= ([\d.]+) degrees; and in offsets= ([\d.]+) Angstroms \(no gain for (\d+)",
            "acc": r"Estimated accuracy angles= ([\d.]+) degrees; offsets= ([\d.]+) Angstroms",
            "step": r"Angular step= ([\d.]+) degrees; local searches= (\w+)",
            "offsets": r"Offset search range= ([\d.]+) Angstroms; offset step= ([\d.]+) Angstroms"}
    for line in path.read_text().splitlines():
        if m := re.search(r"Iteration= (\d+)", line):
            its.append({"it": int(m[1]), "final": False})
        elif "entering last iteration" in line:
            its[-1]["final"] = True
        else:
            for key, pat in pats.items():
                if m := re.search(pat, line):
                    its[-1][key] = m.groups()
    return its


def test_relions_own_converged_run_is_followed_decision_by_decision():
    """RELION 5's auto-refine of 4,000 EMD-11007 particles at box 192, 1.4 Å/px (thirty-eighth session, 19+1
    iterations, tests/data/relion5_autorefine_emd11007_box192_log.txt), replayed through EMState with the
    resolution, hidden-variable changes and accuracies RELION printed, and the two rules jobs/refine3d.py applies
    as relion_refine_mpi does (the change monitor's "small" thresholds stay 0.4 x the first iteration's fine steps:
    MPI RELION's leader never updates its sampling; without rlnClassNumber every particle changes class in
    iteration 1): at every iteration our counters of iterations without a resolution gain and without large changes
    equal RELION's, our sampling (fine angular step, local searches, offset range and fine step) equals the one it
    chose, and the final iteration is its iteration 20. (With the current steps, or no class change, the counters
    part at iterations 11 and 3.)"""
    box, apix, auto_local = 192, 1.4, 4
    its = _relion_iterations(RELION_LOG)
    assert len(its) == 20 and its[-1]["final"] and not any(r["final"] for r in its[:-1])
    st = EMState(order=2, offset_range=5.0, offset_step=2.0)
    st.start_auto_refine(box, apix, 30.0, auto_local)
    orders = []
    for k, r in enumerate(its):
        st.iteration += 1
        assert st.iteration == r["it"]
        res_A, no_gain = float(r["res"][0]), int(r["res"][1])
        assert box * apix / st.res_shell == pytest.approx(res_A, rel=1e-5), r["it"]
        assert st.nr_iter_wo_resol_gain == no_gain, (r["it"], st.nr_iter_wo_resol_gain, no_gain)
        if k:  # iteration 1 prints RELION's starting 999s
            assert st.nr_iter_wo_large_changes == int(r["changes"][2]), (r["it"], st.nr_iter_wo_large_changes)
        acc_rot, acc_trans = (float(v) for v in r["acc"])
        plan = st.plan_auto_refine_iteration(box, apix, auto_local, lambda size, a=acc_rot, t=acc_trans: (a, t))
        assert plan.final == r["final"], r["it"]
        if k:  # RELION prints the sampling from iteration 2 on
            step, local = float(r["step"][0]), r["step"][1] == "true"
            range_A, fine_step_A = (float(v) for v in r["offsets"])
            assert angular_step(st.order + 1) == pytest.approx(step, rel=1e-5), r["it"]
            assert st.local == local, r["it"]
            assert st.offset_range * apix == pytest.approx(range_A, rel=2e-4), r["it"]
            assert st.offset_step / 2 * apix == pytest.approx(fine_step_A, rel=2e-4), r["it"]
        orders.append(st.order)
        if plan.final:
            break
        nxt = its[k + 1]
        shell = round(box * apix / float(nxt["res"][0]))
        angle, offset = float(nxt["changes"][0]), float(nxt["changes"][1])
        moved = 1.0 if k == 0 else 0.0  # the input STAR has no rlnClassNumber: every particle's class "changed"
        first_steps = (angular_step(2 + 1), 2.0 / 2 * apix)  # refine3d's monitor_steps: iteration 1's fine steps
        st.finish_auto_refine_iteration(shell, fsc_curve(shell, box // 2 + 1), plan.current_size, 0.05, angle, offset,
                                        *first_steps, moved)
    assert st.iteration == 20 and plan.final
    assert orders == [2] * 5 + [3] * 3 + [4] * 2 + [5] * 2 + [6] * 2 + [7] * 2 + [8] * 4


def test_relions_resolution_skips_a_dip_of_the_fsc_that_its_first_drop_stops_at():
    """RELION's auto-refine resolution rule (updateCurrentResolution): the last shell before the first drop below
    the threshold, unless the curve is above it again more than 3 shells beyond (the highest such shell, scanning
    down). On an FSC that dips below 0.143 at shells 20-22 and is above it again up to shell 38 the first drop says
    19, the rule 38 (what refine3d reports); a recovery within 3 shells of the drop is not skipped. The same rule on
    the SSNR (resolution_shell_from_ssnr; SSNR > 1 where the joined FSC' > 0.5, i.e. the FSC > 1/7) gives the same
    shells, as RELION's final iteration does."""
    from napari_gpu_relion.compute.fsc import fsc_to_full, resolution_shell  # noqa: PLC0415
    from napari_gpu_relion.compute.maximization import resolution_shell_from_ssnr  # noqa: PLC0415

    def ssnr_of(f):
        full = fsc_to_full(f)
        return full / np.maximum(1.0 - full, 1e-12)

    shells = np.arange(65)
    f = np.clip(1.0 - shells / 45.0, 0.0, 1.0)  # 0.143 between shells 38 and 39
    dip = f.copy()
    dip[20:23] = 0.10
    assert resolution_shell(dip, 0.143) == 19
    assert resolution_shell(dip, 0.143, skip_dips=True) == 38 == resolution_shell(f, 0.143)
    assert resolution_shell_from_ssnr(ssnr_of(dip)) == 38
    short = f.copy()
    short[20:23] = 0.10
    short[26:] = 0.0  # above again at 23-25 only: 25 is beyond 19 + 3, so it counts
    assert resolution_shell(short, 0.143, skip_dips=True) == 25 == resolution_shell_from_ssnr(ssnr_of(short))
    shorter = f.copy()
    shorter[20] = 0.10
    shorter[23:] = 0.0  # above again at 21-22 only, not beyond 19 + 3: the first drop stands
    assert resolution_shell(shorter, 0.143, skip_dips=True) == 19 == resolution_shell_from_ssnr(ssnr_of(shorter))
