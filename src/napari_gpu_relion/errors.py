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


def os_error_line(exc: OSError) -> str:
    """One line for an operating-system error (read-only folder, a file where a folder should be, disk full,
    ...): what went wrong and the path(s) it concerns, without Python's ``[Errno N]`` prefix."""
    what = exc.strerror or str(exc) or type(exc).__name__
    paths = [str(q) for q in (exc.filename, exc.filename2) if q is not None]
    return f"{what}: {' -> '.join(paths)}" if paths else what


def user_error_line(exc: BaseException) -> str | None:
    """The one line a user reads for an error they can act on (bad input or bad surroundings): the message of an
    InputError, :func:`os_error_line` of an OSError; None for anything else (a bug: keep its traceback).
    The command line and the widgets' error notifications both show this line."""
    if isinstance(exc, InputError):
        text = str(exc)
    elif isinstance(exc, OSError):
        text = os_error_line(exc)
    else:
        return None
    return " ".join(text.splitlines())  # a message quoting a tool's multi-line text still prints as one line


class SumsAlreadyAddedError(RuntimeError):
    """Memory ran out after an E-step batch had added part of its sums: the batch cannot be run again with fewer
    particles (its first part would count twice), so the job stops with this line instead of a wrong result."""


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a GPU or host out-of-memory error (CuPy's OutOfMemoryError is a MemoryError), not for
    SumsAlreadyAddedError (which must not be retried)."""
    if isinstance(exc, SumsAlreadyAddedError):
        return False
    if isinstance(exc, MemoryError):
        return True
    return type(exc).__name__ in ("OutOfMemoryError", "CUFFT_ALLOC_FAILED") or "out of memory" in str(exc).lower()
