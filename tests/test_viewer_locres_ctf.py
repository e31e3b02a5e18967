"""The CTF refinement and local-resolution docks in a real (Xvfb) napari viewer (issue 51): registered as the plugin's
docks with RELION's options in tabs, building the very command line the CLI builds (LocalRes: <job folder>/relion, as
RELION); a post-processing chained by the Jobs dock into local resolution, whose result is the filtered map's surface
coloured by the local resolution read back from the written files, with its colour bar (canvas and dock) in Å; the
surface drawn again at another level from the folder; CTF refinement run from its dock on the sample particles, its
aberration plot shown and its particles offered to the next refinement; both docks usable on a 1366 x 768 screen."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("napari")

import test_layout_laptop as laptop  # noqa: E402 - its measuring helpers (no test of it is collected here)
from qtpy.QtCore import QRect  # noqa: E402

from napari_gpu_relion.cli import build_parser  # noqa: E402
from napari_gpu_relion.compute.simulate import phantom_volume, pseudo_atomic_phantom  # noqa: E402
from napari_gpu_relion.display_surface import full_grid_points, sample_linear  # noqa: E402
from napari_gpu_relion.io.mrc import read_mrc, write_mrc  # noqa: E402
from napari_gpu_relion.jobs import ctf_refine, local_resolution, postprocess, reconstruct  # noqa: E402
from napari_gpu_relion.jobs.common import command_line  # noqa: E402
from napari_gpu_relion.widgets import dock_layout  # noqa: E402
from napari_gpu_relion.widgets import jobs_model as jm  # noqa: E402
from napari_gpu_relion.widgets.display import LiveDisplay  # noqa: E402
from napari_gpu_relion.widgets.layout_model import PANEL_MIN_WIDTH  # noqa: E402
from napari_gpu_relion.widgets.runner import JobState  # noqa: E402

PLUGIN = "napari-gpu-relion"
SURFACE = local_resolution.SURFACE_NAME

pytestmark = pytest.mark.usefixtures("config_dir")


def _cli_params(module, argv: list[str]):
    """The Params the command line builds from ``argv`` (``<job> --flag value ...``)."""
    args = build_parser().parse_args([str(a) for a in argv])
    return module.Params(**{f.name: getattr(args, f.name) for f in dataclasses.fields(module.Params) if f.init})


def _touch(*paths: Path) -> None:
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x")


def _tabs(widget) -> list[str]:
    return [widget.tabs.tabText(k) for k in range(widget.tabs.count())]


def test_every_dock_derives_its_rootname_from_its_output_field_in_one_way():
    """<job folder>/<rootname>: the job's DEFAULT_ROOT (LocalRes: relion), relion_refine's run, else the folder or
    file itself; the local-resolution dock adds no rootname of its own."""
    from napari_gpu_relion.jobs import refine3d
    from napari_gpu_relion.widgets import job_widget as jw
    from napari_gpu_relion.widgets.local_resolution import LocalResolutionWidget

    def rootnames(module) -> dict[str, str]:
        return {s.name: r for s in jw.field_specs(module.Params) if (r := jw.output_rootname(module, s)) is not None}

    assert rootnames(local_resolution) == {"o": "relion"}
    assert rootnames(refine3d) == {"o": "run"}
    assert rootnames(postprocess) == {} and rootnames(ctf_refine) == {}
    assert "values" not in vars(LocalResolutionWidget)


def test_the_docks_build_the_command_lines_of_the_cli(make_napari_viewer, tmp_path):
    star, pp, h1, mask = (tmp_path / "Refine3D/job001/run_data.star", tmp_path / "PostProcess/job002/postprocess.star",
                          tmp_path / "Refine3D/job001/run_half1_class001_unfil.mrc", tmp_path / "mask.mrc")
    _touch(star, pp, h1, h1.with_name("run_half2_class001_unfil.mrc"), mask)
    viewer = make_napari_viewer()
    _, ctf = viewer.window.add_plugin_dock_widget(PLUGIN, "CTF refinement")
    assert ctf.job_module is ctf_refine and _tabs(ctf) == ["I/O", "CTF", "Aberrations", "Compute", "Result"]
    assert ctf.mpi_ranks is not None  # runs under MPI, as on the command line
    # RELION's questions set --fit_mode (folded under More options), and follow it
    questions = ctf.fit_questions
    assert [q.label for q in questions.values()] == ["Fit defocus?", "Fit astigmatism?", "Fit B-factor?",
                                                     "Fit phase-shift?"]
    assert {n: q.value for n, q in questions.items()} == {  # RELION's default fpmfm
        "fit_defocus_mode": "Per-particle", "fit_astigmatism_mode": "Per-micrograph",
        "fit_bfactor_mode": "Per-micrograph", "fit_phase_mode": "No"}
    questions["fit_defocus_mode"].value = "Per-micrograph"
    questions["fit_bfactor_mode"].value = "No"
    assert ctf.inputs["fit_mode"].value == "fmmff"
    ctf.set_values(fit_mode="pppfp")
    assert {q.value for q in questions.values()} == {"Per-particle"}
    out = tmp_path / "CtfRefine" / "job003"
    ctf.set_values(i=star, f=pp, o=out, fit_defocus=True, fit_beamtilt=True, odd_aberr_max_n=3, cpu=True)
    questions["fit_phase_mode"].value = "No"
    questions["fit_defocus_mode"].value = "Per-micrograph"
    questions["fit_astigmatism_mode"].value = "Per-micrograph"
    questions["fit_bfactor_mode"].value = "Per-micrograph"
    argv = ["ctf_refine", "--i", star, "--o", out, "--f", pp, "--fit_defocus", "--fit_mode", "fmmfm",
            "--fit_beamtilt", "--odd_aberr_max_n", "3", "--cpu"]
    params = ctf.build_params()
    assert params == _cli_params(ctf_refine, argv)
    assert command_line("ctf_refine", params) == shlex.join(["napari-gpu-relion", *(str(a) for a in argv)])

    _, lr = viewer.window.add_plugin_dock_widget(PLUGIN, "Local resolution")
    assert lr.job_module is local_resolution and _tabs(lr) == ["I/O", "LocalRes", "Compute", "Result"]
    assert lr.mpi_ranks is None and lr.inputs["o"].mode.value == "d"  # asks for the job folder
    folder = tmp_path / "LocalRes" / "job004"
    lr.set_values(i=h1, o=folder, mask=mask, locres_sampling=20.0, adhoc_bfac=-50.0, cpu=True)
    params = lr.build_params()
    assert params.o == folder / "relion" and params.outputs()["locres"] == folder / "relion_locres.mrc"
    argv = ["local_resolution", "--i", h1, "--o", folder / "relion", "--mask", mask, "--adhoc_bfac", "-50.0",
            "--locres_sampling", "20.0", "--cpu"]
    assert params == _cli_params(local_resolution, argv)
    assert command_line("local_resolution", params) == shlex.join(["napari-gpu-relion", *(str(a) for a in argv)])


def _halves(folder: Path, n: int = 32, apix: float = 4.0) -> tuple[Path, Path]:
    """Two half maps of a pseudo-atomic phantom (RELION's names), their noise growing along x (so is the local
    resolution), and a spherical mask."""
    truth = phantom_volume(pseudo_atomic_phantom(0.8 * n * apix, n_atoms=200, seed=3), n, apix)
    rng = np.random.default_rng(3)
    sd = truth.std() * (0.2 + 3.0 * np.arange(n) / n)
    folder.mkdir(parents=True, exist_ok=True)
    h1 = write_mrc(folder / "run_half1_class001_unfil.mrc", (truth + rng.normal(0, sd, truth.shape)).astype(
        np.float32), apix)
    write_mrc(folder / "run_half2_class001_unfil.mrc", (truth + rng.normal(0, sd, truth.shape)).astype(np.float32),
              apix)
    z = np.indices((n,) * 3) - n // 2
    mask = write_mrc(folder.parent.parent / "MaskCreate" / "job002" / "mask.mrc",
                     (np.sqrt((z ** 2).sum(0)) < 12).astype(np.float32), apix)
    return h1, mask


def test_a_post_processing_chained_into_local_resolution_shows_the_coloured_surface(make_napari_viewer, qtbot,
                                                                                     tmp_path, session, errors):
    project = tmp_path / "project"
    h1, mask = _halves(project / "Refine3D" / "job001")
    pp = project / "PostProcess" / "job003"
    for _ in postprocess.run(postprocess.Params(i=h1, o=pp, mask=mask, adhoc_bfac=-40.0, cpu=True)):
        pass
    viewer = make_napari_viewer()
    display = LiveDisplay.for_viewer(viewer)
    other = np.zeros((32, 32, 32), np.float32)
    other[8:24, 8:24, 8:24] = 1
    from napari_gpu_relion.events import MapUpdated

    display.handle(MapUpdated("postprocess", other, 4.0))  # a map shown before: hidden under the coloured one
    display.flush()
    _, panel = viewer.window.add_plugin_dock_widget(PLUGIN, "Jobs")
    panel.project.line_edit.value = str(project)

    def listed() -> bool:  # the list is rescanned in a worker thread
        panel.refresh()
        return any(r.folder.resolve() == pp.resolve() and r.status == "finished" for r in panel.records)

    qtbot.waitUntil(listed, timeout=10_000)
    panel.select_job(pp)  # its offers are found in the scan's worker thread
    qtbot.waitUntil(lambda: panel.offers_folder is not None and panel.offers_folder.resolve() == pp.resolve(),
                    timeout=10_000)
    (offer,) = [o for o in panel.current_offers if o.job == "local_resolution"]
    assert offer.label == "Local resolution ← postprocess.star"
    lr = panel.open_offer(offer=offer)  # the Local resolution dock, filled from the post-processing
    values = lr.values()
    assert values["i"] == h1 and values["i2"] == h1.with_name("run_half2_class001_unfil.mrc")
    assert values["mask"] == mask and values["adhoc_bfac"] == pytest.approx(-40.0)
    folder = project / "LocalRes" / "job004"
    assert values["o"] == folder / "relion"
    lr.set_values(locres_sampling=32.0, cpu=True)
    lr.run_button.native.click()
    qtbot.waitUntil(lambda: lr.job is not None and lr.job.done and not lr.display.pending, timeout=60_000)
    assert lr.job.state is JobState.FINISHED, lr.status_text
    assert "median" in lr.status_text and not errors
    assert (folder / "relion_locres.mrc").is_file() and (folder / "note.txt").is_file()

    layer = viewer.layers[SURFACE]
    assert type(layer).__name__ == "Surface" and viewer.dims.ndisplay == 3
    verts, faces, shown = layer.data
    assert len(faces) > 50 and len(shown) == len(verts)
    # the colours are the written local resolution at the vertices (binning: none at box 32)
    locres = np.asarray(read_mrc(folder / "relion_locres.mrc").data, np.float64)
    expected = sample_linear(locres, full_grid_points(verts, layer.metadata["display_bin"]), locres != 0)
    np.testing.assert_allclose(shown, expected, rtol=1e-5, atol=1e-4)
    inside = locres[(np.asarray(read_mrc(mask).data) > 0.5) & (locres != 0)]
    limits = tuple(np.percentile(inside, [5, 95]))
    assert limits[1] > limits[0] + 1.0  # resolutions from Nyquist (8 Å) to coarser where the noise is
    assert tuple(layer.contrast_limits) == pytest.approx(limits, rel=1e-5)
    assert layer.colormap.name == "turbo" and layer.colorbar.visible
    assert layer.metadata["path"] == str(folder / "relion_locres_filtered.mrc")
    caption = viewer.canvas.overlays.text
    assert caption.visible and caption.text == "local resolution (Å)"
    assert not viewer.layers["postprocess"].visible  # the grey map would hide the colours
    # the dock's colour bar: the same range, labelled in Å
    assert lr.legend.limits == pytest.approx(limits, rel=1e-5)
    assert lr.legend.labels[0] == f"{limits[0]:.1f} Å" and lr.legend.labels[-1] == f"{limits[1]:.1f} Å"
    assert "inside the mask" in lr.result_info.value

    # drawn again from the folder's files at another level: the same layer, in place
    level = 0.5 * layer.metadata["iso_level"]
    lr.surface_level.value = f"{level:.6g}"
    worker = lr.show_surface()
    qtbot.waitUntil(lambda: layer.metadata["iso_level"] == pytest.approx(level, rel=1e-5) and not lr.display.pending,
                    timeout=20_000)
    assert [la.name for la in viewer.layers].count(SURFACE) == 1 and len(layer.data[0]) != len(verts)
    assert worker is not None and "coloured by relion_locres.mrc" in lr.status_text
    lr.surface_level.value = "high"
    assert lr.show_surface() is None and "must be a number" in lr.last_error
    layer.visible = False  # the caption goes with the surface
    assert not caption.visible


@pytest.mark.slow
def test_ctf_refinement_dock_runs_and_shows_its_aberration_plot(make_napari_viewer, qtbot, tmp_path, session,
                                                                errors):
    from napari_gpu_relion.jobs.simulate import sample_data_dir

    sample = Path(sample_data_dir())
    star = sample / "particles.star"
    if not star.is_file():
        star = sample / "particles" / "particles.star"
    project = tmp_path / "project"
    halves = []
    for k in (1, 2):
        o = project / "Refine3D" / "job001" / f"run_half{k}_class001_unfil.mrc"
        for _ in reconstruct.run(reconstruct.Params(i=star, o=o, ctf=True, subset=k, cpu=True)):
            pass
        halves.append(o)
    viewer = make_napari_viewer()
    _, w = viewer.window.add_plugin_dock_widget(PLUGIN, "CTF refinement")
    out = project / "CtfRefine" / "job002"
    w.set_values(i=star, m1=halves[0], m2=halves[1], o=out, fit_beamtilt=True, cpu=True)
    w.run_button.native.click()
    assert w.cancel_button.enabled or w.job.done  # Cancel while it runs
    qtbot.waitUntil(lambda: w.job is not None and w.job.done, timeout=60_000)
    assert w.job.state is JobState.FINISHED, w.status_text
    assert (out / "particles_ctf_refine.star").is_file() and not w.cancel_button.enabled
    assert "400 particles" in w.result_info.value
    assert [v.path.name for v in w.plot_views] == ["asymmetric_aberrations_optics-group_1.png"]
    assert all(v.loaded for v in w.plot_views)
    assert w.show_plots() == [out / "asymmetric_aberrations_optics-group_1.png"]  # from the folder, at any time
    assert w.tabs.tabText(w.tabs.currentIndex()) == "Result"
    # its particles go on to the next refinement (Jobs dock), the job known from this session
    (rec,) = [r for r in jm.SESSION.records() if r.job == "ctf_refine"]
    assert rec.folder == out and rec.status == "finished"
    offered = {o.job: o.values for o in jm.offers(rec, project)}
    assert offered["refine3d"]["i"] == str(out / "particles_ctf_refine.star")
    assert offered["ctf_refine"]["m1"] == str(halves[0])  # a second round on the same maps
    assert not errors


@pytest.mark.slow
def test_both_docks_fit_a_1366x768_screen(make_napari_viewer, monkeypatch, session):
    screen = (1366, 768)
    monkeypatch.setattr(dock_layout, "screen_room", lambda main: QRect(0, 0, *screen))
    viewer = make_napari_viewer(show=True)
    main = viewer.window._qt_window  # noqa: SLF001 - the QMainWindow whose geometry is measured
    main.resize(*screen)
    laptop._pump()
    viewer.window.add_plugin_dock_widget(PLUGIN, "Jobs")
    for name in ("CTF refinement", "Local resolution"):
        _, widget = viewer.window.add_plugin_dock_widget(PLUGIN, name)
        laptop._pump()
        assert widget.native.minimumSizeHint().width() <= PANEL_MIN_WIDTH, name
        for tab in range(widget.tabs.count()):  # every tab, the result tab too
            widget.tabs.setCurrentIndex(tab)
            laptop._pump(0.1)
            laptop.assert_room(viewer, main, screen, name)
            laptop.assert_job_dock_usable(widget, main, f"{name} {widget.tabs.tabText(tab)}")
