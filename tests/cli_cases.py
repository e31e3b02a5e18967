"""Running the command line in a test the way a user meets it: the exit code, what it printed, and for a refused
input its one stderr line (shared by the bad-input catalogues, tests/test_bad_input*.py)."""

from __future__ import annotations

from napari_gpu_relion import cli


def run_cli(capsys, argv: list) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``napari-gpu-relion argv`` (argparse's exits included)."""
    capsys.readouterr()  # what the test itself printed (e.g. mrcfile's warning on writing a NaN map) is not ours
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def fails(capsys, argv: list, *names: str) -> str:
    """``argv`` fails with exit code 2 and one stderr "error:" line, without a traceback, naming ``names``;
    returns that line."""
    code, out, err = run_cli(capsys, argv)
    assert code == 2, (code, out, err)
    assert "Traceback" not in err + out, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error:" in lines[0], err
    for name in names:
        assert str(name) in lines[0], (name, lines[0])
    return lines[0]
