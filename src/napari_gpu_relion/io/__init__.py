"""File I/O: MRC maps and stacks, RELION STAR tables and coordinate files, particle images, atomic writes."""

import importlib

#: Where each name lives: the package imports a module at the first use of one of its names (PEP 562), so that
#: ``from napari_gpu_relion.io.mrc import ...`` does not pay for pandas (the command line's start-up).
_WHERE = {
    "atomic_path": "atomic", "ensure_not_input": "atomic",
    "LazyStack": "mrc", "MrcData": "mrc", "is_stack": "mrc", "read_mrc": "mrc", "write_mrc": "mrc",
    "image_locations": "particle_images", "image_names_for": "particle_images", "load_images": "particle_images",
    "parse_image_name": "particle_images",
    "ParticleTable": "star", "read_coordinates": "star", "read_micrographs": "star", "read_particles": "star",
    "read_star": "star", "write_coordinates": "star", "write_particles": "star", "write_star_blocks": "star",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
