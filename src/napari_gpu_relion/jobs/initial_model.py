"""3D initial model from the particles alone (relion_refine --grad --denovo_3dref, RELION's "3D initial model").

The shared EM driver (jobs/em.py) with K classes and no reference: the first references are the particles
back-projected at random orientations (a blob; a different random subset per class), then every iteration aligns
a random mini-batch split into two pseudo half-sets (the driver's two "halves", both against the same
references) and moves each class along RELION's VDAM gradient (compute/initial_model.py). The mini-batch grows
and the resolution limit rises over the iterations (``GradSchedule``). With K > 1 the last iteration aligns every
particle, so that each particle's class in the final data STAR is its best class.

Symmetry: the run is in C1, as RELION's. With ``--sym`` other than C1, the largest class's final map is then
centred, turned onto the group's axes and averaged over the group (compute/symmetry_alignment.py, what
relion_align_symmetry --apply_sym --select_largest_class does in RELION's job) and written as initial_model.mrc
beside the run's files; the log gives how symmetric the map was before and after the turn.

Handedness: a map made from projections alone has either hand; check it against known structure (an alpha helix
turns right-handed) and flip it (reverse one axis) if needed.

Files (RELION's names under the --o rootname): run_itNNN_class001.mrc, run_itNNN_model.star,
run_itNNN_data.star, run_itNNN_optimiser.star and the gradient moments run_itNNN_1moment001.mrc (pseudo
half-set 1; half-set 2's numbered K + k) and run_itNNN_2moment001.mrc (listed in the model STAR as rlnGradMoment1
and rlnGradMoment2, as RELION does) at iteration 1, every ``--grad_write_iter`` iterations and at the last one,
and the final run_class001.mrc (+ run_model.star, run_data.star) when done. The moment images hold this
program's padded Fourier grids (single precision, cropped to the frequencies the run has reached; complex values
interleaved along x), not RELION's layout.

``--continue run_itNNN_optimiser.star`` goes on from any iteration whose files were written: the options, the
schedule and the random state come from the optimiser STAR (each iteration draws its mini-batch from a generator
seeded by (--random_seed, iteration), as RELION reseeds with random_seed + iter), the maps, noise spectra, class
and direction distributions from the model STAR, the moments from their images, and the particles' offsets and
classes from the data STAR; the continued run repeats the uninterrupted one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..compute.backend import to_host
from ..compute.backprojector import grid_shape
from ..compute.class_similarity import class_report
from ..compute.geometry import euler_to_matrix, symmetry_group
from ..compute.initial_model import (
    MU,
    GradSchedule,
    Moments,
    class_stepsize,
    default_subset_sizes,
    grid_to_reference,
    moment_blocks,
    moment_reach,
    moments_from_blocks,
    random_angle_average,
    reference_to_grid,
    vdam_update,
)
from ..compute.masks import soft_spherical_mask
from ..compute.maximization import update_sigma2, update_sigma_offset
from ..compute.sampling import Sampling
from ..compute.simulate import random_rotations
from ..compute.symmetry_alignment import align_and_symmetrize
from ..errors import InputError
from ..events import Finished, IterationFinished, IterationStarted, MapUpdated, Message
from ..io.atomic import copy_atomically
from ..io.jobdir import project_path
from ..io.mrc import read_mrc, write_mrc
from . import em, em_classification
from .common import param

JOB_NAME = "initial_model"
#: RELION's --maxsig in gradient iterations of a 3D job: 100 significant coarse samples per class and particle.
MAX_SIGNIFICANTS_PER_CLASS = 100


@dataclass(frozen=True)
class InitialModelOptions:
    """The options of this job beyond the shared ones (RELION's names; defaults of RELION's 3D initial model)."""

    K: int = param(1, "--K", "Number of classes")
    iter: int = param(200, "--iter", "Number of iterations (mini-batches)")
    sym: str = param("C1", "--sym", "Point-group symmetry: the run is in C1 (as RELION's); at the end the largest "
                     "class is put on the group's axes and symmetrised into initial_model.mrc")
    tau2_fudge: float = param(4.0, "--tau2_fudge", "Regularisation parameter T")
    healpix_order: int = param(1, "--healpix_order", "HEALPix order (1 = 30° coarse, 15° fine)")
    grad_ini_subset: int = param(-1, "--grad_ini_subset", "Mini-batch size at the start (-1 = 0.5 % of the "
                                 "particles, 200-5000)")
    grad_fin_subset: int = param(-1, "--grad_fin_subset", "Mini-batch size at the end (-1 = 10 % of the "
                                 "particles, 1000-50000)")
    grad_ini_resol: float = param(35.0, "--grad_ini_resol", "Resolution limit at the start (Å)")
    grad_fin_resol: float = param(15.0, "--grad_fin_resol", "Resolution limit at the end (Å)")
    grad_ini_frac: float = param(0.3, "--grad_ini_frac", "Fraction of the iterations in the initial phase")
    grad_fin_frac: float = param(0.2, "--grad_fin_frac", "Fraction of the iterations in the final phase")
    grad_stepsize: float = param(0.5, "--grad_stepsize", "Step size of the gradient updates")
    write_iter: int = param(10, "--grad_write_iter", "Write the iteration's files every this many iterations")


@dataclass(frozen=True)
class Params(em.EMParams, em.EMOptions, InitialModelOptions, em.EMInputs):
    def __post_init__(self):
        self.check(needs_ref=False, healpix_order=self.healpix_order)
        if self.continue_from is not None:  # the other options come from the optimiser STAR
            return
        symmetry_group(self.sym)
        em_classification.check_classification(self)
        if not 0 < self.grad_ini_frac < 1 or not 0 < self.grad_fin_frac < 1:
            raise InputError(f"--grad_ini_frac and --grad_fin_frac must be in (0, 1), got {self.grad_ini_frac:g}, "
                             f"{self.grad_fin_frac:g}")
        if self.grad_stepsize <= 0:
            raise InputError(f"--grad_stepsize must be > 0, got {self.grad_stepsize:g}")
        if self.grad_ini_resol <= 0 or self.grad_fin_resol <= 0:
            raise InputError(f"--grad_ini_resol and --grad_fin_resol must be > 0 Å, got {self.grad_ini_resol:g}, "
                             f"{self.grad_fin_resol:g}")
        for flag, v in (("--grad_ini_subset", self.grad_ini_subset), ("--grad_fin_subset", self.grad_fin_subset)):
            if v == 0 or v < -1:
                raise InputError(f"{flag} must be >= 1 particles (or -1: RELION's default), got {v}")
        if self.write_iter < 1:
            raise InputError(f"--grad_write_iter must be >= 1, got {self.write_iter}")


def run(p: Params) -> Iterator:
    yield from em.run(InitialModel(p))


class InitialModel(em_classification.Classification):
    name = JOB_NAME
    ndim = 3
    reads_every_image = False  # each iteration reads a random mini-batch
    owned_kinds = ()  # every rank keeps every class's VDAM moments: every rank makes every class

    def __init__(self, p: Params):
        super().__init__(p)
        self.K = self.p.K
        self.check_k()
        n = len(self.ps)
        ini, fin = default_subset_sizes(n)
        ini = self.p.grad_ini_subset if self.p.grad_ini_subset > 0 else ini
        fin = self.p.grad_fin_subset if self.p.grad_fin_subset > 0 else fin
        self.schedule = GradSchedule(self.p.iter, min(ini, n), min(max(fin, ini), n), self.p.grad_ini_resol,
                                     self.p.grad_fin_resol, self.p.grad_ini_frac, self.p.grad_fin_frac,
                                     self.p.grad_stepsize)
        self.rng = np.random.default_rng(self.p.random_seed)  # the first references only (see update_sampling)
        self.moments: list[Moments] = []
        self.reach = 0  # grid pixels from the origin within which the moments have changed (moment_reach)
        self.mask = soft_spherical_mask(self.N, self.mask_r, em.MASK_EDGE, 3)
        self.outputs: dict = {}
        self.report = ""

    def describe(self) -> str:
        s = self.schedule
        return (f"initial model from {len(self.ps)} particles, {self.K} class(es), {self.p.iter} iterations; "
                f"mini-batch {s.ini_subset} -> {s.fin_subset}, resolution {s.ini_resol:g} -> {s.fin_resol:g} Å"
                + (f"; continuing after iteration {self.state.iteration}" if self.continued else ""))

    # ---- model: one reference set shared by the two pseudo half-sets ----
    def _share(self, m: em.EMModel) -> None:
        for a in ("refs", "sigma2", "pdf_class", "pdf_dir"):
            v = getattr(m, a)
            v[1:] = [v[0]] * (len(v) - 1)

    def initial_model(self) -> em.EMModel:
        n = len(self.ps)
        refs = []
        for _k in range(self.K):
            rows = np.sort(self.rng.choice(n, size=min(n, max(200, self.schedule.ini_subset)), replace=False))
            A = random_rotations(rows.size, self.rng)
            A = euler_to_matrix(A[:, 0], A[:, 1], A[:, 2])
            v = random_angle_average(self.be.asarray(self.ps.images(rows)), self.be.asarray(A),
                                     self.ps.ctf_rows(rows), self.apix, self.p.pad, self.p.grad_ini_resol)
            refs.append(to_host(v) * self.mask)
        self.moments = []  # made at the first M-step, at the padding the memory plan chose
        s2 = self.initial_sigma2()
        m = em.EMModel([np.stack(refs)] * 2, [s2] * 2, [np.full(self.K, 1.0 / self.K)] * 2, [None] * 2,
                       np.ones(len(self.ps.scale_group_names)))
        return m

    def restore(self) -> em.EMModel:
        """The maps, spectra, distributions and moments of the iteration --continue names."""
        model = self.restore_state()[0]
        refs = np.stack(em.reference_images(model.path))
        if refs.shape[0] != self.K:
            raise InputError(f"the model STAR lists {refs.shape[0]} class maps, the run has --K {self.K}",
                             path=str(model.path))
        pdf_dir = np.stack(model.pdf_orient) if model.pdf_orient else None
        restored = [self._read_moments(model, k) for k in range(self.K)]
        self.moments = [m for m, _ in restored]
        self.reach = max(r for _, r in restored)
        return em.EMModel([refs] * 2, [model.sigma2] * 2, [model.class_distribution] * 2, [pdf_dir] * 2,
                          self.saved_scales(model))

    def _read_moments(self, model, k: int) -> tuple[Moments, int]:
        """Class k's moments from the images the model STAR lists (rlnGradMoment1: half-set 1; the half-set 2
        image is numbered K + k, as RELION's; rlnGradMoment2), and the reach they were written with."""
        cols = model.classes
        for label in ("rlnGradMoment1", "rlnGradMoment2"):
            if label not in cols.columns:
                raise InputError(f"data_model_classes has no {label} column: not the model STAR of an initial "
                                 "model iteration written by this program", path=str(model.path), column=label)
        names = [str(cols["rlnGradMoment1"].iloc[k]), None, str(cols["rlnGradMoment2"].iloc[k])]
        names[1] = names[0].replace(f"1moment{k + 1:03d}", f"1moment{k + 1 + self.K:03d}")
        blocks = []
        for name in names:
            found, tried = project_path(name, model.path)
            if found is None:
                raise InputError(f"moment image {name!r} not found (looked in {', '.join(map(str, tried))})",
                                 path=str(model.path), column="rlnGradMoment1")
            blocks.append(np.asarray(read_mrc(found).data, np.float32))
        try:
            m = moments_from_blocks(blocks, self.N, self.p.pad, self.be.xp)
        except ValueError as exc:
            raise InputError(f"the moment images of class {k + 1} do not fit box {self.N} at --pad {self.p.pad}: "
                             f"{exc}", path=str(model.path), column="rlnGradMoment1") from exc
        return m, (blocks[2].shape[0] - 1) // 2

    def update_sampling(self) -> Iterator:
        st, N, p, s = self.state, self.N, self.p, self.schedule
        i = st.iteration
        res = s.resolution_A(i)
        st.res_shell = int(min(N // 2, round(N * self.apix / res)))
        size = int(min(N, 2 * (st.res_shell + 2)))
        everyone = i == p.iter and self.K > 1
        n = len(self.ps)
        # one generator per iteration (RELION reseeds with random_seed + iter): a --continue draws the same batches
        rng = np.random.default_rng([p.random_seed, i])
        batch = np.arange(n) if everyone or s.subset(i) >= n else np.sort(rng.choice(n, s.subset(i), False))
        order = rng.permutation(batch.size)
        self.halves = [np.sort(batch[order[0::2]]), np.sort(batch[order[1::2]])]
        st.perturb_sampling(p.random_seed)
        self.reach = max(self.reach, moment_reach(p.pad, st.res_shell))
        smp = Sampling(p.healpix_order, "C1", None, p.offset_range, p.offset_step, perturb=st.perturb)
        if self.model.pdf_dir[0] is None:
            self.model.pdf_dir[0] = np.full((self.K, smp.n_dirs), 1.0 / smp.n_dirs)
            self._share(self.model)
        self.step = s.step(i)
        if i == 1 or i % 10 == 0 or i == p.iter:
            yield Message(f"iteration {i}: mini-batch {batch.size}, image size {size}, {res:.1f} Å, step size "
                          f"{self.step:.2f}, {self.K} class(es) x {smp.n_orient} orientations, "
                          f"{smp.translations.shape[0]} translations")
        # the mini-batch grows over the run: the iterations done say little about the time left
        yield IterationStarted(i, p.iter, i == p.iter, image_size=size, full_size=N,
                               angular_step=float(smp.angular_step), even_cost=False)
        return em.Iteration(i == p.iter, False, size, smp, size, None)

    def expectation_options(self, it: em.Iteration, h: int) -> dict:
        m = self.model
        with np.errstate(divide="ignore"):
            lp = self.be.asarray(np.log(m.pdf_class[0])[:, None] + np.log(m.pdf_dir[0]))
        # RELION's cap on the significant coarse samples of a gradient iteration: 100 per class (3D)
        return {"log_pdf_direction": lp, "max_significants": MAX_SIGNIFICANTS_PER_CLASS * self.K}

    def maximization(self, it: em.Iteration) -> None:
        m, p, N, xp = self.model, self.p, self.N, self.be.xp
        s1, s2 = it.sums
        for acc in it.accumulators:
            acc.enforce_hermitian()
        # the scalars and spectra: RELION's running averages with momentum mu over the mini-batches
        wsum_s2 = s1.sigma2 + s2.sigma2
        sumw = s1.sumw_group + s2.sumw_group
        new_s2 = update_sigma2(wsum_s2, sumw, N)
        got = sumw > 0
        m.sigma2[0] = np.where(got[:, None], MU * m.sigma2[0] + (1 - MU) * new_s2, m.sigma2[0])
        pdf = s1.pdf_class + s2.pdf_class
        m.pdf_class[0] = MU * m.pdf_class[0] + (1 - MU) * pdf / max(pdf.sum(), 1e-300)
        sw = s1.sum_weight + s2.sum_weight
        self.state.sigma_offset_A = (MU * self.state.sigma_offset_A
                                     + (1 - MU) * update_sigma_offset(s1.sigma_offset + s2.sigma_offset, sw))
        # the references: one VDAM step per class
        r_max = self.state.res_shell
        new_refs = []
        self.fsc_est = []
        if not self.moments or self.moments[0].mom2.shape != grid_shape(N, p.pad, 3):
            if self.moments and self.moments[0].started:  # restored at another padding
                raise InputError(f"the saved moments are for another padding than --pad {p.pad}: continue with "
                                 "the padding of the run")
            self.moments = [Moments.zeros(N, p.pad, xp) for _ in range(self.K)]  # after the memory plan's pad
        for k in range(self.K):
            ref_g = reference_to_grid(xp.asarray(m.refs[0][k]), p.pad)
            halves = [(acc.members[k].data, acc.members[k].weight) for acc in it.accumulators]
            step = class_stepsize(self.step, float(m.pdf_class[0][k]), self.K)
            g, fsc = vdam_update(ref_g, halves, self.moments[k], step, p.tau2_fudge, r_max, p.pad)
            v = to_host(grid_to_reference(g, N, p.pad)) * self.mask  # solvent flattening, as RELION's job
            new_refs.append(v.astype(np.float32).astype(np.float64))  # what the map files hold (--continue)
            self.fsc_est.append(to_host(fsc))
        m.refs[0] = np.stack(new_refs)
        self._share(m)
        it.ssnr = [f / np.maximum(1 - f, 1e-6) for f in self.fsc_est]

    def update_resolution(self, it: em.Iteration) -> None:
        res = self.schedule.resolution_A(self.state.iteration)
        self.res_shells = [self.state.res_shell] * self.K
        self.res_A = [res] * self.K
        rows = np.concatenate(self.halves)
        self.changed = float((self.ps.classes[rows] != it.old_classes[rows]).mean()) if self.K > 1 else 0.0

    def write(self, it: em.Iteration) -> Iterator:
        f, i, K, apix = self.files, self.state.iteration, self.K, self.apix
        refs = self.model.refs[0]
        maps = {f"class{k + 1:03d}": refs[k].astype(np.float32) for k in range(K)}
        if i % self.p.write_iter == 0 or it.final or i == 1:
            paths = [f.class_map(k + 1, i) for k in range(K)]
            for k in range(K):
                self.save(write_mrc, paths[k], maps[f"class{k + 1:03d}"], apix)
            moments = self.write_moments(i)
            model = self.write_model(it, [q.name for q in paths], list(self.model.pdf_dir[0]), moments)
            data = self.write_data()
            self.write_optimiser(it, data, [model])
            self.outputs = {f"class{k + 1:03d}": paths[k] for k in range(K)} | {"model": model, "data": data}
        else:
            paths = [None] * K
        for k in range(K):
            yield MapUpdated(f"class{k + 1:03d}", maps[f"class{k + 1:03d}"], apix, paths[k])
        dist = ", ".join(f"{100 * d:.1f}%" for d in self.model.pdf_class[0])
        summary = (f"mini-batch {sum(h.size for h in self.halves)}, {self.res_A[0]:.1f} Å, step {self.step:.2f}; "
                   f"class distribution {dist}; E-step {it.seconds_estep:.1f} s")
        yield IterationFinished(i, maps, self.model.pdf_class[0].copy(), float(self.res_A[0]), None, summary)
        if it.final:
            self.write_final()
            if symmetry_group(self.p.sym).order > 1:
                yield from self.write_symmetrised(refs)
            self.report = class_report(list(refs), self.model.pdf_class[0], self.mask) if K > 1 else ""
            if self.report:
                yield Message(self.report)
            yield Message("The initial model's hand is arbitrary: check it (e.g. the twist of helices) and flip the "
                          "map if needed before building a model into the refined map.")

    def write_moments(self, i: int) -> dict:
        """The moments of every class as images (RELION's names); the model STAR's columns that list them."""
        f, K = self.files, self.K
        first, second = [], []
        for k, mom in enumerate(self.moments):
            b1, b2, b3 = moment_blocks(mom, self.reach)
            for path, block in ((f.grad_moment(1, k + 1, i), b1), (f.grad_moment(1, k + 1 + K, i), b2),
                                (f.grad_moment(2, k + 1, i), b3)):
                self.save(write_mrc, path, np.array(block, copy=True), None)
            first.append(f.grad_moment(1, k + 1, i).name)
            second.append(f.grad_moment(2, k + 1, i).name)
        return {"rlnGradMoment1": first, "rlnGradMoment2": second}

    def write_final(self) -> None:
        """The final files without iteration number: run_class001.mrc, ..., run_model.star, run_data.star (copies
        of the last iteration's, written atomically)."""
        f, i = self.files, self.state.iteration
        final = {}
        for k in range(self.K):
            final[f"class{k + 1:03d}"] = (f.class_map(k + 1, i), f.class_map(k + 1, None))
        final["model"] = (f.model(i), f.model(None))
        final["data"] = (f.data(i), f.data(None))
        for key, (src, dst) in final.items():
            # after every write handed over before it: src may be written in the other lane (a STAR file)
            self.writer.put_after_all(copy_atomically, src, dst)
            self.outputs[key] = dst

    def write_symmetrised(self, refs) -> Iterator:
        """The largest class centred, put on the symmetry axes and averaged over the group: initial_model.mrc."""
        k = int(np.argmax(self.model.pdf_class[0]))
        vol, al = align_and_symmetrize(to_host(refs[k]), self.p.sym, self.apix,
                                       resolution_A=max(4.0 * self.apix, float(self.res_A[0])))
        path = write_mrc(self.files.root.parent / "initial_model.mrc", vol, self.apix)
        self.outputs["initial_model"] = path
        yield MapUpdated("initial_model", vol, self.apix, path)
        yield Message(f"class {k + 1} put on the {self.p.sym} axes (symmetry score {al['score_unaligned']:.2f} as "
                      f"made, {al['score']:.2f} after the turn; 1 = symmetric) and symmetrised: {path}")

    def finished(self) -> Finished:
        dist = ", ".join(f"class {k + 1}: {100 * d:.1f}%" for k, d in enumerate(self.model.pdf_class[0]))
        return Finished(self.outputs, f"{self.p.iter} iterations in {time.time() - self.t_start:.0f} s; {dist}. "
                                      f"{self.report}")
