"""Errors a user can act on. Every message says what is wrong and where (file, line, column, value)."""

from __future__ import annotations


class InputError(ValueError):
    """Bad input: a file, a column, a parameter value. Raised before any work starts where possible."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None,
                 column: str | None = None):
        where = []
        if path is not None:
            where.append(str(path))
        if line is not None:
            where.append(f"line {line}")
        if column is not None:
            where.append(f"column {column}")
        self.path, self.line, self.column = path, line, column
        super().__init__(f"{': '.join([', '.join(where), message]) if where else message}")


class JobCancelled(Exception):
    """A job stopped at a batch boundary because the user asked; files already written stay valid."""
