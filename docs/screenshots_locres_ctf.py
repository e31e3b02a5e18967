"""Screenshots of the CTF refinement and local-resolution docks (issue 51; docs/local_resolution.md,
docs/ctf_refinement.md), taken from the running application at 1366 x 768 with the Jobs dock open, on the sample data.

The half maps are reconstructed from the sample particles' true angles (as the demo does), the mask made from the
sample reference and the half maps post-processed (B-factor -200 Å², as in the tutorial) without the viewer; then, as
a user: the post-processed map opened (File > Open Files); the Jobs dock's "Local resolution <- postprocess.star"
opens the Local resolution dock filled (half maps, mask, B-factor, a new LocalRes/jobNNN), Run, and the map's surface
coloured by its local resolution appears; the same post-processing's "CTF refinement <- postprocess.star" opens the
CTF refinement dock (its particles chosen: the sample's), with defocus per particle and beam tilt fitted, Run, and its
aberration plot shown. The jobs run on the CPU.

    xvfb-run -a -s "-screen 0 1366x768x24" .venv/bin/python docs/screenshots_locres_ctf.py [--out docs/images]
        [--work DIR]

Writes <out>/locres_1_jobs_offer.png, locres_2_coloured_surface.png, ctf_refine_1_dock.png and
ctf_refine_2_result.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from screenshots import PLUGIN, WINDOW_SIZE, _pump, _sample_dir  # noqa: E402


def _headless_inputs(data: Path, work: Path) -> Path:
    """Reconstruct/job001 half maps (true angles), MaskCreate/job002 mask, PostProcess/job003; the postprocess.star."""
    from napari_gpu_relion.jobs import mask_create, postprocess, reconstruct

    star = data / "particles.star"
    halves = [work / "Reconstruct" / "job001" / f"run_half{k}_class001_unfil.mrc" for k in (1, 2)]
    for k, out in enumerate(halves, start=1):
        for _ in reconstruct.run(reconstruct.Params(i=star, o=out, ctf=True, subset=k, cpu=True)):
            pass
    mask = work / "MaskCreate" / "job002" / "mask.mrc"
    for _ in mask_create.run(mask_create.Params(i=data / "reference.mrc", o=mask, ini_threshold=0.3,
                                                extend_inimask=2.0, width_soft_edge=4.0, lowpass=15.0)):
        pass
    pp = work / "PostProcess" / "job003"
    for ev in postprocess.run(postprocess.Params(i=halves[0], o=pp, mask=mask, adhoc_bfac=-200.0, low_pass=-1.0,
                                                 cpu=True)):
        last = ev
    print("inputs:", last.summary, flush=True)
    return pp / "postprocess.star"


def _run(widget, label: str) -> None:
    from napari_gpu_relion.widgets.runner import JobState

    t0 = time.time()
    widget.run_button.native.click()
    while widget.job is None or not widget.job.done:
        _pump(0.1)
    _pump(1.0)
    print(f"[{label}] {widget.job.state} in {time.time() - t0:.1f} s: {widget.status_text}", flush=True)
    if widget.job.state is not JobState.FINISHED or widget.last_error:
        raise SystemExit(f"{label} did not finish cleanly: {widget.last_error or widget.status_text}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "images"), help="screenshot folder")
    ap.add_argument("--work", default=None, help="project folder (default: a new temporary folder)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="relion_locres_ctf_"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ["NAPARI_GPU_RELION_CONFIG_DIR"] = str(work / ".config")  # a fresh user's docks
    data = Path(_sample_dir())
    star = _headless_inputs(data, work)

    import napari

    from napari_gpu_relion.widgets.display import LiveDisplay

    viewer = napari.Viewer(show=True)
    viewer.window._qt_window.resize(*WINDOW_SIZE)  # noqa: SLF001 - the laptop screen of every screenshot

    def shot(name: str) -> None:
        LiveDisplay.for_viewer(viewer).flush()
        _pump(2.0)  # a status line of several lines is laid out at a later turn of the event loop
        path = out / f"{name}.png"
        viewer.screenshot(str(path), canvas_only=False, flash=False)
        print("wrote", path, flush=True)

    # the post-processed map (File > Open Files), then the Jobs dock over the project: the post-processing's offers
    viewer.open(str(star.parent / "postprocess_masked.mrc"), plugin=PLUGIN)
    _, jobs = viewer.window.add_plugin_dock_widget(PLUGIN, "Jobs")
    jobs.project.line_edit.value = str(work)
    t0 = time.time()
    while jobs.select_job(star.parent) is None and time.time() - t0 < 20:
        jobs.refresh()
        _pump(0.3)
    _pump(0.5)
    labels = [o.label for o in jobs.current_offers]
    print("offers:", labels, flush=True)
    row = next(k for k, o in enumerate(jobs.current_offers) if o.job == "local_resolution")
    jobs.offer_list.setCurrentRow(row)
    shot("locres_1_jobs_offer")

    # Open next job: the Local resolution dock, filled from the post-processing; Run
    jobs.open_button.native.click()
    lr = jobs.last_opened
    lr.set_values(cpu=True)
    print("local resolution values:", {k: str(v) for k, v in lr.values().items() if v not in (None, False)})
    _run(lr, "local_resolution")
    viewer.layers.selection.active = viewer.layers[lr.job_module.SURFACE_NAME]
    shot("locres_2_coloured_surface")

    # the same post-processing into CTF refinement: its STAR; the particles chosen (the sample's, with their angles)
    jobs.select_job(star.parent)
    _pump(0.3)
    offer = next(o for o in jobs.current_offers if o.job == "ctf_refine")
    ctf = jobs.open_offer(offer=offer)
    ctf.set_values(i=data / "particles.star", fit_defocus=True, fit_mode="fpmfm", fit_beamtilt=True, cpu=True)
    ctf.tabs.setCurrentIndex(1)  # the CTF tab: what is fitted
    shot("ctf_refine_1_dock")
    _run(ctf, "ctf_refine")
    shot("ctf_refine_2_result")
    print("project:", work, flush=True)


if __name__ == "__main__":
    main()
