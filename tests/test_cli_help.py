"""``napari-gpu-relion --help`` and ``napari-gpu-relion <job> --help`` for every job the CLI's own parser
knows: exit status 0 and every flag of the job (from its Params) in the help text. In-process, no GPU."""

from __future__ import annotations

import argparse
import importlib
from dataclasses import fields

import pytest

from napari_gpu_relion import cli
from napari_gpu_relion.jobs.common import flag_of


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


JOBS = sorted(_subparsers())


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    out, err = capsys.readouterr()
    assert exc.value.code in (0, None), f"napari-gpu-relion {' '.join(argv)} exited {exc.value.code}: {err}"
    return out


def test_parser_knows_every_job():
    assert JOBS and set(JOBS) == set(cli.JOBS)


def test_top_level_help_lists_every_job(capsys):
    out = _help(["--help"], capsys)
    assert out.startswith("usage: napari-gpu-relion")
    assert "--verbose" in out
    for job in JOBS:
        assert job in out, f"{job} missing from the top-level --help"


@pytest.mark.parametrize("job", JOBS)
def test_job_help_shows_its_flags(job, capsys):
    out = _help([job, "--help"], capsys)
    assert out.startswith(f"usage: napari-gpu-relion {job}")
    parser_flags = {s for a in _subparsers()[job]._actions for s in a.option_strings}
    params_flags = {flag_of(f) for f in fields(importlib.import_module(cli.JOBS[job][0]).Params)}
    assert params_flags <= parser_flags, f"Params flags the parser lacks: {params_flags - parser_flags}"
    words = set(out.replace(",", " ").split())
    missing = sorted(parser_flags - words)
    assert not missing, f"napari-gpu-relion {job} --help lacks {missing}"
    assert {"--o", "--odir"} & params_flags, f"{job} has no output flag"  # every job writes somewhere
    for flag in ("--i", "--o"):
        if flag in params_flags:
            assert flag in words
