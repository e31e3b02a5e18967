"""Local resolution (relion_postprocess --locres; compute/local_resolution.py, jobs/local_resolution.py).

- the window mask and the FSC in one window against explicit float64 loops written from RELION's raisedCosineMask
  and getFSC;
- the whole method against a one-window-at-a-time transcription of RELION's run_locres in float64 (np.fft), given
  the same phase-randomised maps: every window's curves and resolution, and both output maps;
- the phase randomisation keeps amplitudes and the phases below its shell, and gives a real map;
- half maps whose left half holds the signal to Nyquist and right half only to ~12 Å: the map says so, with numbers;
- the job end to end (files named as RELION's, pixel size, FSC STAR blocks), also from the command line;
- CPU = GPU (pytest -m gpu on a GPU machine).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from napari_gpu_relion import cli
from napari_gpu_relion.compute import local_resolution as LR
from napari_gpu_relion.compute.backend import gpu_available
from napari_gpu_relion.compute.fourier import lowpass_map
from napari_gpu_relion.compute.simulate import phantom_volume, pseudo_atomic_phantom
from napari_gpu_relion.errors import InputError
from napari_gpu_relion.events import Finished
from napari_gpu_relion.io.mrc import read_mrc, write_mrc
from napari_gpu_relion.io.star import read_star
from napari_gpu_relion.jobs import local_resolution as job


def relion_round(x: float) -> int:
    return int(x + 0.5) if x > 0 else int(x - 0.5)


def loop_mask(N: int, radius: float, radius_p: float, centre_zyx) -> np.ndarray:
    """raisedCosineMask, voxel by voxel (float64)."""
    m = np.zeros((N, N, N))
    cz, cy, cx = centre_zyx
    for k in range(N):
        for i in range(N):
            for j in range(N):
                d = math.sqrt((cz - k) ** 2 + (cy - i) ** 2 + (cx - j) ** 2)
                if d > radius_p:
                    m[k, i, j] = 0.0
                elif d < radius:
                    m[k, i, j] = 1.0
                else:
                    m[k, i, j] = 0.5 - 0.5 * math.cos(math.pi * (radius_p - d) / (radius_p - radius))
    return m


def loop_fsc(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """getFSC: FFTW-layout transforms (np.fft.rfftn, float64), every stored element, shell ROUND(|k|)."""
    N = a.shape[0]
    F1, F2 = np.fft.rfftn(a), np.fft.rfftn(b)
    n = N // 2 + 1
    num, d1, d2 = np.zeros(n), np.zeros(n), np.zeros(n)
    for k in range(N):
        kp = k if k < n else k - N
        for i in range(N):
            ip = i if i < n else i - N
            for j in range(n):
                idx = relion_round(math.sqrt(kp * kp + ip * ip + j * j))
                if idx >= n:
                    continue
                z1, z2 = F1[k, i, j], F2[k, i, j]
                num[idx] += (np.conj(z1) * z2).real
                d1[idx] += abs(z1) ** 2
                d2[idx] += abs(z2) ** 2
    return num / np.sqrt(d1 * d2)


def test_window_mask_and_fsc_equal_explicit_loops():
    N = 16
    rng = np.random.default_rng(0)
    a = rng.normal(size=(N, N, N)) + 2 * np.exp(-((np.indices((N, N, N)) - 7.0) ** 2).sum(0) / 8)
    b = a + rng.normal(scale=0.8, size=(N, N, N))
    centres = np.array([[6, 9, 5], [0, 8, 15]])  # the second one's edge leaves the box (cut, not wrapped)
    masks = LR.window_masks(centres, N, 3, 3 + 5, np)
    for w, c in enumerate(centres):
        ref = loop_mask(N, 3, 8, c)
        np.testing.assert_allclose(masks[w], ref, rtol=0, atol=1e-15)
        np.testing.assert_allclose(LR.windowed_fsc(a, b, masks[w:w + 1])[0], loop_fsc(a * ref, b * ref),
                                   rtol=0, atol=1e-12)


def test_geometry_is_relions():
    """--locres defaults at 1.0 Å/px in a 192 box: step 25, mask radius ROUND(12.5) = 13, edge 25, phases from shell
    int(192 / 25) = 7; centres on the logical grid -96 + 25 n inside radius 96 - 13, each named after RELION's loop
    point (kk, ii, jj) and centred at x = kk, y = ii, z = jj."""
    g = LR.locres_geometry(192, 1.0)
    assert (g.step, g.mask_radius, g.edge_width, g.randomize_shell) == (25, 13, 25, 7)
    grid = np.arange(-96, 96, 25)
    expect = [(kk, ii, jj) for kk in grid for ii in grid for jj in grid if kk * kk + ii * ii + jj * jj < 83 ** 2]
    assert g.n_windows == len(expect) == len(g.names)
    for (kk, ii, jj), name, c in zip(expect, g.names, g.centres, strict=True):
        assert name == f"fsc_{kk:05d}_{ii:05d}_{jj:05d}"
        assert tuple(c) == (jj + 96, ii + 96, kk + 96)
    assert not any("-0096" in name for name in g.names)  # no centre on the box's first plane fits
    assert LR.window_centres(192, 25, 13)[1][0].startswith("fsc_-0071_")  # integerToString(-71, 5) = "-0071"


def test_randomized_phases_keep_amplitudes_and_low_shells():
    N, shell = 24, 5
    rng = np.random.default_rng(1)
    v = rng.normal(size=(N, N, N))
    r = LR.randomize_phases(v, shell, seed=3)
    F, G = np.fft.rfftn(np.fft.ifftshift(v)), np.fft.rfftn(np.fft.ifftshift(r))
    k2 = LR.k2_grid(N)
    np.testing.assert_allclose(np.abs(G), np.abs(F), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(G[k2 < shell * shell], F[k2 < shell * shell], rtol=1e-10, atol=1e-9)
    changed = np.abs(G - F)[k2 >= shell * shell] > 1e-6 * np.abs(F).max()
    assert changed.mean() > 0.95


def relion_locres_loop(h1, h2, r1, r2, angpix, sampling, minres=50.0, bfactor=0.0, edge_w=2):
    """run_locres transcribed window by window in float64 with np.fft (RELION's FFTW layout: no centring), from
    the phase-randomised maps r1, r2."""
    N = h1.shape[0]
    step, mrad, edge = relion_round(sampling / angpix), relion_round(0.5 * sampling / angpix), relion_round(
        sampling / angpix)
    ra = int(N * angpix / 25.0)
    n = N // 2 + 1
    kz = np.where(np.arange(N) < n, np.arange(N), np.arange(N) - N)
    k2 = kz[:, None, None] ** 2 + kz[None, :, None] ** 2 + np.arange(n)[None, None, :] ** 2
    ires = np.floor(np.sqrt(k2) + 0.5).astype(int)
    res_grid = np.sqrt(k2) / N

    def fsc(x, y):
        F1, F2 = np.fft.rfftn(x), np.fft.rfftn(y)
        ok = ires < n
        num = np.bincount(ires[ok], (np.conj(F1) * F2).real[ok], n)
        return num / np.sqrt(np.bincount(ires[ok], np.abs(F1[ok]) ** 2, n) * np.bincount(ires[ok],
                                                                                          np.abs(F2[ok]) ** 2, n))

    s = np.sqrt(k2) / (N * angpix)
    ft_sum = np.fft.rfftn(0.5 * (h1 + h2)) * np.where(s <= 1 / (angpix * 2), np.exp(-(bfactor / 4) * s * s), 0)
    fil, inv, sw = np.zeros((N,) * 3), np.zeros((N,) * 3), np.zeros((N,) * 3)
    out = []
    half = N // 2
    for kk in range(-half, half, step):
        for ii in range(-half, half, step):
            for jj in range(-half, half, step):
                if not math.sqrt(kk * kk + ii * ii + jj * jj) < half - mrad:
                    continue
                cz, cy, cx = jj + half, ii + half, kk + half
                zz, yy, xx = np.indices((N, N, N))
                d = np.sqrt((zz - cz) ** 2 + (yy - cy) ** 2 + (xx - cx) ** 2)
                m = np.where(d > mrad + edge, 0.0,
                             np.where(d < mrad, 1.0, 0.5 - 0.5 * np.cos(np.pi * (mrad + edge - d) / edge)))
                fm, fr = fsc(h1 * m, h2 * m), fsc(r1 * m, r2 * m)
                fm[0] = 1.0 if fm[0] <= 0 else fm[0]
                fr[0] = 1.0 if fr[0] <= 0 else fr[0]
                ft = np.array([fm[i] if i < ra + 2 else (fm[i] - fr[i]) / (1 - fr[i]) for i in range(n)])
                res = 999.0
                for i in range(n):
                    if ft[i] < 0.143:
                        break
                    res = N * angpix / i if i > 0 else 999.0
                res = float(np.float32(min(minres, float(np.float32(res)))))
                ires_max = 0
                for i in range(n):
                    if ft[i] < 1e-4:
                        break
                    ires_max = i
                w = np.where(ft > 0, np.sqrt(2 * np.clip(ft, 0, None) / (1 + ft)), 0.0)
                filt = np.where(ires <= ires_max, w[np.minimum(ires, n - 1)], 0.0)
                i_f = relion_round(N * angpix / res)
                lo, hi = max(0.0, (i_f - edge_w // 2) / N), min(n, (i_f + edge_w // 2) / N)
                filt *= np.where(res_grid < lo, 1.0, np.where(res_grid > hi, 0.0,
                                                               0.5 + 0.5 * np.cos(np.pi * (res_grid - lo) / (hi - lo))))
                f = np.fft.irfftn(ft_sum * filt, s=(N, N, N), axes=(0, 1, 2))
                fil += m * f
                inv += m / res
                sw += m
                out.append((fm, fr, ft, res))
    some = sw > 0
    locres = np.where(some, 1 / (inv / np.where(some, sw, 1)), 0)
    filtered = np.where(some, fil / np.where(some, sw, 1), 0)
    return out, locres, filtered


def phantom_halves(N: int, apix: float, noise: float, seed: int = 5):
    truth = phantom_volume(pseudo_atomic_phantom(0.8 * N * apix, n_atoms=300, seed=seed), N, apix).astype(np.float64)
    rng = np.random.default_rng(seed)
    sd = noise * truth.std()
    return truth, truth + rng.normal(0, sd, truth.shape), truth + rng.normal(0, sd, truth.shape)


def test_local_resolution_equals_relions_loop_in_float64():
    N, apix, sampling = 24, 2.5, 15.0
    _, h1, h2 = phantom_halves(N, apix, 3.0)
    g = LR.locres_geometry(N, apix, sampling)
    r1 = LR.randomize_phases(h1, g.randomize_shell, 0)
    r2 = LR.randomize_phases(h2, g.randomize_shell, 1)
    res = LR.local_resolution(h1, h2, apix, sampling=sampling, bfactor=-40.0, batch=5, randomized=(r1, r2))
    ref, locres, filtered = relion_locres_loop(h1, h2, r1, r2, apix, sampling, bfactor=-40.0)
    assert g.n_windows == len(ref) > 10
    for w, (fm, fr, ft, rs) in enumerate(ref):
        np.testing.assert_allclose(res.fsc_masked[w], np.where(np.arange(len(fm)) == 0, res.fsc_masked[w], fm),
                                   atol=1e-12)
        np.testing.assert_allclose(res.fsc_random[w][1:], fr[1:], atol=1e-12)
        np.testing.assert_allclose(res.fsc_true[w], ft, rtol=1e-10, atol=1e-12)
        assert res.resolution[w] == rs
    assert len(set(res.resolution)) > 2  # the windows do not all agree: the comparison means something
    np.testing.assert_allclose(res.locres, locres, rtol=1e-6)
    np.testing.assert_allclose(res.filtered, filtered, rtol=0, atol=1e-6 * np.abs(filtered).max())


def two_region_halves(N=48, apix=2.0, seed=1):
    """A dense random structure to Nyquist; the half maps hold it in x < N/2 and only its 12 Å low-pass in
    x >= N/2, plus independent noise."""
    rng = np.random.default_rng(seed)
    truth = lowpass_map(rng.normal(size=(N, N, N)), apix, 2.2 * apix) + 0.3
    blurred = lowpass_map(truth, apix, 12.0)
    x = np.arange(N)[None, None, :]
    signal = np.where(x < N // 2, truth, blurred)
    sd = 0.5 * truth.std()
    return signal + rng.normal(0, sd, signal.shape), signal + rng.normal(0, sd, signal.shape)


def test_the_better_region_gets_the_better_resolution():
    N, apix = 48, 2.0
    h1, h2 = two_region_halves(N, apix)
    res = LR.local_resolution(h1, h2, apix, sampling=16.0, batch=16)
    left = np.median(res.locres[8:40, 8:40, 8:18])
    right = np.median(res.locres[8:40, 8:40, 30:40])
    assert 4.0 <= left < 5.0, left  # Nyquist is 4 Å
    assert 8.0 < right < 13.0, right  # the right half holds nothing finer than 12 Å
    xs = res.geometry.centres[:, 2]
    assert np.median(res.resolution[xs < 16]) < 5.0 < 8.0 < np.median(res.resolution[xs > 32])
    # the filtered map keeps the left's fine detail and not the right's noise beyond ~12 Å
    def fine(part):  # mean amplitude beyond 10 Å (shell N/5 at 2 Å/px) of a slab of the filtered map
        return np.abs(np.fft.rfftn(part, s=(N, N, N)))[..., N // 5:].mean()

    assert fine(res.filtered[:, :, 30:46]) < 0.2 * fine(res.filtered[:, :, 2:18])


@pytest.fixture(scope="module")
def half_map_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("locres")
    N, apix = 48, 3.0
    _, h1, h2 = phantom_halves(N, apix, 0.6, seed=2)
    p1 = write_mrc(d / "run_half1_class001_unfil.mrc", h1.astype(np.float32), apix)
    write_mrc(d / "run_half2_class001_unfil.mrc", h2.astype(np.float32), apix)
    z = np.indices((N, N, N)) - N // 2
    write_mrc(d / "mask.mrc", (np.sqrt((z ** 2).sum(0)) < 16).astype(np.float32), apix)
    return d, p1, d / "mask.mrc"


def test_job_writes_relions_files(half_map_files, tmp_path):
    d, p1, mask = half_map_files
    out = tmp_path / "LocalRes" / "job001"
    out.mkdir(parents=True)  # an existing folder: rootname <folder>/relion, as RELION's LocalRes job
    p = job.Params(i=p1, o=out, mask=mask, locres_sampling=24.0, adhoc_bfac=-50.0, cpu=True)
    events = list(job.run(p))
    fin = events[-1]
    assert isinstance(fin, Finished) and "median" in fin.summary and "inside the mask" in fin.summary
    for key, name in (("locres", "relion_locres.mrc"), ("locres_filtered", "relion_locres_filtered.mrc"),
                      ("locres_fscs", "relion_locres_fscs.star")):
        assert fin.outputs[key] == out / name and (out / name).is_file()
    m = read_mrc(out / "relion_locres.mrc")
    assert m.pixel_size == pytest.approx(3.0) and m.data.shape == (48, 48, 48)
    assert read_mrc(out / "relion_locres_filtered.mrc").pixel_size == pytest.approx(3.0)
    lr = np.asarray(m.data)
    inside = lr[np.asarray(read_mrc(mask).data) > 0.5]
    assert inside.min() >= 6.0 - 1e-4 and inside.max() <= 50.0 + 1e-4  # Nyquist .. --locres_minres
    g = LR.locres_geometry(48, 3.0, 24.0)
    blocks = read_star(out / "relion_locres_fscs.star")
    names = list(blocks)
    assert names[:-1] == list(g.names) and names[-1] == "local_resolution"
    first = blocks[g.names[0]]
    assert list(first.columns) == ["rlnSpectralIndex", "rlnResolution", "rlnAngstromResolution",
                                   "rlnFourierShellCorrelationCorrected", "rlnFourierShellCorrelationUnmaskedMaps",
                                   "rlnFourierShellCorrelationMaskedMaps",
                                   "rlnCorrectedFourierShellCorrelationPhaseRandomizedMaskedMaps"]
    assert len(first) == 25 and len(blocks["local_resolution"]) == g.n_windows
    assert "local_resolution" in (out / "note.txt").read_text()


def test_job_from_the_command_line(half_map_files, tmp_path, capsys):
    d, p1, _ = half_map_files
    root = tmp_path / "lr" / "mine"
    cli.main(["local_resolution", "--locres", "--i", str(p1), "--o", str(root), "--locres_sampling", "27",
              "--locres_minres", "30", "--cpu"])
    assert "local resolution where windows reach" in capsys.readouterr().out
    lr = np.asarray(read_mrc(tmp_path / "lr" / "mine_locres.mrc").data)
    assert lr.max() <= 30.0 + 1e-4 and (lr > 0).any()
    assert (tmp_path / "lr" / "mine_locres_filtered.mrc").is_file()


def test_job_refuses_bad_options(half_map_files, tmp_path):
    d, p1, _ = half_map_files
    with pytest.raises(InputError, match="--locres_sampling"):
        job.Params(i=p1, o=tmp_path / "x", locres_sampling=0.0)
    other = tmp_path / "x_locres.mrc"  # --o x would write x_locres.mrc over this input
    other.write_bytes((d / "run_half2_class001_unfil.mrc").read_bytes())
    with pytest.raises(InputError):
        job.Params(i=p1, i2=other, o=tmp_path / "x")
    p = job.Params(i=p1, o=tmp_path / "y", locres_maskrad=200.0, cpu=True)
    with pytest.raises(InputError, match="no local-resolution window"):
        list(job.run(p))


@pytest.mark.gpu
def test_cpu_and_gpu_agree():
    if not gpu_available():
        pytest.skip("no usable CUDA GPU with CuPy")
    import cupy as cp  # noqa: PLC0415

    N, apix = 48, 2.0
    h1, h2 = two_region_halves(N, apix, seed=4)
    kw = dict(sampling=14.0, bfactor=-30.0, seed=7)
    cpu = LR.local_resolution(h1, h2, apix, batch=6, xp=np, **kw)
    gpu = LR.local_resolution(cp.asarray(h1), cp.asarray(h2), apix, batch=40, xp=cp, **kw)
    np.testing.assert_allclose(gpu.fsc_masked, cpu.fsc_masked, atol=1e-10)
    np.testing.assert_allclose(gpu.fsc_random, cpu.fsc_random, atol=1e-10)
    np.testing.assert_array_equal(gpu.resolution, cpu.resolution)
    np.testing.assert_allclose(gpu.locres, cpu.locres, rtol=1e-6)
    np.testing.assert_allclose(gpu.filtered, cpu.filtered, rtol=0, atol=1e-6 * np.abs(cpu.filtered).max())


def test_the_outputs_written_together_raise_the_first_error_and_name_the_others(tmp_path, monkeypatch):
    """write_outputs runs the three writes at once: when two fail, the first is raised with a note naming the
    second, and the output that could be written is whole (atomic writes), the failed ones absent."""
    from types import SimpleNamespace  # noqa: PLC0415

    res = SimpleNamespace(locres=np.ones((4, 4, 4), np.float32),
                          filtered=np.arange(64, dtype=np.float32).reshape(4, 4, 4))
    outs = {"locres": tmp_path / "a.mrc", "locres_filtered": tmp_path / "b.mrc", "locres_fscs": tmp_path / "c.star"}
    outs["locres"].mkdir()  # a folder where the map goes: its write fails

    def no_blocks(_):
        raise ValueError("no FSC blocks")

    monkeypatch.setattr(job, "_fsc_blocks", no_blocks)
    with pytest.raises(Exception) as err:
        job.write_outputs(outs, res, 1.5)
    assert "a.mrc: output path is a folder" in str(err.value)  # the first output's error, not the STAR's
    assert any("ValueError: no FSC blocks" in n for n in getattr(err.value, "__notes__", [])), err.value
    assert np.array_equal(np.asarray(read_mrc(outs["locres_filtered"]).data), res.filtered)
    assert not outs["locres_fscs"].exists() and outs["locres"].is_dir()
    assert not [q for q in tmp_path.iterdir() if q.name.startswith(".")]  # no temporaries left
