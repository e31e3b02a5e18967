"""A CuPy kernel module as a manifest entry: its source, compile options and keyword arguments, written down so
that another process can compile or load the same module (runtime/kernel_preload.py records and loads them,
runtime/cupy_kernels.py compiles the shipped ones). CuPy's header source, the same for every kernel, stands as
HEADERS in an entry."""

from __future__ import annotations

import json
from pathlib import Path

HEADERS = "<cupy headers>"  # stands for CuPy's header source in a manifest (the same for every kernel)
_state: dict = {"headers": None}


def header_source(cupy) -> str | None:
    """CuPy's header source (read once; None with a CuPy that has none where this looks)."""
    if _state["headers"] is None:
        try:
            _state["headers"] = cupy._core.core._get_header_source()
        except Exception:  # noqa: BLE001 - another CuPy: entries with headers are then not recorded
            _state["headers"] = ""
    return _state["headers"] or None


def plain(v) -> bool:
    return v is None or isinstance(v, bool | int | str) or (isinstance(v, tuple | list) and
                                                             all(isinstance(x, str) for x in v))


def entry(source, options, kw: dict, headers: str | None) -> dict | None:
    """The manifest entry of one compile call, or None when it cannot be written down (a log stream, an
    unknown argument, headers other than CuPy's)."""
    if not isinstance(source, str) or not plain(options):
        return None
    out = {}
    for k, v in kw.items():
        if k == "extra_source" and v is not None:
            if headers is None or not (v is headers or v == headers):
                return None
            v = HEADERS
        elif not plain(v):
            return None
        out[k] = list(v) if isinstance(v, tuple) else v
    return {"source": source, "options": list(options), "kw": out}


def read_manifest(path: Path) -> list[dict]:
    """The well-formed entries of a manifest ([] when it is missing or unreadable)."""
    try:
        modules = json.loads(path.read_text())["modules"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if not isinstance(modules, list):
        return []
    return [e for e in modules if isinstance(e, dict) and isinstance(e.get("source"), str)
            and isinstance(e.get("options"), list) and isinstance(e.get("kw"), dict)]


def key(e: dict) -> str:
    """One string per distinct module (source, options, keyword arguments)."""
    return json.dumps([e["source"], e["options"], sorted(e["kw"].items())])


def call_args(e: dict, headers: str | None) -> tuple[str, tuple, dict]:
    """(source, options, keyword arguments) of CuPy's compile call for entry ``e``."""
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in e["kw"].items()}
    if kw.get("extra_source") == HEADERS:
        kw["extra_source"] = headers
    return e["source"], tuple(e["options"]), kw
