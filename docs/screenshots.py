"""The tutorial walk-through (docs/tutorial.md), performed in the running application and photographed.

Everything goes through what a user has in napari: *File > Open Sample*, *File > Open Files*, the plugin's dock
widgets (values typed into their fields, buttons clicked), the layer list and layer controls, and clicks on the
2D class grid (delivered through napari's own mouse-callback dispatch, as a click on the canvas would be). The
jobs run on the CPU on the sample data. Run with a display or under Xvfb:

    xvfb-run -a -s "-screen 0 1366x768x24" .venv/bin/python docs/screenshots.py [--out docs/images] [--work DIR]

One screenshot of the whole window (dock widgets and live display) per step goes to
<out>/tutorial_<n>_<name>.png; the job folders go to --work (default: a new temporary folder). The script prints
each job's final status line, its wall time and the numbers the tutorial quotes, and stops at the first job that
fails or reports an error.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import time
from pathlib import Path

import numpy as np

from napari_gpu_relion.io.jobdir import RunFiles
from napari_gpu_relion.jobs.demo import INITIAL_MODEL

PLUGIN = "napari-gpu-relion"
#: Window size (pixels), the same for every screenshot: a laptop screen (the docks fit it, issue 18).
WINDOW_SIZE = (1366, 768)


def _pump(seconds: float = 0.5) -> None:
    """Let Qt process events for ``seconds`` (timers, queued job events, repaints)."""
    from qtpy.QtWidgets import QApplication

    end = time.time() + seconds
    while True:
        QApplication.processEvents()
        if time.time() >= end:
            return
        time.sleep(0.02)


class Walkthrough:
    """The viewer, the job folders, and a log of what each step produced."""

    def __init__(self, out: Path, work: Path):
        import napari

        self.out, self.work = out, work
        self.data = Path(_sample_dir())
        self.viewer = napari.Viewer(show=True)
        self.viewer.window._qt_window.resize(*WINDOW_SIZE)
        self.timings: dict[str, float] = {}
        self.notes: list[str] = []
        self.shots: list[Path] = []
        self._job_number = 0
        self._job_dock = None

    # -- bookkeeping -------------------------------------------------------------------------------------

    def job_folder(self, kind: str) -> Path:
        """RELION's naming: <kind>/jobNNN, numbered in the order the jobs are made."""
        self._job_number += 1
        return self.work / kind / f"job{self._job_number:03d}"

    def note(self, text: str) -> None:
        print("  ", text, flush=True)
        self.notes.append(text)

    def dismiss_notifications(self) -> None:
        """Close the notification pop-ups of earlier steps (the x on each), so that only new ones show."""
        from napari._qt.dialogs.qt_notification import NapariQtNotification

        for popup in self.viewer.window._qt_window.findChildren(NapariQtNotification):
            popup.close()
        _pump(0.2)

    def shot(self, n: int, name: str) -> Path:
        from napari_gpu_relion.widgets.display import LiveDisplay

        LiveDisplay.for_viewer(self.viewer).flush()
        _pump(0.5)
        path = self.out / f"tutorial_{n}_{name}.png"
        self.viewer.screenshot(str(path), canvas_only=False, flash=False)
        self.shots.append(path)
        print("wrote", path, flush=True)
        return path

    # -- docks -------------------------------------------------------------------------------------------

    def dock(self, name: str):
        """Close the previous job widget, then Plugins > GPU RELION > ``name`` (docked on the right)."""
        self.dismiss_notifications()
        if self._job_dock is not None:
            self.viewer.window.remove_dock_widget(self._job_dock)
        self._job_dock, widget = self.viewer.window.add_plugin_dock_widget(PLUGIN, name)
        _pump(0.3)
        return widget

    # -- jobs --------------------------------------------------------------------------------------------

    def run(self, widget, label: str, during=None) -> float:
        """Click Run, wait for the job (calling ``during()`` while it runs), check it finished; seconds."""
        from napari_gpu_relion.widgets.runner import JobState

        t0 = time.time()
        widget.run_button.native.click()
        while widget.job is None or not widget.job.done:
            _pump(0.1)
            if during is not None:
                during()
        elapsed = time.time() - t0
        _pump(1.0)
        state = widget.job.state
        status = widget.status_text
        print(f"[{label}] {state} in {elapsed:.1f} s: {status}", flush=True)
        if state is not JobState.FINISHED or widget.last_error:
            raise SystemExit(f"{label} did not finish cleanly: {widget.last_error or status}")
        self.timings[label] = elapsed
        return elapsed

    def run_with_live_shot(self, widget, label: str, number: int, name: str, ready) -> None:
        """Run the job and take screenshot ``number`` once while it runs, as soon as ``ready()`` holds (at its end
        if it never did), noting the job's status then and at its end."""
        taken = False

        def during() -> None:
            nonlocal taken
            if not taken and ready():
                self.note(f"{label} while running: {widget.status_text}")
                self.shot(number, name)
                taken = True

        self.run(widget, label, during=during)
        self.note(f"{label}: {widget.status_text}")
        if not taken:
            self.shot(number, name)


def _sample_dir() -> Path:
    from napari_gpu_relion.jobs.simulate import sample_data_dir

    return Path(sample_data_dir())


# ----------------------------------------------------------------------------------------------------------
# Clicks on the class grid: napari's dispatch of mouse drag callbacks (press, release) on the active layer, with
# an event that carries what those callbacks read (world position, canvas pixel position, button).


class _MouseEvent:
    def __init__(self, kind: str, position, canvas_pos):
        self.type = kind
        self.position = tuple(float(v) for v in position)
        self.pos = np.asarray(canvas_pos, dtype=float)
        self.button = 1
        self.modifiers: list = []
        self.is_dragging = False
        self.handled = False
        self.dims_displayed = [0, 1]
        self.view_direction = None
        self.up_direction = None


class _ReadOnly:
    """What napari wraps events in before handing them to callbacks (it swaps ``__wrapped__``)."""

    def __init__(self, event: _MouseEvent):
        self.__wrapped__ = event

    def __getattr__(self, name):
        return getattr(self.__dict__["__wrapped__"], name)


def click_world(viewer, position) -> None:
    """A left click without moving, at world ``position`` (Å), on the active layer."""
    from napari.utils.interactions import mouse_press_callbacks, mouse_release_callbacks

    layer = viewer.layers.selection.active
    here = (300.0, 300.0)
    mouse_press_callbacks(layer, _ReadOnly(_MouseEvent("mouse_press", position, here)))
    mouse_release_callbacks(layer, _ReadOnly(_MouseEvent("mouse_release", position, here)))
    _pump(0.1)


def tile_centre(grid, class_number: int) -> tuple[float, float]:
    """World (y, x) in Å of the centre of the tile that shows ``class_number`` (1-based)."""
    from napari_gpu_relion.widgets.display import grid_shape

    order = [int(k) for k in grid.metadata["order"]]
    tile = order.index(class_number - 1)
    N = int(grid.metadata["tile_size"])
    r, c = divmod(tile, grid_shape(len(order))[1])
    return ((r + 0.5) * N * grid.scale[0] + grid.translate[0], (c + 0.5) * N * grid.scale[1] + grid.translate[1])


def class_labels(viewer, grid_name: str = "classes") -> dict[int, tuple[float, float]]:
    """{class: (distribution %, resolution Å)} as written on the tiles ("k: d% r Å")."""
    text = viewer.layers[f"{grid_name} labels"].features["label"]
    out = {}
    for s in text:
        m = re.match(r"(\d+): ([\d.]+)% ([\d.]+) Å", str(s))
        if m:
            out[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    return out


# ----------------------------------------------------------------------------------------------------------
# The walk-through


def truth_check(w: Walkthrough, im_dir: Path, ref_dir: Path) -> None:
    """Not part of the walk-through: compare the initial model and the refinement with the simulation's truth
    (truth map, true angles). The initial model is compared in both hands (its hand is arbitrary, and the
    walk-through refines it as made); the refined poses after the best common rotation, in both hands (the refined
    map lies in the initial model's frame, so it is not compared with the truth map voxel by voxel)."""
    from napari_gpu_relion.compute.initial_model import aligned_map_correlation
    from napari_gpu_relion.io.mrc import read_mrc
    from napari_gpu_relion.jobs.demo import HAND_CHECK_A, _pose_check

    truth = np.asarray(read_mrc(w.data / "truth.mrc").data, np.float64)
    im = read_mrc(RunFiles(im_dir / "run").class_map(1))
    by_hand = aligned_map_correlation(np.asarray(im.data, np.float64), truth, float(im.pixel_size),
                                      HAND_CHECK_A)["by_hand"]
    w.note(f"truth check: initial model vs truth at {HAND_CHECK_A:g} A after the best rotation and shift: cc "
           f"{by_hand[False]['cc']:.3f} as made, {by_hand[True]['cc']:.3f} mirrored")
    run = RunFiles(ref_dir / "run")
    poses = _pose_check(run.data(), w.data / "particles.star")
    w.note(f"truth check: {poses['text']}; {100 * poses['under_10deg']:.1f}% under 10 deg")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "images"), help="screenshot folder")
    ap.add_argument("--work", default=None, help="project folder for the job folders (default: a new temp folder)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="relion_tutorial_"))
    work.mkdir(parents=True, exist_ok=True)
    # a fresh user: no parameters remembered from earlier sessions (the widgets remember their last values)
    os.environ["NAPARI_GPU_RELION_CONFIG_DIR"] = str(work / ".config")
    t_start = time.time()
    w = Walkthrough(out, work)
    viewer, data = w.viewer, w.data
    print("sample data:", data, " project folder:", work, flush=True)

    # 1. File > Open Sample > GPU RELION > Micrographs with true picks
    viewer.open_sample(PLUGIN, "micrographs")
    viewer.reset_view()
    w.note(f"sample: layers {[la.name for la in viewer.layers]}, "
           f"{len(viewer.layers['true picks'].data)} true positions")
    w.shot(1, "sample_micrographs")

    # 2. Auto-picking (LoG)
    pick_dir = w.job_folder("AutoPick")
    pick = w.dock("Auto-picking")
    pick.set_values(i=data / "micrographs.star", odir=pick_dir, LoG=True, LoG_diam_min=120.0, LoG_diam_max=180.0,
                    LoG_adjust_threshold=3.0, LoG_robust_stats=True, cpu=True)
    viewer.reset_view()  # the docked widget narrowed the canvas: fit the micrograph again (Home button)
    w.run(pick, "autopick")
    picks = viewer.layers["picks"]
    fom = picks.features["fom"].to_numpy()
    w.note(f"autopick: {len(fom)} picks, FOM {fom.min():.3f}-{fom.max():.3f}; slider "
           f"{pick.fom_slider.min:.3f}-{pick.fom_slider.max:.3f}; {pick.picks_info.value}")
    viewer.layers.selection.active = picks
    w.shot(2, "autopick")

    # 3. the FOM threshold slider hides weak picks (no re-picking); then back to all picks and Save picks
    viewer.layers["true picks"].visible = False
    pick.fom_slider.value = 0.2
    _pump(0.3)
    w.note(f"threshold 0.2: {pick.picks_info.value}")
    w.shot(3, "fom_threshold")
    pick.fom_slider.value = pick.fom_slider.min
    _pump(0.3)
    w.note(f"threshold at the lowest position: {pick.picks_info.value}")
    # the two strongest picks sit on the dark contamination blob of micrograph 1 (yellow and pink in the
    # screenshots): select them (picks layer, select tool) and delete them (Delete key / the x of the controls)
    viewer.layers.selection.active = picks
    fom = picks.features["fom"].to_numpy()
    picks.selected_data = set(np.flatnonzero(fom > 0.5).tolist())
    picks.remove_selected()
    _pump(0.3)
    w.note(f"deleted {int((fom > 0.5).sum())} picks by hand (FOM {np.sort(fom[fom > 0.5]).round(3).tolist()}): "
           f"{pick.picks_info.value}")
    pick.save_picks_button.native.click()
    _pump(0.5)
    if pick.last_error or pick.last_saved is None:
        raise SystemExit(f"Save picks failed: {pick.last_error}")
    w.note(f"save picks: {pick.status_text}")
    saved_list = pick.picks_path() / "autopick.star"

    # 4. Particle extraction from the saved picks; File > Open Files shows the extracted particles
    ext_dir = w.job_folder("Extract")
    ext = w.dock("Particle extraction")
    ext.set_values(i=data / "micrographs.star", coord_list=saved_list, o=ext_dir, extract_size=76, norm=True,
                   invert_contrast=True, cpu=True)
    w.run(ext, "extract")
    w.note(f"extract: {ext.status_text}")
    w.shot(4, "extract_boxes")  # the extraction boxes over the micrographs and the gallery of extracted particles
    viewer.layers.clear()  # the picks are saved; the layer list's delete button
    viewer.open(str(ext_dir / "particles.star"), plugin=PLUGIN)
    viewer.reset_view()
    w.note(f"extracted particles layer: {viewer.layers[-1].name} {viewer.layers[-1].data.shape}")
    w.shot(4, "extract")

    # 5. 2D classification of the sample particle stack (the 34 extracted picks are too few to classify)
    viewer.layers.remove(viewer.layers[-1])  # the extracted particles; the micrographs stay, beside the classes
    if "micrographs" not in viewer.layers:
        viewer.open_sample(PLUGIN, "micrographs")
    viewer.dims.set_point(0, 0)  # the first micrograph (the particle slider had moved on)
    c2_dir = w.job_folder("Class2D")
    c2 = w.dock("2D classification")
    c2.set_values(i=data / "particles.star", o=c2_dir, K=6, iter=10, ctf=True, particle_diameter=160.0,
                  flatten_solvent=True, zero_mask=True, center_classes=True, cpu=True)
    w.run(c2, "class2d")
    labels = class_labels(viewer)
    w.note("class2d: " + ", ".join(f"class {k}: {d:.1f}% {r:.0f} A" for k, (d, r) in labels.items()))
    w.shot(5, "class2d")

    # 6. click the good classes in the grid, then Save selection
    grid = viewer.layers["classes"]
    viewer.layers.selection.active = viewer.layers["classes labels"]
    worst = max(labels, key=lambda k: (labels[k][1], -labels[k][0]))  # the blurriest tile (then the smallest)
    good = [k for k in labels if k != worst and labels[k][0] >= 5.0]
    for k in good:
        click_world(viewer, tile_centre(grid, k))
    w.note(f"clicked classes {good}: {c2.selection_info.value}")
    c2.save_selection_button.native.click()
    _pump(0.5)
    if c2.last_error or c2.last_saved is None:
        raise SystemExit(f"Save selection failed: {c2.last_error}")
    selection_star, n_selected = c2.last_saved
    w.note(f"save selection: {c2.status_text}")
    w.shot(6, "class_selection_clicks")

    # 7. the same selection with the Class selection widget (the Select job)
    sel_dir = w.job_folder("Select")
    data_star = RunFiles(c2_dir / "run").latest_data()
    sel = w.dock("Class selection")
    sel.set_values(i=data_star, o=sel_dir / "particles.star", classes=",".join(map(str, sorted(good))))
    w.run(sel, "select")
    w.note(f"select: {sel.status_text}")
    w.shot(7, "select_widget")

    # 8. 3D initial model of the saved selection from the particles alone (the demo's options); the map forms live
    im_dir = w.job_folder("InitialModel")
    im = w.dock("3D initial model")
    im.set_values(i=selection_star, o=im_dir, ctf=True, particle_diameter=160.0, flatten_solvent=True,
                  zero_mask=True, cpu=True, **INITIAL_MODEL)  # the demo's options
    w.run_with_live_shot(im, "initial_model", 8, "initial_model",
                         lambda: re.search(r"iteration ([6-9]\d)\b", im.status_text))
    viewer.layers.remove(viewer.layers["class001"])  # the initial model's map (its file stays): the refinement's
    # joined map takes this name at the end

    # 9. 3D auto-refine of the saved selection from the initial model; the maps and FSC update live (micrographs and
    # class grid stay loaded: the maps switch the viewer to 3D, the 2D/3D button shows the 2D layers again)
    ref_dir = w.job_folder("Refine3D")
    r3 = w.dock("3D auto-refine")
    r3.set_values(i=selection_star, ref=RunFiles(im_dir / "run").class_map(1), o=ref_dir, ini_high=60.0, ctf=True,
                  flatten_solvent=True, particle_diameter=160.0, healpix_order=1, auto_local_healpix_order=3,
                  cpu=True)
    w.run_with_live_shot(r3, "refine3d", 9, "refine3d_live",
                         lambda: r3.display.fsc is not None and re.search(r"iteration [3-9]\b", r3.status_text))

    # 10. the Angular distribution dock opened when the job finished (below the FSC, beside the job dock)
    viewer.layers.selection.active = viewer.layers["class001"]
    w.shot(10, "refine3d_angular_distribution")

    # 11. Mask creation from the refined map, threshold = the level of its surface (in the job's status line)
    mask_dir = w.job_folder("MaskCreate")
    iso = float(viewer.layers["class001"].metadata["iso_level"])
    threshold = float(f"{iso:.3g}")
    w.note(f"class001 surface level: {iso:.4f} -> --ini_threshold {threshold}")
    mk = w.dock("Mask creation")
    mk.set_values(i=RunFiles(ref_dir / "run").class_map(1), o=mask_dir / "mask.mrc", ini_threshold=threshold,
                  extend_inimask=2.0, width_soft_edge=4.0, lowpass=15.0)
    w.run(mk, "mask_create")
    w.note(f"mask: {mk.status_text}")
    for name in ("half1", "half2"):
        viewer.layers[name].visible = False
    mask_layer = viewer.layers["mask"]
    mask_layer.opacity = 0.35  # layer controls: see the map through its mask
    viewer.layers.selection.active = mask_layer
    w.shot(11, "mask_create")

    # 12. Post-process the half maps with the mask; the FSC dock shows the masked / corrected curves
    pp_dir = w.job_folder("PostProcess")
    pp = w.dock("Post-process")
    pp.set_values(i=RunFiles(ref_dir / "run").unfiltered_half_map(1), o=pp_dir, mask=mask_dir / "mask.mrc",
                  adhoc_bfac=-200.0, low_pass=-1.0)
    w.run(pp, "postprocess")
    w.note(f"postprocess: {pp.status_text}")
    for layer in viewer.layers:
        layer.visible = layer.name == "postprocess"
    viewer.layers.selection.active = viewer.layers["postprocess"]
    w.shot(12, "postprocess")

    # 13. the Jobs dock: every job of this session with its status and outputs, offered as the next job's inputs
    jobs = w.dock("Jobs")
    _pump(4.0)  # its first scan of the project folder runs in a worker thread
    jobs.select_job(ref_dir)  # the refinement: its outputs offered to the next jobs
    _pump(1.0)
    w.note(f"jobs dock: {jobs.table.rowCount()} jobs listed")
    w.shot(13, "jobs_panel")

    total = time.time() - t_start
    truth_check(w, im_dir, ref_dir)
    print("\nsummary", flush=True)
    for text in w.notes:
        print("  ", text)
    for label, seconds in w.timings.items():
        print(f"   {label:12s} {seconds:7.1f} s")
    print(f"   total wall time {total:.0f} s (jobs {sum(w.timings.values()):.0f} s); project folder {work}")
    print(f"   {n_selected} particles selected by clicking; screenshots: {len(w.shots)}")
    viewer.close()


if __name__ == "__main__":
    main()
