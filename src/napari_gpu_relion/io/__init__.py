"""File I/O: MRC maps and stacks, RELION STAR tables and coordinate files, particle images, atomic writes."""

from .atomic import atomic_path, ensure_not_input
from .mrc import LazyStack, MrcData, is_stack, read_mrc, write_mrc
from .particle_images import image_locations, image_names_for, load_images, parse_image_name
from .star import (
    ParticleTable,
    read_coordinates,
    read_micrographs,
    read_particles,
    read_star,
    write_coordinates,
    write_particles,
    write_star_blocks,
)

__all__ = [
    "atomic_path",
    "ensure_not_input",
    "LazyStack",
    "MrcData",
    "is_stack",
    "read_mrc",
    "write_mrc",
    "ParticleTable",
    "image_locations",
    "image_names_for",
    "load_images",
    "parse_image_name",
    "read_coordinates",
    "read_micrographs",
    "read_particles",
    "read_star",
    "write_coordinates",
    "write_particles",
    "write_star_blocks",
]
