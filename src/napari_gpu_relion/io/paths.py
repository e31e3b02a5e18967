"""File-name conventions that need no file library (light to import: the command line's start-up uses them)."""

from __future__ import annotations

import os


def is_star_path(path: str | os.PathLike) -> bool:
    """Whether a file name is a STAR file's: name.star, or name.star.gz (read gzip-compressed: read_star)."""
    return str(path).lower().endswith((".star", ".star.gz"))
