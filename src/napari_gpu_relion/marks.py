"""Named marks of a job's steps, for whoever listens (the memory trace of ``runtime.memory``): compute and jobs
call :func:`memory_mark` at the end of a step; with no listener a mark costs one global lookup."""

from __future__ import annotations

from collections.abc import Callable

_hook: Callable[[str], None] | None = None


def memory_mark(label: str) -> None:
    """End of a named step (nothing when no one listens)."""
    if _hook is not None:
        _hook(label)


def set_mark_hook(hook: Callable[[str], None] | None) -> Callable[[str], None] | None:
    """Make ``hook`` the listener of every mark (None: none); returns the previous one."""
    global _hook
    previous, _hook = _hook, hook
    return previous
