"""Colours and marks of the live display (no Qt, no napari), chosen for contrast on grey micrographs and for
colour-blind viewers (tests/test_widget_models.py checks them under simulated protanopia, deuteranopia and
tritanopia).

Picks are rings coloured by figure of merit from azure (low) through magenta to vermillion (high): every colour
is saturated and of middle lightness, so that rings stand out on a grey micrograph whatever its contrast (the
former "plasma" map ended in near-black purple), and none is yellow. The true positions of the sample data are
yellow crosses: another colour and another shape than any pick. Extraction boxes are white squares of the box
size: neither a pick colour nor yellow, for every kind of colour vision.
"""

from __future__ import annotations

__all__ = ["PICK_COLORS", "MANUAL_PICK_COLOR", "TRUE_PICK_COLOR", "TRUE_PICK_SYMBOL", "TRUE_PICK_SIZE_FRACTION",
           "SELECTION_COLOR", "LABEL_COLOR", "PICK_BORDER_WIDTH", "EXTRACTION_BOX_COLOR", "EXTRACTION_BOX_SYMBOL",
           "EXTRACTION_BOX_BORDER_WIDTH", "hex_to_rgb", "ramp_colours"]

#: Pick ring colours from the lowest to the highest figure of merit (interpolated in between).
PICK_COLORS = ("#00A0FF", "#FF00FF", "#D55E00")
#: Picks added by hand (no FOM): black rings, outside the FOM ramp and unlike the yellow true picks and the white
#: extraction boxes for every kind of colour vision.
MANUAL_PICK_COLOR = "#000000"
#: Relative border width of pick rings (fraction of the ring's diameter).
PICK_BORDER_WIDTH = 0.08
#: True particle positions (sample data): Okabe-Ito yellow crosses, smaller than a particle.
TRUE_PICK_COLOR = "#F0E442"
TRUE_PICK_SYMBOL = "cross"
TRUE_PICK_SIZE_FRACTION = 0.4
#: The boxes particle extraction cut, drawn on the micrographs: white squares with a thin border.
EXTRACTION_BOX_COLOR = "#FFFFFF"
EXTRACTION_BOX_SYMBOL = "square"
EXTRACTION_BOX_BORDER_WIDTH = 0.03
#: Outline of selected class tiles, and the text on the class grid.
SELECTION_COLOR = "#00FFFF"
LABEL_COLOR = "#F0E442"


def hex_to_rgb(color: str) -> tuple[float, float, float]:
    """'#RRGGBB' as (r, g, b) in [0, 1]."""
    text = color.lstrip("#")
    return tuple(int(text[i:i + 2], 16) / 255.0 for i in (0, 2, 4))  # type: ignore[return-value]


def ramp_colours(values, lo: float, hi: float, colours=PICK_COLORS):
    """(n, 4) RGBA of ``values`` on the piecewise-linear ramp through ``colours`` from ``lo`` to ``hi`` (values
    outside clipped to its ends; the ramp's middle when lo == hi)."""
    import numpy as np  # noqa: PLC0415

    v = np.asarray(values, dtype=np.float64).ravel()
    stops = np.array([hex_to_rgb(c) for c in colours])
    f = np.full(v.shape, 0.5) if not hi > lo else np.clip((v - lo) / (hi - lo), 0.0, 1.0)
    x = np.linspace(0.0, 1.0, len(stops))
    rgb = np.stack([np.interp(f, x, stops[:, c]) for c in range(3)], axis=1)
    return np.concatenate([rgb, np.ones((len(v), 1))], axis=1)
