"""Screenshots for docs/tutorial.md, taken from the running application (napari with the plugin's dock widgets,
jobs started from the widgets on the sample data, CPU). Run with a display or under Xvfb:

    xvfb-run -a python docs/screenshots.py [--out docs/images]

Each step docks a widget, fills it as the tutorial says, clicks Run, waits for the job and saves a screenshot of
the whole window (widgets and live display).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import napari
from qtpy.QtWidgets import QApplication

from napari_gpu_relion.jobs.simulate import sample_data_dir
from napari_gpu_relion.widgets.display import LiveDisplay

PLUGIN = "napari-gpu-relion"


def _run_and_wait(widget, timeout_s: float = 900.0) -> None:
    widget.run_button.native.click()
    t0 = time.time()
    while widget.job is None or not widget.job.done:
        QApplication.processEvents()
        time.sleep(0.05)
        if time.time() - t0 > timeout_s:
            raise TimeoutError(widget.job_name)
    for _ in range(20):
        QApplication.processEvents()
        time.sleep(0.05)


def _shot(viewer, path: Path) -> None:
    LiveDisplay.for_viewer(viewer).flush()
    for _ in range(10):
        QApplication.processEvents()
    viewer.screenshot(str(path), canvas_only=False, flash=False)
    print("wrote", path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).parent / "images"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(sample_data_dir())
    work = Path(tempfile.mkdtemp(prefix="tutorial_"))

    viewer = napari.Viewer(show=True)
    viewer.window._qt_window.resize(1500, 950)
    # 1. pick the sample micrographs
    viewer.open_sample(PLUGIN, "micrographs")
    _, pick = viewer.window.add_plugin_dock_widget(PLUGIN, "Auto-picking")
    pick.set_values(i=data / "micrographs.star", odir=work / "AutoPick", LoG=True, LoG_diam_min=120.0,
                    LoG_diam_max=180.0, LoG_adjust_threshold=3.0, LoG_robust_stats=True, cpu=True)
    _run_and_wait(pick)
    _shot(viewer, out / "tutorial_1_autopick.png")
    # 2. 2D classification of the sample particles
    viewer.layers.clear()
    viewer.window.remove_dock_widget("all")
    _, c2 = viewer.window.add_plugin_dock_widget(PLUGIN, "2D classification")
    c2.set_values(i=data / "particles.star", o=work / "Class2D", K=6, iter=10, ctf=True, particle_diameter=160.0,
                  flatten_solvent=True, zero_mask=True, center_classes=True, cpu=True)
    _run_and_wait(c2)
    viewer.reset_view()
    _shot(viewer, out / "tutorial_2_class2d.png")
    # 3. 3D auto-refine from the 60 Å reference
    viewer.layers.clear()
    viewer.window.remove_dock_widget("all")
    _, r3 = viewer.window.add_plugin_dock_widget(PLUGIN, "3D auto-refine")
    r3.set_values(i=data / "particles.star", ref=data / "reference.mrc", o=work / "Refine3D", ctf=True,
                  flatten_solvent=True, particle_diameter=160.0, healpix_order=1, auto_local_healpix_order=3,
                  cpu=True)
    _run_and_wait(r3, timeout_s=1800)
    _shot(viewer, out / "tutorial_3_refine3d.png")
    viewer.close()


if __name__ == "__main__":
    main()
