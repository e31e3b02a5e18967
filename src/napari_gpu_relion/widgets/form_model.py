"""How a job's options are laid out in its dock widget (no Qt, no napari): RELION-like tabs, words for labels.

RELION's GUI groups a job's options in tabs (I/O, Reference, CTF, Optimisation, Sampling, Compute, ...) and
cryoSPARC shows the basic options with the advanced ones folded. Each Params field of a job is given here a
label in words with its unit, a tab, and whether it is basic (always shown) or advanced (folded); the RELION
flag goes into the tooltip (widgets/job_widget.py). Flags mean the same in every job unless a job overrides
them (``_JOB_FORMS``). A field this table does not know gets its flag as label in an "Other" tab, folded, so a
new Params field is never lost; tests/test_widget_models.py checks that every field of every job is known.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["FieldForm", "TabLayout", "TAB_ORDER", "form_of", "form_layout"]

#: Tabs in the order they appear (RELION's order where RELION has the tab).
TAB_ORDER = ("I/O", "Reference", "LoG", "Templates", "Extraction", "Selection", "Mask", "CTF", "Aberrations",
             "Optimisation", "Sampling", "Reconstruction", "Sharpening", "Filtering", "LocalRes", "Compute",
             "Other")


@dataclass(frozen=True)
class FieldForm:
    """Label (words and unit), tab and basic/advanced of one option."""

    label: str
    tab: str
    basic: bool = True


def _b(label: str, tab: str) -> FieldForm:
    return FieldForm(label, tab, True)


def _a(label: str, tab: str) -> FieldForm:
    return FieldForm(label, tab, False)


#: By RELION flag, for every job that has it.
_FORMS: dict[str, FieldForm] = {
    # I/O
    "--continue": _a("Continue from (optimiser STAR)", "I/O"),
    "--angpix": _a("Pixel size (Å; -1 = from the file)", "I/O"),
    "--coord_list": _b("Coordinates (autopick.star)", "I/O"),
    "--reextract_data_star": _a("Re-extract particles of (STAR)", "I/O"),
    "--recenter": _a("Re-centre on refined offsets", "I/O"),
    "--recenter_x": _a("Re-centre X (px)", "I/O"),
    "--recenter_y": _a("Re-centre Y (px)", "I/O"),
    "--recenter_z": _a("Re-centre Z (px)", "I/O"),
    "--minimum_pick_fom": _a("Minimum pick FOM", "I/O"),
    "--skip_side": _a("Edge margin without picks (px)", "I/O"),
    "--skip_bad_micrographs": _a("Skip unreadable micrographs", "I/O"),
    "--outlier_removal_zscore": _a("Outlier pixels beyond (σ)", "I/O"),
    "--i2": _a("Half map 2 (default: by name)", "I/O"),
    "--model": _a("Model STAR (default: by name)", "I/O"),
    # Reference
    "--ref": _b("Reference map (MRC)", "Reference"),
    "--ini_high": _b("Initial low-pass filter (Å)", "Reference"),
    "--sym": _b("Symmetry", "Reference"),
    "--trust_ref_size": _a("Rescale a reference of another size", "Reference"),
    "--firstiter_cc": _a("Cross-correlation in iteration 1", "Reference"),
    # LoG picking
    "--LoG": _b("Laplacian-of-Gaussian picking", "LoG"),
    "--LoG_diam_min": _b("Smallest particle diameter (Å)", "LoG"),
    "--LoG_diam_max": _b("Largest particle diameter (Å)", "LoG"),
    "--LoG_adjust_threshold": _b("Threshold adjustment (σ)", "LoG"),
    "--LoG_robust_stats": _b("Robust threshold (median, MAD)", "LoG"),
    "--LoG_neighbour": _a("Exclusion radius (% of diameter)", "LoG"),
    "--Log_invert": _a("Bright particles", "LoG"),
    "--LoG_upper_threshold": _a("Upper threshold (σ)", "LoG"),
    "--Log_max_search": _a("Largest search size (× diameter)", "LoG"),
    # template picking
    "--angpix_ref": _a("Reference pixel size (Å; -1 = header)", "Templates"),
    "--ang": _a("In-plane angular step (°)", "Templates"),
    "--invert": _a("Invert the templates", "Templates"),
    "--lowpass": _b("Low-pass the templates (Å)", "Templates"),
    "--shrink": _a("Working size (0 = from low-pass)", "Templates"),
    "--shrink_particle_mask": _a("Shrink the particle mask (px)", "Templates"),
    "--threshold": _b("FOM threshold (z: noise σ)", "Templates"),
    "--fom": _a("Figure of merit (zscore or relion)", "Templates"),
    "--no_local_sigma": _a("No local noise normalisation", "Templates"),
    "--min_distance": _b("Minimum distance between picks (Å)", "Templates"),
    "--max_stddev_noise": _a("Maximum local std (σ; -1 = off)", "Templates"),
    "--min_avg_noise": _a("Minimum local mean", "Templates"),
    # extraction
    "--extract_size": _b("Box size (px)", "Extraction"),
    "--scale": _b("Rescaled box size (px; -1 = none)", "Extraction"),
    "--norm": _b("Normalise the background", "Extraction"),
    "--invert_contrast": _b("Invert contrast", "Extraction"),
    "--bg_radius": _a("Background radius (px; -1 = 75 %)", "Extraction"),
    "--no_ramp": _a("Keep the background plane", "Extraction"),
    "--white_dust": _a("Remove white dust beyond (σ; -1 = off)", "Extraction"),
    "--black_dust": _a("Remove black dust beyond (σ; -1 = off)", "Extraction"),
    "--skip_edge": _a("Skip boxes that leave the micrograph", "Extraction"),
    "--float16": _a("Write float16 stacks", "Extraction"),
    # selection
    "--classes": _b("Classes to keep (e.g. 1,3,4)", "Selection"),
    "--min_class_distribution": _b("Minimum class fraction (0-1)", "Selection"),
    "--max_class_resolution": _b("Maximum class resolution (Å)", "Selection"),
    # mask creation
    "--ini_threshold": _b("Initial threshold (map units)", "Mask"),
    "--extend_inimask": _b("Extend the binary mask (px)", "Mask"),
    "--width_soft_edge": _b("Soft edge width (px)", "Mask"),
    # CTF
    "--ctf": _b("Do CTF correction", "CTF"),
    # optimisation
    "--K": _b("Number of classes", "Optimisation"),
    "--iter": _b("Number of iterations", "Optimisation"),
    "--tau2_fudge": _b("Regularisation parameter T", "Optimisation"),
    "--particle_diameter": _b("Mask diameter (Å)", "Optimisation"),
    "--flatten_solvent": _b("Mask the references", "Optimisation"),
    "--zero_mask": _b("Mask particles with zeros", "Optimisation"),
    "--center_classes": _b("Centre class averages", "Optimisation"),
    "--sort_classes": _a("Sort classes by size", "Optimisation"),
    "--norm_correction": _a("Norm correction", "Optimisation"),
    "--low_resol_join_halves": _a("Join the halves below (Å)", "Optimisation"),
    "--auto_iter_max": _a("Maximum iterations", "Optimisation"),
    # sampling
    "--healpix_order": _b("Angular sampling (HEALPix order)", "Sampling"),
    "--auto_local_healpix_order": _b("Local searches from HEALPix order", "Sampling"),
    "--sigma_ang": _a("Local angular search σ (°; -1 = global)", "Sampling"),
    "--skip_align": _b("Skip alignment (classify only)", "Sampling"),
    "--psi_step": _b("In-plane angular step (°)", "Sampling"),
    "--offset_range": _b("Offset search range (px)", "Sampling"),
    "--offset_step": _b("Offset search step (px)", "Sampling"),
    "--offset": _a("Initial offset prior σ (Å)", "Sampling"),
    "--angstrom_offset_prior": _a("Offset prior in Å (not RELION's)", "Sampling"),
    "--subpixel_offsets": _a("Search around exact offsets (not RELION's)", "Sampling"),
    # reconstruction
    "--subset": _b("Random subset (1, 2; 0 = all)", "Reconstruction"),
    "--maxres": _a("Maximum resolution (Å; -1 = Nyquist)", "Reconstruction"),
    # post-processing
    "--auto_bfac": _b("Fit the B-factor (Guinier)", "Sharpening"),
    "--adhoc_bfac": _b("Ad-hoc B-factor (Å²)", "Sharpening"),
    "--autob_lowres": _a("Guinier fit from (Å)", "Sharpening"),
    "--autob_highres": _a("Guinier fit to (Å; 0 = Nyquist)", "Sharpening"),
    "--low_pass": _b("Low-pass (Å; 0 = off, <0 = at FSC 0.143)", "Filtering"),
    "--skip_fsc_weighting": _a("Skip FSC weighting", "Filtering"),
    "--randomize_at_fsc": _a("Randomise phases below FSC", "Filtering"),
    "--force_mask": _a("Always use the masked FSC", "Filtering"),
    # compute
    "--cpu": _b("Run on the CPU", "Compute"),
    "--gpu": _b("GPU index (empty = first)", "Compute"),
    "--batch": _a("Batch size (0 = from free memory)", "Compute"),
    "--memory_limit": _a("Memory limit (GiB; 0 = all free memory)", "Compute"),
    "--tf32": _a("TF32 tensor cores for the GEMMs (GPU)", "Compute"),
    "--coarse_float32": _a("Coarse pass in float32 (GPU; default TF32)", "Compute"),
    "--preread_images": _a("Keep all particle images in memory", "Compute"),
    "--dont_check_norm": _a("Run with unnormalised particles (warn only)", "Compute"),
    "--j": _a("CPU threads (0 = this rank's share of the cores)", "Compute"),
    "--pad": _a("Padding factor", "Compute"),
    "--random_seed": _a("Random seed", "Compute"),
}

#: Flags that mean something else in one job: (job name, flag).
_JOB_FORMS: dict[tuple[str, str], FieldForm] = {
    ("autopick", "--i"): _b("Micrographs (STAR, or MRC glob)", "I/O"),
    ("autopick", "--odir"): _b("Output folder", "I/O"),
    ("autopick", "--ref"): _b("Templates (2D stack or 3D map)", "Templates"),
    ("autopick", "--healpix_order"): _a("Projection directions (HEALPix order)", "Templates"),
    ("autopick", "--sym"): _a("Symmetry of a 3D reference", "Templates"),
    ("autopick", "--ctf"): _a("CTF-weighted templates", "Templates"),
    ("autopick", "--particle_diameter"): _a("Mask diameter (Å; -1 = from references)", "Templates"),
    ("autopick", "--pad"): _a("Padding factor", "Templates"),
    ("autopick", "--angpix"): _a("Micrograph pixel size (Å; for MRC globs)", "I/O"),
    ("autopick", "--batch"): _a("Batch size (0 = automatic)", "Compute"),
    ("extract", "--i"): _b("Micrographs (STAR, or MRC glob)", "I/O"),
    ("extract", "--o"): _b("Output folder", "I/O"),
    ("extract", "--angpix"): _a("Micrograph pixel size (Å; for MRC globs)", "I/O"),
    ("class2d", "--i"): _b("Particles (STAR)", "I/O"),
    ("class2d", "--o"): _b("Job folder", "I/O"),
    ("class2d", "--ini_high"): _a("Initial low-pass filter (Å; -1 = auto)", "Optimisation"),
    ("initial_model", "--i"): _b("Particles (STAR)", "I/O"),
    ("initial_model", "--o"): _b("Job folder", "I/O"),
    ("initial_model", "--sym"): _a("Symmetry (run in C1, applied at the end)", "Optimisation"),
    ("initial_model", "--grad_ini_subset"): _a("Mini-batch at the start (-1 = auto)", "Optimisation"),
    ("initial_model", "--grad_fin_subset"): _a("Mini-batch at the end (-1 = auto)", "Optimisation"),
    ("initial_model", "--grad_ini_resol"): _a("Resolution at the start (Å)", "Optimisation"),
    ("initial_model", "--grad_fin_resol"): _a("Resolution at the end (Å)", "Optimisation"),
    ("initial_model", "--grad_ini_frac"): _a("Fraction of iterations at the start", "Optimisation"),
    ("initial_model", "--grad_fin_frac"): _a("Fraction of iterations at the end", "Optimisation"),
    ("initial_model", "--grad_stepsize"): _a("Gradient step size", "Optimisation"),
    ("initial_model", "--grad_write_iter"): _a("Write files every (iterations)", "Optimisation"),
    ("class3d", "--i"): _b("Particles (STAR)", "I/O"),
    ("class3d", "--o"): _b("Job folder", "I/O"),
    ("class3d", "--ref"): _b("Reference map (MRC or model STAR)", "Reference"),
    ("refine3d", "--i"): _b("Particles (STAR)", "I/O"),
    ("refine3d", "--o"): _b("Job folder", "I/O"),
    ("refine3d", "--tau2_fudge"): _a("Regularisation parameter T", "Optimisation"),
    ("select", "--i"): _b("Particles of a classification (STAR)", "I/O"),
    ("select", "--o"): _b("Output particles (STAR)", "I/O"),
    ("reconstruct", "--i"): _b("Particles with angles (STAR)", "I/O"),
    ("reconstruct", "--o"): _b("Output map (MRC)", "I/O"),
    ("reconstruct", "--sym"): _b("Symmetry", "Reconstruction"),
    ("reconstruct", "--pad"): _a("Padding factor", "Reconstruction"),
    ("reconstruct", "--angpix"): _a("Pixel size (Å; -1 = from the STAR)", "I/O"),
    ("postprocess", "--i"): _b("Half map 1 (unfiltered MRC)", "I/O"),
    ("postprocess", "--o"): _b("Output folder", "I/O"),
    ("postprocess", "--mask"): _b("Solvent mask (MRC)", "I/O"),
    ("postprocess", "--random_seed"): _a("Random seed", "Filtering"),
    ("mask_create", "--i"): _b("Map (MRC)", "I/O"),
    ("mask_create", "--o"): _b("Output mask (MRC)", "I/O"),
    ("mask_create", "--lowpass"): _b("Low-pass before thresholding (Å; 0 = off)", "Mask"),
    # CTF refinement (relion_ctf_refine; RELION's CtfRefine job)
    ("ctf_refine", "--i"): _b("Refined particles (STAR)", "I/O"),
    ("ctf_refine", "--o"): _b("Job folder", "I/O"),
    ("ctf_refine", "--f"): _b("Post-process STAR (maps, mask, FSC)", "I/O"),
    ("ctf_refine", "--m1"): _a("Half map 1 (instead of the STAR's)", "I/O"),
    ("ctf_refine", "--m2"): _a("Half map 2 (instead of the STAR's)", "I/O"),
    ("ctf_refine", "--mask"): _a("Mask (default: the STAR's)", "I/O"),
    ("ctf_refine", "--angpix_ref"): _a("Half maps' pixel size (Å; -1 = header)", "I/O"),
    ("ctf_refine", "--fit_defocus"): _b("Perform CTF parameter fitting", "CTF"),
    ("ctf_refine", "--fit_mode"): _a("Fit mode (p, m or f each)", "CTF"),  # the dock asks RELION's questions
    ("ctf_refine", "--kmin_defocus"): _a("Defocus fit from (Å)", "CTF"),
    ("ctf_refine", "--bf_range"): _a("Defocus search range (Å; 0 = none)", "CTF"),
    ("ctf_refine", "--max_defocus_iters"): _a("Most fit iterations", "CTF"),
    ("ctf_refine", "--fit_beamtilt"): _b("Estimate beam tilt", "Aberrations"),
    ("ctf_refine", "--odd_aberr_max_n"): _b("Odd aberrations to order (3 = trefoil; 0 = tilt only)", "Aberrations"),
    ("ctf_refine", "--kmin_tilt"): _a("Beam-tilt fit from (Å)", "Aberrations"),
    ("ctf_refine", "--fit_aberr"): _b("Estimate 4th-order aberrations", "Aberrations"),
    ("ctf_refine", "--even_aberr_max_n"): _a("Even aberrations to order", "Aberrations"),
    ("ctf_refine", "--kmin_aberr"): _a("Symmetric fit from (Å)", "Aberrations"),
    ("ctf_refine", "--fit_aniso"): _b("Estimate anisotropic magnification", "Aberrations"),
    ("ctf_refine", "--kmin_mag"): _a("Magnification fit from (Å)", "Aberrations"),
    ("ctf_refine", "--keep_astig"): _a("Keep astigmatism as it is (with the magnification)", "Aberrations"),
    ("ctf_refine", "--j"): _a("Threads (RELION's; not used)", "Compute"),
    # local resolution (relion_postprocess --locres; RELION's LocalRes job)
    ("local_resolution", "--i"): _b("Half map 1 (unfiltered MRC)", "I/O"),
    ("local_resolution", "--o"): _b("Job folder", "I/O"),
    ("local_resolution", "--mask"): _b("Solvent mask (MRC; for the statistics)", "I/O"),
    ("local_resolution", "--adhoc_bfac"): _b("B-factor of the filtered map (Å²)", "LocalRes"),
    ("local_resolution", "--locres_sampling"): _b("Window spacing (Å)", "LocalRes"),
    ("local_resolution", "--locres_maskrad"): _a("Window radius (Å; <0 = half the spacing)", "LocalRes"),
    ("local_resolution", "--locres_edgwidth"): _a("Window soft edge (Å; <0 = the spacing)", "LocalRes"),
    ("local_resolution", "--locres_randomize_at"): _a("Randomise phases from (Å)", "LocalRes"),
    ("local_resolution", "--locres_minres"): _a("Lowest resolution reported (Å)", "LocalRes"),
    ("local_resolution", "--filter_edge_width"): _a("Low-pass edge width (shells)", "LocalRes"),
    ("local_resolution", "--locres"): _a("Accept --locres (always on)", "LocalRes"),
}
# relion_refine's image corrections (jobs/em.EMCorrections), not extraction's --norm and --scale
for _job in ("refine3d", "class3d", "class2d"):
    _JOB_FORMS[(_job, "--norm")] = _a("Norm correction", "Optimisation")
    _JOB_FORMS[(_job, "--scale")] = _a("Intensity-scale correction", "Optimisation")


def known(job: str, flag: str) -> bool:
    """True if the table has a form for ``flag`` of ``job``."""
    return (job, flag) in _JOB_FORMS or flag in _FORMS


def form_of(job: str, flag: str) -> FieldForm:
    """The form of option ``flag`` of job ``job``: the job's own, else the shared one, else the flag itself in
    the folded "Other" tab."""
    form = _JOB_FORMS.get((job, flag)) or _FORMS.get(flag)
    return form if form is not None else FieldForm(flag, "Other", False)


@dataclass(frozen=True)
class TabLayout:
    """One tab: its name, the basic options (shown) and the advanced ones (folded), as field names in the
    order of the job's Params."""

    name: str
    basic: tuple[str, ...]
    advanced: tuple[str, ...]


def form_layout(job: str, fields: Iterable[tuple[str, str]]) -> list[TabLayout]:
    """The tabs of job ``job`` whose Params has ``fields`` ((name, flag) pairs, in Params order): tabs in
    TAB_ORDER, empty tabs left out."""
    basic: dict[str, list[str]] = {}
    advanced: dict[str, list[str]] = {}
    for name, flag in fields:
        form = form_of(job, flag)
        (basic if form.basic else advanced).setdefault(form.tab, []).append(name)
    tabs = [t for t in TAB_ORDER if t in basic or t in advanced]
    return [TabLayout(t, tuple(basic.get(t, ())), tuple(advanced.get(t, ()))) for t in tabs]
