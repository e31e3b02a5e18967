"""Post-processing in bounded memory (compute/postprocessing.py, issue 21) gives the numbers of the whole-grid
implementation it replaced: the FSC curves, the B-factor fit, the Guinier curves and the sharpened maps agree
to float64 rounding (the maps are written as float32)."""

import numpy as np
import pytest

from napari_gpu_relion.compute import fourier
from napari_gpu_relion.compute import fsc as F
from napari_gpu_relion.compute import postprocessing as PP
from napari_gpu_relion.compute.fourier import rfft_centered
from napari_gpu_relion.compute.masks import soft_spherical_mask
from napari_gpu_relion.compute.simulate import phantom_volume, pseudo_atomic_phantom
from napari_gpu_relion.io.mrc import read_mrc, write_mrc
from napari_gpu_relion.io.star import read_star
from napari_gpu_relion.jobs import postprocess

N, APIX = 48, 3.0


def whole_grid_postprocess(v1, v2, mask, apix, *, auto_bfac=True, autob_lowres=12.0, autob_highres=0.0,
                           adhoc_bfac=0.0, low_pass=0.0, randomize_at_fsc=0.8, seed=0, force_mask=False):
    """jobs/postprocess.run's arithmetic before issue 21 (float64 maps, whole-grid functions of compute/fsc.py)."""
    v1, v2 = v1.astype(np.float64), v2.astype(np.float64)
    n = v1.shape[0]
    shells = np.arange(n // 2 + 1)
    fsc_unmasked = F.fsc(v1, v2)
    curves = {"unmasked": fsc_unmasked}
    use = fsc_unmasked
    if mask is not None:
        mask = mask.astype(np.float64)
        fsc_masked = F.fsc(v1 * mask, v2 * mask)
        ra = int(np.nonzero((fsc_unmasked < randomize_at_fsc) & (shells > 0))[0][0])
        r1 = F.randomize_phases_beyond(v1, ra, seed)
        r2 = F.randomize_phases_beyond(v2, ra, seed + 1)
        fsc_rand = F.fsc(r1 * mask, r2 * mask)
        fsc_corr = F.corrected_fsc(fsc_masked, fsc_rand, ra)
        if fsc_corr[0] <= 0:
            fsc_corr[0] = 1.0
        curves.update(masked=fsc_masked, phase_randomised=fsc_rand, corrected=fsc_corr)
        use = fsc_corr
        if F.resolution_shell(fsc_unmasked) > F.resolution_shell(fsc_corr) and not force_mask:
            use = fsc_unmasked
    res = F.shell_to_angstrom(F.resolution_shell(use), n, apix)
    avg = 0.5 * (v1 + v2)
    weighted = F.apply_bfactor_and_fsc_weight(avg, apix, 0.0, use)
    gx, gy_orig = F.guinier(avg, apix)
    _, gy_w = F.guinier(weighted, apix)
    B = F.fit_bfactor(gx, gy_w, (n, apix), autob_lowres, autob_highres)[0] if auto_bfac else adhoc_bfac
    low = res if low_pass < 0 else (low_pass if low_pass > 0 else None)
    final = F.apply_bfactor_and_fsc_weight(avg, apix, B, use, lowpass_A=low)
    _, gy_s = F.guinier(final, apix)
    masked = None if mask is None else (final * mask).astype(np.float32)
    return curves, res, B, final, masked, (gy_orig, gy_w, gy_s)


@pytest.fixture(scope="module")
def halves(tmp_path_factory):
    """Two noisy half maps of a phantom (independent noise, some shared low-pass blur) and a soft spherical mask,
    as float32 MRC files."""
    d = tmp_path_factory.mktemp("pp")
    truth = phantom_volume(pseudo_atomic_phantom(100.0, seed=3), N, APIX).astype(np.float64)
    rng = np.random.default_rng(5)
    sd = 0.6 * truth.std()
    maps = [truth + rng.normal(0, sd, truth.shape) for _ in range(2)]
    paths = []
    for k, m in enumerate(maps, start=1):
        paths.append(write_mrc(d / f"run_half{k}_class001_unfil.mrc", m.astype(np.float32), APIX))
    mask = soft_spherical_mask(N, 0.42 * N, 4.0, 3)
    write_mrc(d / "mask.mrc", mask, APIX)
    return d, paths, d / "mask.mrc"


def _run(p):
    return list(postprocess.run(p))


@pytest.mark.parametrize("with_mask", [True, False])
def test_postprocess_equals_the_whole_grid_implementation(halves, tmp_path, with_mask, monkeypatch):
    monkeypatch.setattr(fourier, "SLAB_BYTES", 5 * N * (N // 2 + 1) * PP.SLAB_BYTES_PER_VOXEL)  # 10 slabs
    d, (h1, h2), mask_path = halves
    out = tmp_path / "pp"
    events = _run(postprocess.Params(i=h1, o=out, mask=mask_path if with_mask else None, auto_bfac=True,
                                     autob_lowres=12.0, low_pass=-1.0, cpu=True))
    assert "resolution" in events[-1].summary
    v1, v2 = (np.asarray(read_mrc(h).data, np.float32) for h in (h1, h2))
    mask = np.asarray(read_mrc(mask_path).data, np.float32) if with_mask else None
    curves, res, B, final, masked, (gy_orig, gy_w, gy_s) = whole_grid_postprocess(v1, v2, mask, APIX,
                                                                                   low_pass=-1.0)
    star = read_star(out / "postprocess.star")
    g, fsc_df, guin = star["general"], star["fsc"], star["guinier"]
    assert g["rlnFinalResolution"] == pytest.approx(res, rel=1e-12)
    assert g["rlnBfactorUsedForSharpening"] == pytest.approx(B, rel=1e-9, abs=1e-9)
    columns = {"unmasked": "rlnFourierShellCorrelationUnmaskedMaps"}
    if with_mask:
        columns |= {"masked": "rlnFourierShellCorrelationMaskedMaps",
                    "corrected": "rlnFourierShellCorrelationCorrected",
                    "phase_randomised": "rlnCorrectedFourierShellCorrelationPhaseRandomizedMaskedMaps"}
    worst_fsc = 0.0
    for key, col in columns.items():
        worst_fsc = max(worst_fsc, float(np.abs(fsc_df[col].to_numpy() - curves[key]).max()))
    assert worst_fsc < 1e-9  # the STAR file's 6 significant digits aside, the same curves
    sel = slice(1, None)
    for col, ref in zip(("rlnLogAmplitudesOriginal", "rlnLogAmplitudesWeighted", "rlnLogAmplitudesSharpened"),
                        (gy_orig, gy_w, gy_s), strict=True):
        np.testing.assert_allclose(guin[col].to_numpy(), ref[sel], rtol=1e-5, atol=1e-5)  # the STAR's digits
    ours = np.asarray(read_mrc(out / "postprocess.mrc").data, np.float64)
    rel = float(np.abs(ours - final).max() / np.abs(final).max())
    assert rel < 1e-6, rel  # float32 maps: at most a unit or two of float32 rounding
    if with_mask:
        ours_m = np.asarray(read_mrc(out / "postprocess_masked.mrc").data, np.float64)
        assert float(np.abs(ours_m - masked).max() / np.abs(masked).max()) < 1e-6


def test_lean_pieces_match_the_whole_grid_functions(monkeypatch):
    """Each slab-wise piece against its whole-grid function, in float64, in slabs of 3 rows (the last of 2)."""
    monkeypatch.setattr(fourier, "SLAB_BYTES", 3 * 32 * 17 * PP.SLAB_BYTES_PER_VOXEL)
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 32, 32, 32))
    Fa, Fb = rfft_centered(a, 3), rfft_centered(b, 3)
    np.testing.assert_allclose(PP.fsc_of_fts(Fa, Fb), F.fsc_from_fts(Fa, Fb, 3), rtol=1e-13, atol=1e-15)
    R = Fa.copy()
    PP.randomize_phases_in_place(R, 6.0, seed=7)
    np.testing.assert_array_equal(PP.real_map(R, 32), F.randomize_phases_beyond(a, 6.0, 7))
    np.testing.assert_allclose(PP.guinier_of_ft(Fa, 2.0)[1], F.guinier(a, 2.0)[1], rtol=1e-13)
    curve = np.clip(1.0 - np.arange(17) / 12.0, -0.1, 1.0)
    np.testing.assert_array_equal(PP.sharpened_map(Fa, 2.0, -80.0, curve, lowpass_A=9.0),
                                  F.apply_bfactor_and_fsc_weight(a, 2.0, -80.0, curve, lowpass_A=9.0))
