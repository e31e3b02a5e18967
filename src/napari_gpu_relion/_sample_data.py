"""Sample data entries (File > Open Sample > GPU RELION): micrographs with their true picks, the particle
stack, the reference map. The files come from :func:`napari_gpu_relion.jobs.simulate.sample_data_dir`
(the repository's sample_data/ folder, or a copy simulated once into the user's cache)."""

from __future__ import annotations

from pathlib import Path

from . import _reader
from .errors import InputError
from .io.star import read_particles
from .jobs.simulate import sample_data_dir
from .widgets.layers import DEFAULT_POINT_SIZE
from .widgets.style import TRUE_PICK_COLOR, TRUE_PICK_SIZE_FRACTION, TRUE_PICK_SYMBOL

__all__ = ["sample_micrographs", "sample_particles", "sample_reference", "sample_dir"]


def sample_dir() -> Path:
    return Path(sample_data_dir())


def _particles_star(root: Path) -> Path:
    for cand in (root / "particles" / "particles.star", root / "particles.star"):
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"no particles STAR in the sample data folder {root}")


def _box_size(root: Path) -> float | None:
    """Particle box (pixels) of the sample set, used as the size of the pick markers."""
    try:
        return float(read_particles(_particles_star(root)).box_size)
    except (InputError, FileNotFoundError):
        return None


def sample_micrographs() -> list[_reader.LayerData]:
    """The simulated micrographs as one stack (mic, y, x) and their true particle positions as Points."""
    root = sample_dir()
    star = root / "micrographs.star"
    files, pixel_size, _ = _reader.micrographs_table(star)
    image = _reader.micrographs_layer(files, pixel_size, "micrographs", {"path": str(star)})
    coord_files = []
    for f in files:
        cand = root / "coords" / f"{f.stem}_truth.star"
        coord_files.append(cand if cand.is_file() else None)
    box = _box_size(root)
    picks = _reader.picks_over_stack(coord_files, pixel_size, "true picks", size=box)
    picks[1]["metadata"]["micrograph_names"] = [str(f) for f in files]
    # small yellow crosses: another shape and colour than the job's pick rings (widgets/style.py)
    picks[1].update(symbol=TRUE_PICK_SYMBOL, face_color=TRUE_PICK_COLOR, border_color=TRUE_PICK_COLOR,
                    border_width=0.0, size=(box or DEFAULT_POINT_SIZE) * TRUE_PICK_SIZE_FRACTION)
    return [image, picks]


def sample_particles() -> list[_reader.LayerData]:
    """The simulated particle images (n, y, x), first 1000 at most."""
    return [_reader.particles_layer(_particles_star(sample_dir()))]


def sample_reference() -> list[_reader.LayerData]:
    """The reference map (the truth low-passed), for iso-surface display in 3D."""
    return [_reader.map_layer(sample_dir() / "reference.mrc", name="reference")]
