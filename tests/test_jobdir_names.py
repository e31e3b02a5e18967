"""io/jobdir.py reads RELION's run-file and job-folder names (what the Jobs and follow models of the widgets list):
real names of relion_refine-style jobs, continued runs, final auto-refine files and job folders."""

from pathlib import Path

import pytest

from napari_gpu_relion.io.jobdir import (
    IterationFile,
    RunFiles,
    final_model_root,
    iteration_data,
    iteration_model,
    job_number,
)


@pytest.mark.parametrize(("name", "expected"), [
    ("Class2D/job005/run_it025_model.star", IterationFile("run", 25)),
    ("run_it025_model.star", IterationFile("run", 25)),
    ("Refine3D/job012/run_it007_half1_model.star", IterationFile("run", 7, 1)),
    ("run_it007_half2_model.star", IterationFile("run", 7, 2)),
    ("run_ct3_it010_model.star", IterationFile("run_ct3", 10)),  # continued from iteration 3
    ("run_ct3_it010_half2_model.star", IterationFile("run_ct3", 10, 2)),
    ("run_it1000_model.star", IterationFile("run", 1000)),
    (Path("Class3D/job020/run_it000_model.star"), IterationFile("run", 0)),
])
def test_iteration_model_reads_the_names_of_iteration_model_stars(name, expected):
    assert iteration_model(name) == expected


@pytest.mark.parametrize("name", [
    "run_model.star", "run_half1_model.star", "run_it025_data.star", "run_it025_optimiser.star",
    "run_it025_half3_model.star", "run_it25_model.star", "run_it025_classes.mrcs", "run_half1_class001_unfil.mrc",
    "postprocess.star", "Class2D/job005",
])
def test_iteration_model_is_none_for_other_names(name):
    assert iteration_model(name) is None


@pytest.mark.parametrize(("name", "expected"), [
    ("Class2D/job005/run_it025_data.star", IterationFile("run", 25)),
    ("run_ct3_it010_data.star", IterationFile("run_ct3", 10)),
    ("run_it000_data.star", IterationFile("run", 0)),
])
def test_iteration_data_reads_the_names_of_iteration_data_stars(name, expected):
    assert iteration_data(name) == expected


@pytest.mark.parametrize("name", ["run_data.star", "run_it025_model.star", "run_it025_half1_data.star",
                                  "run_half1_class001_unfil.mrc", "particles.star"])
def test_iteration_data_is_none_for_other_names(name):
    assert iteration_data(name) is None


def test_final_model_root():
    assert final_model_root("Refine3D/job012/run_model.star") == "run"
    assert final_model_root("run_ct3_model.star") == "run_ct3"
    assert final_model_root("run_half1_model.star") == "run_half1"  # its maps are run_half1_class001.mrc: none
    for name in ("Class2D/job005/run_it025_model.star", "run_it025_half1_model.star", "run_ct3_it010_model.star",
                 "run_data.star", "run_half1_class001_unfil.mrc", "_model.star", "postprocess.star"):
        assert final_model_root(name) is None, name


def test_job_number():
    assert job_number("job005") == 5
    assert job_number(Path("Class2D/job005")) == 5
    assert job_number("/project/Refine3D/job1234") == 1234
    for name in ("job", "Job005", "job005a", "job_005", "Class2D", "run_it025_model.star", "Class2D/job005/run"):
        assert job_number(name) is None, name


def test_the_names_runfiles_writes_read_back():
    files = RunFiles(Path("Refine3D/job012/run"))
    assert iteration_model(files.model(25)) == IterationFile("run", 25)
    assert iteration_model(files.model(25, half=2)) == IterationFile("run", 25, 2)
    assert iteration_data(files.data(25)) == IterationFile("run", 25)
    assert final_model_root(files.model()) == "run"
    assert iteration_model(files.model()) is None and iteration_data(files.data()) is None
    assert iteration_model(files.unfiltered_half_map(1)) is None
    assert files.unfiltered_half_map(1).name == "run_half1_class001_unfil.mrc"
    assert job_number(files.folder) == 12


def test_note_commands_read_ours_and_relions_and_skip_comments(tmp_path):
    from napari_gpu_relion.io.jobdir import NoteCommand, note_commands

    (tmp_path / "note.txt").write_text(
        "++++ with the following command(s):\n"
        "napari-gpu-relion class2d --i 'a b/p.star' --o Class2D/job005/run --K 4 --ctf\n"
        "# invoked as: napari-gpu-relion class2d --i x\n"
        "mpirun -n 3 `which relion_refine_mpi` --o Refine3D/job007/run --auto_refine\n"
        "other_tool --o somewhere\n")
    assert note_commands(tmp_path) == [
        NoteCommand("class2d", {"--i": "a b/p.star", "--o": "Class2D/job005/run", "--K": "4", "--ctf": ""}),
        NoteCommand("relion_refine", {"--o": "Refine3D/job007/run", "--auto_refine": ""}),
        NoteCommand(None, {"--o": "somewhere"})]
    assert note_commands(tmp_path / "missing") == []
