"""Shared fixtures of the widget tests: a private settings folder per test (no runner left busy), and the
error messages the widgets show."""

import pytest


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
def errors(monkeypatch):
    """Messages passed to show_error (by the runner and by the widgets)."""
    from napari_gpu_relion.widgets import job_widget as jw
    from napari_gpu_relion.widgets import runner as rn

    seen: list[str] = []
    monkeypatch.setattr(rn, "show_error", lambda msg: seen.append(str(msg)))
    monkeypatch.setattr(jw, "show_error", lambda msg: seen.append(str(msg)))
    return seen
