"""float32 back-projection accumulators against float64 (issue 21; benchmarks/accumulator_precision.py measures
the same at 2,000 and 20,000 particles and benchmarks/README.md has the numbers): the error float32 adds to a
reconstruction, with every add rounded as the GPU's atomic float32 adds do, stays orders of magnitude below
anything the FSC can see."""

import importlib.util
from pathlib import Path

import numpy as np

_path = Path(__file__).resolve().parents[1] / "benchmarks" / "accumulator_precision.py"
_spec = importlib.util.spec_from_file_location("accumulator_precision", _path)
accumulator_precision = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(accumulator_precision)


def test_float32_accumulators_add_an_error_far_below_the_fsc():
    r = accumulator_precision.compare(n=600, box=24, pixel_size=4.0)
    cases = r["cases"]
    assert cases["float64 (reverse order)"]["relative_error_vs_float64"] < 1e-13  # float64's own rounding
    chunk, every = cases["float32 (chunk sums)"], cases["float32 (every add rounded)"]
    # chunk sums rounded once into float32: about float32's epsilon; every add rounded: a few epsilons more
    assert 1e-9 < chunk["relative_error_vs_float64"] < 1e-6
    assert chunk["relative_error_vs_float64"] < every["relative_error_vs_float64"] < 1e-5
    for c in (chunk, every):
        assert c["one_minus_min_fsc_vs_float64"] < 1e-10
        assert c["max_change_of_fsc_vs_truth"] < 1e-6
    assert np.isfinite(r["float32_output_rounding_relative"])
