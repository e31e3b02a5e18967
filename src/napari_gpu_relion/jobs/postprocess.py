"""Post-processing of two half maps (relion_postprocess; relion_pick_extract_post.md 3.2).

Masked and unmasked FSC, phase-randomisation correction of the masked FSC, resolution at 0.143, FSC
weighting, automatic (Guinier fit) or given B-factor sharpening, optional low-pass; writes postprocess.mrc
(unmasked), postprocess_masked.mrc and postprocess.star in RELION's layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..compute import fsc as F
from ..compute import postprocessing as PP
from ..compute.backend import to_host
from ..compute.fourier import uncached_fft_plans
from ..errors import InputError
from ..events import Finished, FscUpdated, MapUpdated, Message, Progress, Started
from ..io.atomic import ensure_not_input
from ..io.mrc import read_mrc, require_usable_map, write_mrc
from ..io.star import write_star_blocks
from ..marks import memory_mark
from ..runtime.device import backend_for
from ..runtime.memory import free_cached_memory
from .common import check_output_folder, check_pixel_size, mrc_bytes, param, prepare_output, require_file, write_note

JOB_NAME = "postprocess"


@dataclass(frozen=True)
class Params:
    i: Path = param(flag="--i", help="First unfiltered half map (e.g. run_half1_class001_unfil.mrc)")
    o: Path = param(flag="--o", help="Output folder (postprocess.mrc, postprocess_masked.mrc, postprocess.star)")
    i2: Path | None = param(None, "--i2", "Second half map (default: --i with 'half1' replaced by 'half2')")
    mask: Path | None = param(None, "--mask", "Solvent mask (values in [0, 1])")
    angpix: float = param(-1.0, "--angpix", "Pixel size (Å); -1 = from the map header")
    auto_bfac: bool = param(False, "--auto_bfac", "Estimate the B-factor from a Guinier fit")
    autob_lowres: float = param(10.0, "--autob_lowres", "Lowest resolution in the Guinier fit (Å)")
    autob_highres: float = param(0.0, "--autob_highres", "Highest resolution in the Guinier fit (Å); 0 = all")
    adhoc_bfac: float = param(0.0, "--adhoc_bfac", "B-factor to apply when not fitting (Å², negative sharpens)")
    low_pass: float = param(0.0, "--low_pass", "Low-pass (Å); 0 = off; negative = the FSC 0.143 resolution")
    skip_fsc_weighting: bool = param(False, "--skip_fsc_weighting", "Do not weight by sqrt(2FSC/(1+FSC))")
    randomize_at_fsc: float = param(0.8, "--randomize_at_fsc", "Randomise phases beyond where FSC drops below")
    force_mask: bool = param(False, "--force_mask", "Use the masked FSC even if the unmasked one is better")
    random_seed: int = param(0, "--random_seed", "Seed of the phase randomisation")
    cpu: bool = param(False, "--cpu", "Run on the CPU (NumPy) even if a GPU is present")
    gpu: str | None = param(None, "--gpu", "GPU index (default: the first GPU, if any)")

    def half2(self) -> Path:
        return second_half(self.i, self.i2)

    def __post_init__(self):
        require_file(self.i, "--i half map", (".mrc", ".map"))
        require_file(self.half2(), "--i2 half map", (".mrc", ".map"))
        if self.mask is not None:
            require_file(self.mask, "--mask", (".mrc", ".map"))
        if self.o is None:
            raise InputError("--o output folder is required")
        check_output_folder(self.o, "--o")
        check_pixel_size(self.angpix, "--angpix", "the map header")
        for name in ("postprocess.mrc", "postprocess_masked.mrc"):
            ensure_not_input(Path(self.o) / name, self.i, self.half2(), self.mask)


def second_half(i: Path, i2: Path | None) -> Path:
    """The second half map: --i2, else --i's name with 'half1' replaced by 'half2' (RELION's rule)."""
    if i2 is not None:
        return Path(i2)
    name = Path(i).name
    if "half1" not in name:
        raise InputError("--i2 not given and the name of --i has no 'half1' to replace", path=str(i))
    return Path(i).with_name(name.replace("half1", "half2"))


def load_half_maps(p: Params):
    h1 = read_mrc(p.i)
    h2 = read_mrc(p.half2())
    v1, v2 = np.asarray(h1.data, np.float32), np.asarray(h2.data, np.float32)  # float64 only on the device
    if v1.shape != v2.shape or v1.ndim != 3:
        raise InputError(f"half maps differ in size or are not 3D: {v1.shape} ({p.i}) vs {v2.shape} ({p.half2()})")
    if v1.shape[0] % 2 or len(set(v1.shape)) != 1:
        raise InputError(f"half maps must be cubic with an even box, got {v1.shape}", path=str(p.i))
    require_usable_map(v1, p.i, "half map")
    require_usable_map(v2, p.half2(), "half map")
    if p.angpix > 0:
        apix = p.angpix
    else:
        a1, a2 = h1.pixel_size, h2.pixel_size
        if not a1:
            raise InputError("the map header has no pixel size: give --angpix", path=str(p.i))
        if a2 and abs(a1 - a2) > 1e-3:
            raise InputError(f"half maps have different pixel sizes: {a1} Å ({p.i}) vs {a2} Å ({p.half2()})")
        apix = a1
    mask = None
    if p.mask is not None:
        m = np.asarray(read_mrc(p.mask).data, np.float32)
        if m.shape != v1.shape:
            raise InputError(f"mask shape {m.shape} differs from the half maps {v1.shape}", path=str(p.mask))
        if not np.isfinite(m).all():
            raise InputError(f"the mask cannot be used: {int((~np.isfinite(m)).sum())} values are NaN or infinite",
                             path=str(p.mask))
        lo, hi = float(m.min()), float(m.max())
        if hi <= 0:
            raise InputError(f"the mask is empty (no value above 0; maximum {hi:g})", path=str(p.mask))
        if lo < -1e-6 or hi > 1 + 1e-6:
            raise InputError(f"mask values must lie in [0, 1]; found min {lo:g}, max {hi:g}", path=str(p.mask))
        mask = np.clip(m, 0, 1)
    return v1, v2, apix, mask


def run(p: Params) -> Iterator:
    v1, v2, apix, mask = load_half_maps(p)
    N = v1.shape[0]
    out = Path(p.o)
    be = backend_for(p)
    notes = prepare_output(out, 2 * mrc_bytes(N, N, N) + 64 * 1024, "the post-processed maps")
    yield Started(JOB_NAME, out, be.name, f"post-processing {N}³ half maps at {apix:.3f} Å/px")
    yield from notes
    out.mkdir(parents=True, exist_ok=True)
    write_note(out, JOB_NAME, p)
    shells = np.arange(N // 2 + 1)
    inv = np.where(shells > 0, shells / (N * apix), 1 / 999.0)
    with uncached_fft_plans(be.xp):
        curves, res, B, final, general, (gx, gy_orig, gy_w, gy_s) = yield from _compute(p, v1, v2, mask, apix, be)
    free_cached_memory(be)
    fsc_unmasked = curves["unmasked"]
    yield Progress(2, 3, "sharpening")

    paths = {"postprocess": write_mrc(out / "postprocess.mrc", final, apix)}
    if mask is not None:
        paths["postprocess_masked"] = write_mrc(out / "postprocess_masked.mrc", final * mask, apix)
    general = {"rlnFinalResolution": res, "rlnBfactorUsedForSharpening": B,
               "rlnUnfilteredMapHalf1": str(p.i), "rlnUnfilteredMapHalf2": str(p.half2()),
               "rlnPostprocessedMap": str(paths["postprocess"]), **general}
    if mask is not None:
        general["rlnPostprocessedMapMasked"] = str(paths["postprocess_masked"])
    fsc_df = pd.DataFrame({"rlnSpectralIndex": shells, "rlnResolution": inv,
                           "rlnAngstromResolution": np.where(shells > 0, N * apix / np.maximum(shells, 1), 999.0)})
    if mask is not None:
        fsc_df["rlnFourierShellCorrelationCorrected"] = curves["corrected"]
        fsc_df["rlnFourierShellCorrelationUnmaskedMaps"] = fsc_unmasked
        fsc_df["rlnFourierShellCorrelationMaskedMaps"] = curves["masked"]
        fsc_df["rlnCorrectedFourierShellCorrelationPhaseRandomizedMaskedMaps"] = curves["phase_randomised"]
    else:
        fsc_df["rlnFourierShellCorrelationUnmaskedMaps"] = fsc_unmasked
    g = shells > 0
    guin = pd.DataFrame({"rlnResolutionSquared": gx[g], "rlnLogAmplitudesOriginal": gy_orig[g],
                         "rlnLogAmplitudesWeighted": gy_w[g], "rlnLogAmplitudesSharpened": gy_s[g]})
    paths["star"] = write_star_blocks(out / "postprocess.star", {"general": general, "fsc": fsc_df,
                                                                 "guinier": guin})
    yield MapUpdated("postprocess", final, apix, paths["postprocess"])
    yield Progress(3, 3, "written")
    yield Finished(paths, f"resolution {res:.2f} Å (FSC 0.143), B-factor {B:.1f} Å²")


def _compute(p: Params, v1, v2, mask, apix: float, be) -> Iterator:
    """The FSC curves, the resolution, the B-factor, the sharpened map (host, float32) and the general block's
    entries so far (a generator: yields the FSC events and a warning, returns those).
    The half maps stay on the host (float32) and go to the device one at a time; at most a few Fourier grids
    exist at once there (compute/postprocessing.py: a 1024^3 box in ~45 GB)."""
    xp = be.xp
    N = v1.shape[0]
    nsh = N // 2 + 1
    shells = np.arange(nsh)
    F1 = PP.device_ft(v1, xp)
    F2 = PP.device_ft(v2, xp)
    fsc_unmasked = PP.fsc_of_fts(F1, F2)
    memory_mark("postprocess: unmasked FSC")
    curves = {"unmasked": fsc_unmasked}
    general: dict[str, object] = {}
    if mask is not None:
        below = np.nonzero((fsc_unmasked < p.randomize_at_fsc) & (shells > 0))[0]
        if len(below) == 0:
            raise InputError(f"the unmasked FSC never drops below {p.randomize_at_fsc}: cannot choose where to "
                             "randomise phases", path=str(p.i))
        ra = int(below[0])
        mask_d = be.asarray(mask)
        fts = [F1, F2]
        del F1, F2
        randomised = []
        for h, seed in ((0, p.random_seed), (1, p.random_seed + 1)):  # one half after the other
            G, fts[h] = fts[h], None
            PP.randomize_phases_in_place(G, ra, seed)
            r = PP.real_map(G, N)
            del G
            randomised.append(PP.device_ft(r, xp, mask=mask_d, consume=True))
            del r
        fsc_rand = PP.fsc_of_fts(*randomised)
        del randomised
        memory_mark("postprocess: phase-randomised FSC")
        fsc_masked = PP.masked_fsc(v1, v2, mask_d, xp)
        del mask_d
        fsc_corr = F.corrected_fsc(fsc_masked, fsc_rand, ra)
        if fsc_corr[0] <= 0:
            fsc_corr[0] = 1.0
        curves.update(masked=fsc_masked, phase_randomised=fsc_rand, corrected=fsc_corr)
        frac = float((mask > 0.5).mean())
        general.update(rlnParticleBoxFractionSolventMask=0.476 / max(frac, 1e-9), rlnMaskName=str(p.mask),
                       rlnRandomiseFrom=N * apix / ra)
        use = fsc_corr
        if F.resolution_shell(fsc_unmasked) > F.resolution_shell(fsc_corr) and not p.force_mask:
            yield Message("the unmasked FSC reaches further than the corrected masked FSC: using the unmasked "
                          "curve (as RELION does; --force_mask to use the masked one)", "warning")
            use = fsc_unmasked
    else:
        del F1, F2
        use = fsc_unmasked
    res_shell = F.resolution_shell(use)
    res = F.shell_to_angstrom(res_shell, N, apix)
    yield Progress(1, 3, "FSC")
    inv = np.where(shells > 0, shells / (N * apix), 1 / 999.0)
    yield FscUpdated(inv, curves, res)

    weight_curve = None if p.skip_fsc_weighting else use
    A = PP.device_ft(v1, xp, plus=v2, scale=0.5)  # the FT of the average of the half maps
    gx, gy_orig = PP.guinier_of_ft(A, apix)
    weighted = PP.sharpened_map(A, apix, 0.0, weight_curve)
    _, gy_w = PP.guinier_of_ft(PP.device_ft(weighted, xp), apix)
    del weighted
    if p.auto_bfac:
        B, icept, r2 = F.fit_bfactor(gx, gy_w, (N, apix), p.autob_lowres, p.autob_highres)
        general.update(rlnFittedSlopeGuinierPlot=B / 4, rlnFittedInterceptGuinierPlot=icept,
                       rlnCorrelationFitGuinierPlot=r2)
    else:
        B = p.adhoc_bfac
    low = res if p.low_pass < 0 else (p.low_pass if p.low_pass > 0 else None)
    final_d = PP.sharpened_map(A, apix, B, weight_curve, lowpass_A=low, consume=True)
    del A
    _, gy_s = PP.guinier_of_ft(PP.device_ft(final_d, xp), apix)
    final = to_host(final_d)
    del final_d
    memory_mark("postprocess: sharpening")
    return curves, res, B, final, general, (gx, gy_orig, gy_w, gy_s)
