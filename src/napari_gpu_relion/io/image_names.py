"""RELION's particle image names, ``<n>@<stack>``: what the STAR reader (box size of RELION 3.0 tables) and the
particle image reader (particle_images.py) both parse, so that neither imports the other for it."""

from __future__ import annotations

from ..errors import InputError

__all__ = ["parse_image_name"]


def parse_image_name(name: str) -> tuple[int, str]:
    """``'000012@Particles/mic1.mrcs'`` -> ``(11, 'Particles/mic1.mrcs')`` (0-based index, stack path).

    The number may have any width; it counts from 1. InputError for anything else.
    """
    text = str(name).strip()
    number, at, stack = text.partition("@")
    if not at:
        raise InputError(f"image name {text!r} has no '@' (expected <number>@<stack file>)",
                         column="rlnImageName")
    if not number.isdigit():
        raise InputError(f"image name {text!r}: {number!r} before '@' is not a whole number",
                         column="rlnImageName")
    if not stack or any(ch.isspace() for ch in stack):
        raise InputError(f"image name {text!r} has no valid stack file after '@'", column="rlnImageName")
    index = int(number)
    if index < 1:
        raise InputError(f"image name {text!r}: image numbers count from 1, got {index}",
                         column="rlnImageName")
    return index - 1, stack
