"""Shared fixtures of the widget tests: a private settings folder per test (no runner left busy), and the
error messages the widgets show.

Without a display the viewer tests are skipped, not run: Qt aborts the whole process (not just the test)
when it cannot connect to an X server, so on a Linux machine with neither a desktop nor Xvfb (which
pytest-xvfb starts when it is on PATH) every test that asks for a napari viewer or a QApplication is
skipped at collection with one reason saying what to install. Importing the test modules is safe: they
import Qt but create nothing.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest

# Fixtures that create a QApplication (directly or through a napari viewer); item.fixturenames holds the
# closure, so a test using a fixture built on these is caught too.
_QT_FIXTURES = frozenset({"qapp", "qtbot", "qtmodeltester", "make_napari_viewer", "make_napari_viewer_proxy"})


def _no_display_reason() -> str | None:
    """Why Qt cannot open a window here, or None where it can. Checked after pytest-xvfb's configure hook,
    which sets DISPLAY once it has started Xvfb."""
    if not sys.platform.startswith(("linux", "freebsd", "openbsd", "netbsd")):
        return None  # macOS and Windows need no X server
    if os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"):
        return None
    if os.environ.get("QT_QPA_PLATFORM", "xcb").split(":")[0] not in ("xcb", "wayland", ""):
        return None  # offscreen, minimal, ...: Qt needs no display server
    if shutil.which("Xvfb") is None:
        return "no X display and no Xvfb: apt-get install xvfb (or run on a desktop) to run the {n} viewer tests"
    return ("no X display and Xvfb not started (pytest-xvfb missing or disabled): install the [test] extra "
            "and drop --no-xvfb (or run on a desktop) to run the {n} viewer tests")


@pytest.hookimpl(trylast=True)  # after -m/-k deselection, so {n} counts the tests that would have run
def pytest_collection_modifyitems(config, items):
    reason = _no_display_reason()
    if reason is None:
        return
    needs_qt = [item for item in items if _QT_FIXTURES.intersection(getattr(item, "fixturenames", ()))]
    mark = pytest.mark.skip(reason=reason.format(n=len(needs_qt)))
    for item in needs_qt:
        item.add_marker(mark)


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    """NAPARI_GPU_RELION_CONFIG_DIR in the test's folder (widget settings are remembered there); afterwards
    every job runner is closed and none may still be busy."""
    from napari_gpu_relion.widgets import runner as rn

    cfg = tmp_path / "config"
    monkeypatch.setenv("NAPARI_GPU_RELION_CONFIG_DIR", str(cfg))
    yield cfg
    rn.close_all_runners(timeout=10)
    for runner in rn._runners.values():
        assert not runner.busy


@pytest.fixture
def session():
    """The Jobs dock's session of jobs (widgets/jobs_model.SESSION), empty before and after the test."""
    from napari_gpu_relion.widgets import jobs_model as jm  # noqa: PLC0415 - a Qt-free model

    jm.SESSION.clear()
    yield jm.SESSION
    jm.SESSION.clear()


@pytest.fixture
def errors(monkeypatch):
    """Messages passed to show_error (by the runner and by the widgets)."""
    from napari_gpu_relion.widgets import job_widget as jw
    from napari_gpu_relion.widgets import runner as rn

    seen: list[str] = []
    monkeypatch.setattr(rn, "show_error", lambda msg: seen.append(str(msg)))
    monkeypatch.setattr(jw, "show_error", lambda msg: seen.append(str(msg)))
    return seen


@pytest.fixture
def data(sample, tmp_path):
    """A copy of the test module's ``sample`` data set (its own fixture) that a test may change or write into."""
    return shutil.copytree(sample, tmp_path / "d")
