"""Mask creation (relion_mask_create): low-pass, threshold, extend, soft edge."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..compute.masks import create_mask
from ..errors import InputError
from ..events import Finished, MapUpdated, Started
from ..io.atomic import ensure_not_input
from ..io.mrc import read_mrc, require_usable_map, write_mrc
from .common import check_output_file, check_pixel_size, mrc_bytes, param, prepare_output, require_file, write_note

JOB_NAME = "mask_create"


@dataclass(frozen=True)
class Params:
    i: Path = param(flag="--i", help="Input map")
    o: Path = param(flag="--o", help="Output mask (.mrc)")
    ini_threshold: float = param(0.01, "--ini_threshold", "Initial binarisation threshold (map units)")
    extend_inimask: float = param(0.0, "--extend_inimask", "Extend (or shrink, if negative) the binary mask (px)")
    width_soft_edge: float = param(0.0, "--width_soft_edge", "Width of the raised-cosine soft edge (px)")
    lowpass: float = param(0.0, "--lowpass", "Low-pass the map before thresholding (Å); 0 = off")
    angpix: float = param(-1.0, "--angpix", "Pixel size (Å); -1 = from the map header")

    def __post_init__(self):
        require_file(self.i, "--i map", (".mrc", ".map"))
        if self.o is None or Path(self.o).suffix.lower() not in (".mrc", ".map"):
            raise InputError(f"--o must be an .mrc file, got '{self.o}'")
        ensure_not_input(self.o, self.i)
        check_output_file(self.o, "--o")
        check_pixel_size(self.angpix, "--angpix", "the map header")
        if self.width_soft_edge < 0:
            raise InputError(f"--width_soft_edge must be >= 0, got {self.width_soft_edge}")
        if self.lowpass < 0:
            raise InputError(f"--lowpass must be a resolution in Å (> 0), or 0 for none; got {self.lowpass:g}")


def run(p: Params) -> Iterator:
    m = read_mrc(p.i)
    vol = np.asarray(m.data, np.float32)
    if vol.ndim != 3:
        raise InputError(f"expected a 3D map, got shape {vol.shape}", path=str(p.i))
    require_usable_map(vol, p.i, "map")
    apix = p.angpix if p.angpix > 0 else (m.pixel_size or 0)
    if p.lowpass > 0 and not apix:
        raise InputError("--lowpass needs a pixel size: the header has none, give --angpix", path=str(p.i))
    out = Path(p.o)
    notes = prepare_output(out.parent, mrc_bytes(*vol.shape), "the mask")
    yield Started(JOB_NAME, out.parent, "CPU (NumPy + SciPy)", f"mask from {p.i}")
    yield from notes
    write_note(out.parent, JOB_NAME, p)
    mask = create_mask(vol, apix or 1.0, p.ini_threshold, p.extend_inimask, p.width_soft_edge,
                       p.lowpass if p.lowpass > 0 else None)
    write_mrc(out, mask, apix or None)
    yield MapUpdated(out.stem, mask, apix or 1.0, out)
    frac = float((mask > 0.5).mean())
    yield Finished({"mask": out}, f"wrote {out}: {100 * frac:.1f}% of the box inside (mask > 0.5)")
