"""Class selection (the Select job): by class number and by the model STAR's class table."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import starfile

from napari_gpu_relion.errors import InputError
from napari_gpu_relion.io.star import write_star_blocks
from napari_gpu_relion.jobs import select


@pytest.fixture()
def classified(tmp_path) -> Path:
    """A run_it025_data.star of 30 particles in 3 classes (10 each, two optics groups) and its model STAR."""
    n = 30
    optics = pd.DataFrame({"rlnOpticsGroupName": ["g1", "g2"], "rlnOpticsGroup": [1, 2], "rlnVoltage": [300.0] * 2,
                           "rlnSphericalAberration": [2.7] * 2, "rlnAmplitudeContrast": [0.1] * 2,
                           "rlnImagePixelSize": [2.0] * 2, "rlnImageSize": [32] * 2, "rlnImageDimensionality": [2] * 2})
    parts = pd.DataFrame({"rlnImageName": [f"{i + 1:06d}@p.mrcs" for i in range(n)],
                          "rlnOpticsGroup": np.arange(n) % 2 + 1, "rlnClassNumber": np.arange(n) % 3 + 1,
                          "rlnAngleRot": np.linspace(-90, 90, n)})
    d = tmp_path / "run_it025_data.star"
    write_star_blocks(d, {"optics": optics, "particles": parts})
    write_star_blocks(tmp_path / "run_it025_model.star", {
        "model_general": {"rlnNrClasses": 3},
        "model_classes": pd.DataFrame({"rlnReferenceImage": ["a", "b", "c"],
                                       "rlnClassDistribution": [0.5, 0.1, 0.4],
                                       "rlnEstimatedResolution": [8.0, 20.0, 12.0]})})
    return d


def _run(**kw):
    return [e for e in select.run(select.Params(**kw))][-1]


def test_select_by_class_numbers_keeps_rows_and_optics(classified, tmp_path):
    fin = _run(i=classified, o=tmp_path / "sel.star", classes="1,3")
    out = starfile.read(tmp_path / "sel.star")
    p = out["particles"]
    assert len(p) == 20 and set(p["rlnClassNumber"]) == {1, 3}
    src = starfile.read(classified)["particles"]
    keep = src[src["rlnClassNumber"].isin([1, 3])].reset_index(drop=True)
    np.testing.assert_array_equal(p["rlnImageName"], keep["rlnImageName"])
    np.testing.assert_allclose(p["rlnAngleRot"], keep["rlnAngleRot"])
    assert len(out["optics"]) == 2
    assert "kept 20 of 30" in fin.summary


def test_select_by_model_thresholds(classified, tmp_path):
    _run(i=classified, o=tmp_path / "a.star", min_class_distribution=0.3)  # classes 1 and 3
    assert set(starfile.read(tmp_path / "a.star")["particles"]["rlnClassNumber"]) == {1, 3}
    _run(i=classified, o=tmp_path / "b.star", min_class_distribution=0.3, max_class_resolution=10.0)  # class 1
    assert set(starfile.read(tmp_path / "b.star")["particles"]["rlnClassNumber"]) == {1}
    _run(i=classified, o=tmp_path / "c.star", classes="2,3", max_class_resolution=15.0)  # 3 only
    assert set(starfile.read(tmp_path / "c.star")["particles"]["rlnClassNumber"]) == {3}


def test_select_bad_input(classified, tmp_path):
    with pytest.raises(InputError, match="bad entry 'x'"):
        select.Params(i=classified, o=tmp_path / "s.star", classes="1,x")
    with pytest.raises(InputError, match="--classes 7 not among the classes"):
        _run(i=classified, o=tmp_path / "s.star", classes="1,7")
    other = tmp_path / "particles.star"
    other.write_text(classified.read_text())
    with pytest.raises(InputError, match="give --model"):
        _run(i=other, o=tmp_path / "s.star", min_class_distribution=0.2)
    assert not (tmp_path / "s.star").exists()
