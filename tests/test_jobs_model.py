"""The jobs panel's model (widgets/jobs_model.py, no Qt): a project's job folders with their status, last iteration
and outputs, read from the files; the jobs of this session from the runner's Job; which next job takes which
output, with a new job folder numbered as RELION does."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from relion_files import class2d_iteration, refine_iteration

from napari_gpu_relion.events import Finished, IterationFinished
from napari_gpu_relion.widgets import jobs_model as jm


def _project(tmp_path: Path) -> Path:
    p = tmp_path / "project"
    pick = p / "AutoPick" / "job001"
    pick.mkdir(parents=True)
    (pick / "autopick.star").write_text("data_coordinate_files\nloop_\n_rlnMicrographName\n_rlnMicrographCoordinates\n")
    (pick / "note.txt").write_text("++++ with the following command(s):\nnapari-gpu-relion autopick --i "
                                   "Import/micrographs.star --odir AutoPick/job001 --LoG\n")
    ext = p / "Extract" / "job002"
    ext.mkdir(parents=True)
    (ext / "particles.star").write_text("x")
    for it in (1, 2):
        class2d_iteration(p, "Class2D/job003", it, np.zeros((2, 8, 8), np.float32), [0.5, 0.5])
        (p / "Class2D" / "job003" / f"run_it{it:03d}_data.star").write_text("x")
    (p / "Class2D" / "job003" / "note.txt").write_text(
        " ++++ Executing new job on Mon\n ++++ with the following command(s): \n`which relion_refine` --o "
        "Class2D/job003/run --iter 2 --i Extract/job002/particles.star --K 2\n ++++ \n")
    refine_iteration(p, "Refine3D/job005", 1, (np.ones((8, 8, 8)), np.ones((8, 8, 8))), np.ones(5))
    (p / "Refine3D" / "job005" / "RELION_JOB_EXIT_FAILURE").write_text("")
    ref = p / "Refine3D" / "job007"
    ref.mkdir(parents=True)
    for name in ("run_model.star", "run_class001.mrc", "run_half1_class001_unfil.mrc", "run_data.star"):
        (ref / name).write_text("x")
    (ref / "RELION_JOB_EXIT_SUCCESS").write_text("")
    return p


def test_project_jobs_from_disk(tmp_path):
    p = _project(tmp_path)
    records = jm.scan_project(p)
    assert [(r.job_type, r.number) for r in records] == [("AutoPick", 1), ("Extract", 2), ("Class2D", 3),
                                                         ("Refine3D", 5), ("Refine3D", 7)]
    by = {r.number: r for r in records}
    assert by[1].status == "finished" and by[1].display_folder(p) == "AutoPick/job001"
    assert {o.kind: o.path for o in by[1].outputs} == {jm.COORDINATES: p / "AutoPick/job001/autopick.star",
                                                       jm.MICROGRAPHS: p / "Import/micrographs.star"}
    assert by[3].iteration == 2 and by[3].status == "finished"  # --iter 2 of RELION's note reached
    assert [o.path.name for o in by[3].outputs if o.kind == jm.CLASSIFIED] == ["run_it002_data.star"]
    assert by[5].status == "failed" and by[5].iteration == 1
    assert by[7].status == "finished"
    assert {o.kind for o in by[7].outputs} == {jm.HALF_MAP, jm.MAP, jm.PARTICLES, jm.REFINED}
    # a job without an exit file and without its final output: running while its files change
    assert jm.scan_job_folder(p / "Refine3D/job005", now=time.time()).status == "failed"
    (p / "Refine3D/job005/RELION_JOB_EXIT_FAILURE").unlink()
    assert jm.scan_job_folder(p / "Refine3D/job005", now=time.time()).status == "running"
    assert jm.scan_job_folder(p / "Refine3D/job005", now=time.time() + 2 * jm.RUNNING_WINDOW).status == "unknown"


def test_offers_chain_outputs_into_the_next_jobs(tmp_path):
    p = _project(tmp_path)
    by = {r.number: r for r in jm.scan_project(p)}
    (extract,) = [o for o in jm.offers(by[1], p) if o.job == "extract" and o.output.kind == jm.COORDINATES]
    assert extract.values == {"coord_list": str(p / "AutoPick/job001/autopick.star"),
                              "i": str(p / "Import/micrographs.star"), "o": str(p / "Extract/job008")}
    select = [o for o in jm.offers(by[3], p) if o.job == "select"]
    assert select[0].values == {"i": str(p / "Class2D/job003/run_it002_data.star"),
                                "o": str(p / "Select/job008/particles.star")}
    post = [o for o in jm.offers(by[7], p) if o.job == "postprocess"]
    assert post[0].values["i"] == str(p / "Refine3D/job007/run_half1_class001_unfil.mrc")
    assert {o.job for o in jm.offers(by[7], p)} == {"postprocess", "refine3d", "class3d", "mask_create",
                                                    "class2d", "reconstruct", "initial_model", "ctf_refine"}
    # a 3D initial model's final map is the next refinement's reference
    im = p / "InitialModel" / "job009"
    im.mkdir(parents=True)
    for name in ("run_it010_model.star", "run_it010_class001.mrc", "run_class001.mrc"):
        (im / name).write_text("x")
    rec = jm.scan_job_folder(im, now=time.time())
    assert rec.job == "initial_model" and rec.status == "finished"
    (ref,) = [o for o in jm.offers(rec, p) if o.job == "refine3d"]
    assert ref.values["ref"] == str(im / "run_class001.mrc") and ref.values["o"] == str(p / "Refine3D/job010")
    # with a symmetry, the map on the symmetry axes comes first
    (im / "initial_model.mrc").write_text("x")
    refs = [o for o in jm.offers(jm.scan_job_folder(im, now=time.time()), p) if o.job == "refine3d"]
    assert [o.values["ref"] for o in refs] == [str(im / "initial_model.mrc"), str(im / "run_class001.mrc")]
    assert jm.next_job_folder(p, "class2d", taken=[p / "Select/job011"]) == p / "Class2D/job012"


@dataclass
class FakeJob:
    """The part of the runner's Job the registry uses."""

    state: str = "running"

    def __post_init__(self):
        self.state_callbacks, self.handlers = [], {}

    def on(self, etype, cb):
        self.handlers.setdefault(etype, []).append(cb)

    def emit(self, event):
        for cb in self.handlers.get(type(event), []):
            cb(event)

    def set_state(self, state):
        self.state = state
        for cb in self.state_callbacks:
            cb(self)


@dataclass(frozen=True)
class Params:
    i: Path
    o: Path


class Widget:
    job_name = "class2d"


class Listener:
    def __init__(self):
        self.calls = 0

    def changed(self):
        self.calls += 1


def test_session_jobs_follow_the_runner(tmp_path):
    p = _project(tmp_path)
    session = jm.SessionJobs()
    listener = Listener()
    session.connect(listener.changed)
    job, widget = FakeJob(), Widget()
    session.started(widget, Params(p / "Extract/job002/particles.star", p / "Class2D/job003/run"), job)
    assert listener.calls == 1
    (rec,) = session.records()
    assert (rec.job, rec.folder, rec.status, rec.session) == ("class2d", p / "Class2D/job003", "running", True)
    job.emit(IterationFinished(7))
    assert session.records()[0].iteration == 7 and listener.calls == 2
    job.set_state("finished")
    job.emit(Finished({"data": p / "Class2D/job003/run_it002_data.star"}))
    assert session.records()[0].status == "finished" and listener.calls >= 3
    assert session.widget_of(p / "Class2D/job003") is widget
    merged = jm.merge_records(jm.scan_project(p), session.records())
    assert len(merged) == 5
    (c2d,) = [r for r in merged if r.job == "class2d"]
    assert c2d.session and c2d.iteration == 7 and any(o.kind == jm.CLASSIFIED for o in c2d.outputs)
    del listener  # held weakly: a listener that is gone is not called
    job.set_state("cancelled")
    assert session.records()[0].status == "cancelled"


def test_note_of_relion_and_of_the_plugin(tmp_path):
    (tmp_path / "note.txt").write_text(" ++++ with the following command(s): \n`which relion_refine_mpi` --o "
                                       "Refine3D/job009/run --auto_refine --split_random_halves --i x.star\n")
    job, args = jm.note_arguments(tmp_path)
    assert job is None and args["--auto_refine"] == "" and args["--i"] == "x.star"
    folder = tmp_path / "Some" / "job004"
    folder.mkdir(parents=True)
    (folder / "note.txt").write_text("++++ with the following command(s):\nnapari-gpu-relion postprocess --i "
                                     "'a b/half1.mrc' --o Some/job004\n")
    assert jm.note_arguments(folder) == ("postprocess", {"--i": "a b/half1.mrc", "--o": "Some/job004"})
    assert jm.scan_job_folder(folder).job == "postprocess"


def test_project_of_a_job_folder():
    assert jm.project_of("/data/proj/Class2D/job003") == Path("/data/proj")
    assert jm.project_of("/data/proj/InitialModel/job012/") == Path("/data/proj")
    assert jm.project_of("/data/proj/class2d_out") is None  # not <Type>/jobNNN
    assert jm.project_of("/data/proj/out/job003") is None  # "out" is no job type


class InitialModelWidget:
    job_name = "initial_model"


@dataclass(frozen=True)
class RootParams:
    """Params whose --o is marked a relion_refine rootname, as jobs/em.py marks it."""

    i: Path
    o: Path = field(default=None, metadata={"mode": "root"})


class AnyWidget:
    job_name = "some_refine_style_job"


def test_a_running_initial_model_is_one_job_not_two(tmp_path):
    """Issue 49: a running 3D initial model was listed twice (InitialModel/job005 from its files, and
    InitialModel/job005/run from the session) and counted twice among the running jobs."""
    p = _project(tmp_path)
    im = p / "InitialModel" / "job005"
    class2d_iteration(p, "InitialModel/job005", 1, np.zeros((1, 8, 8), np.float32), [1.0])  # files of iteration 1
    session = jm.SessionJobs()
    job = FakeJob()
    session.started(InitialModelWidget(), Params(p / "Select/job004/particles.star", im / "run"), job)
    (rec,) = session.records()
    assert rec.folder == im  # the rootname's folder
    merged = jm.merge_records(jm.scan_project(p), session.records())
    folders = [r.folder for r in merged]
    assert folders.count(im) == 1 and im / "run" not in folders
    (row,) = [r for r in merged if r.folder == im]
    assert row.session and row.status == "running"
    assert jm.count_running(merged) == 1
    job.set_state("cancelling")
    assert jm.count_running(jm.merge_records(jm.scan_project(p), session.records())) == 1


def test_a_rootname_is_known_from_the_params_field(tmp_path):
    """Any job whose Params mark --o as a rootname (param(..., mode="root")) is listed by its folder."""
    session = jm.SessionJobs()
    session.started(AnyWidget(), RootParams(tmp_path / "x.star", tmp_path / "Refine3D" / "job002" / "run"), FakeJob())
    assert session.records()[0].folder == tmp_path / "Refine3D" / "job002"
    assert jm.output_folder("postprocess", Params(tmp_path / "h1.mrc", tmp_path / "PostProcess/job003")) == (
        tmp_path / "PostProcess/job003")  # a plain output folder stays itself


def test_running_jobs_are_counted_once_per_folder(tmp_path):
    a, b = tmp_path / "Class2D" / "job001", tmp_path / "Refine3D" / "job002"
    recs = [jm.JobRecord("class2d", a, "running", None, (), {}), jm.JobRecord("class2d", a, "running", None, (), {}),
            jm.JobRecord("refine3d", b, "queued", None, (), {}),
            jm.JobRecord("refine3d", tmp_path / "Refine3D" / "job003", "finished", None, (), {})]
    assert jm.count_running(recs) == 2


# ----------------------------------------------------------------------------------------------------------
# Refine3D -> CtfRefine -> Refine3D; PostProcess -> LocalRes (issue 51)


def _postprocess(p: Path, job: str, refine: str, mask: str | None = "MaskCreate/job006/mask.mrc",
                 bfactor: float = -85.5) -> Path:
    """A PostProcess job folder whose STAR names (project-relative, as RELION writes) ``refine``'s half maps."""
    from napari_gpu_relion.io.star import write_star_blocks

    folder = p / "PostProcess" / job
    folder.mkdir(parents=True)
    general = {"rlnFinalResolution": 7.5, "rlnBfactorUsedForSharpening": bfactor,
               "rlnUnfilteredMapHalf1": f"{refine}/run_half1_class001_unfil.mrc",
               "rlnUnfilteredMapHalf2": f"{refine}/run_half2_class001_unfil.mrc"}
    if mask is not None:
        general["rlnMaskName"] = mask
    for name in ("postprocess.mrc", "postprocess_masked.mrc"):
        (folder / name).write_text("x")
    write_star_blocks(folder / "postprocess.star", {"general": general})
    return folder / "postprocess.star"


def _chain_project(tmp_path: Path) -> Path:
    p = _project(tmp_path)  # Refine3D/job007 finished (half map 1, map, data STAR)
    (p / "Refine3D" / "job007" / "run_half2_class001_unfil.mrc").write_text("x")
    (p / "MaskCreate" / "job006").mkdir(parents=True)
    (p / "MaskCreate" / "job006" / "mask.mrc").write_text("x")
    return p


def _offer(record, job: str, kind: str, p: Path):
    (offer,) = [o for o in jm.offers(record, p) if o.job == job and o.output.kind == kind]
    return offer


def test_a_refinement_chains_into_ctf_refinement_with_its_post_processing(tmp_path):
    p = _chain_project(tmp_path)
    ref = p / "Refine3D" / "job007"
    # no post-processing of this refinement yet: its two half maps (no --f, so every frequency has weight 1)
    offer = _offer(jm.scan_job_folder(ref), "ctf_refine", jm.REFINED, p)
    assert offer.values == {"i": str(ref / "run_data.star"), "f": "", "m1": str(ref / "run_half1_class001_unfil.mrc"),
                            "m2": str(ref / "run_half2_class001_unfil.mrc"), "o": str(p / "CtfRefine/job008")}
    assert offer.label == "CTF refinement ← refined particles (run_data.star)"
    # with post-processings of it, the newest one (RELION's CtfRefine takes the PostProcess STAR); another
    # refinement's post-processing is not taken
    _postprocess(p, "job008", "Refine3D/job007")
    newest = _postprocess(p, "job009", "Refine3D/job007")
    _postprocess(p, "job010", "Refine3D/job005")
    offer = _offer(jm.scan_job_folder(ref), "ctf_refine", jm.REFINED, p)
    assert offer.values == {"i": str(ref / "run_data.star"), "f": str(newest), "m1": "", "m2": "", "mask": "",
                            "o": str(p / "CtfRefine/job011")}
    # a refinement still running offers no CTF refinement (RELION's takes the final particles only)
    running = jm.scan_job_folder(p / "Refine3D" / "job005")
    assert not [o for o in jm.offers(running, p) if o.job == "ctf_refine"]


def test_a_post_processing_chains_into_local_resolution_and_ctf_refinement(tmp_path):
    p = _chain_project(tmp_path)
    star = _postprocess(p, "job008", "Refine3D/job007")
    rec = jm.scan_job_folder(star.parent)
    assert rec.job == "postprocess" and rec.status == "finished"
    lr = _offer(rec, "local_resolution", jm.POSTPROCESSED, p)
    ref = p / "Refine3D" / "job007"
    assert lr.values == {"i": str(ref / "run_half1_class001_unfil.mrc"),
                         "i2": str(ref / "run_half2_class001_unfil.mrc"),
                         "mask": str(p / "MaskCreate/job006/mask.mrc"), "adhoc_bfac": "-85.50",
                         "o": str(p / "LocalRes/job009")}
    assert lr.label == "Local resolution ← postprocess.star"
    ctf = _offer(rec, "ctf_refine", jm.POSTPROCESSED, p)
    assert ctf.values == {"f": str(star), "i": str(ref / "run_data.star"), "o": str(p / "CtfRefine/job009")}
    # a post-processing STAR that names no half map that is there: nothing to offer local resolution
    broken = _postprocess(p, "job010", "Refine3D/job099", mask=None)
    assert not [o for o in jm.offers(jm.scan_job_folder(broken.parent), p) if o.job == "local_resolution"]


def test_ctf_refinement_chains_into_the_next_refinement_and_another_round(tmp_path):
    p = _chain_project(tmp_path)
    _postprocess(p, "job008", "Refine3D/job007")
    ctf = p / "CtfRefine" / "job009"
    ctf.mkdir(parents=True)
    (ctf / "note.txt").write_text("++++ with the following command(s):\nnapari-gpu-relion ctf_refine --i "
                                  "Refine3D/job007/run_data.star --o CtfRefine/job009/ --f "
                                  "PostProcess/job008/postprocess.star --fit_defocus\n")
    rec = jm.scan_job_folder(ctf, now=time.time() + 2 * jm.RUNNING_WINDOW)
    assert rec.job == "ctf_refine" and rec.status == "unknown" and not rec.outputs
    (ctf / "particles_ctf_refine.star").write_text("x")
    rec = jm.scan_job_folder(ctf)
    assert rec.status == "finished" and rec.job_type == "CtfRefine"
    refine = _offer(rec, "refine3d", jm.PARTICLES, p)
    assert refine.values == {"i": str(ctf / "particles_ctf_refine.star"),
                             "ref": str(p / "Refine3D/job007/run_class001.mrc"), "o": str(p / "Refine3D/job010")}
    again = _offer(rec, "ctf_refine", jm.REFINED, p)
    assert again.values == {"i": str(ctf / "particles_ctf_refine.star"),
                            "f": str(p / "PostProcess/job008/postprocess.star"), "m1": "", "m2": "", "mask": "",
                            "o": str(p / "CtfRefine/job010")}
    assert {o.job for o in jm.offers(rec, p)} >= {"refine3d", "class3d", "class2d", "ctf_refine"}


def test_local_resolution_folders_ours_and_relions(tmp_path):
    p = _chain_project(tmp_path)
    lr = p / "LocalRes" / "job008"
    lr.mkdir(parents=True)
    for name in ("relion_locres.mrc", "relion_locres_filtered.mrc", "relion_locres_fscs.star"):
        (lr / name).write_text("x")
    rec = jm.scan_job_folder(lr)
    assert (rec.job, rec.status) == ("local_resolution", "finished")
    assert {o.kind: o.path.name for o in rec.outputs} == {jm.MAP: "relion_locres_filtered.mrc",
                                                         jm.LOCRES: "relion_locres.mrc"}
    assert {o.job for o in jm.offers(rec, p)} == {"refine3d", "class3d", "mask_create"}  # the filtered map
    # RELION's LocalRes job runs relion_postprocess --locres: its note names that job wherever the folder is
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "note.txt").write_text(" ++++ with the following command(s): \n`which relion_postprocess` --locres "
                                    "--i Refine3D/job007/run_half1_class001_unfil.mrc --o LocalRes/job008/relion\n")
    assert jm.note_arguments(other)[0] == "local_resolution"
    # a dock's job: --o is <job folder>/relion (RELION's rootname), listed by its folder
    session = jm.SessionJobs()
    session.started(type("W", (), {"job_name": "local_resolution"})(), Params(p / "h1.mrc", lr / "relion"), FakeJob())
    assert session.records()[0].folder == lr


def test_one_scan_gives_the_jobs_and_the_selected_jobs_offers(tmp_path, session):
    """jobs_model.scan_jobs (the Jobs dock's worker thread): the project's jobs, and the offers of the selected one
    as offers() gives them, new folders numbered after every listed job; none without a selection."""
    p = _chain_project(tmp_path)
    ref = p / "Refine3D" / "job007"
    scan = jm.scan_jobs(p, ref)
    assert scan.records == jm.scan_project(p) and scan.folder == ref
    rec = next(r for r in scan.records if r.folder == ref)
    assert scan.offers == tuple(jm.offers(rec, p, [r.folder for r in scan.records]))
    assert any(o.job == "ctf_refine" for o in scan.offers)
    assert jm.scan_jobs(p) == jm.ProjectScan(scan.records)
    assert jm.scan_jobs(p, p / "Class2D" / "job099").offers == ()  # not listed: nothing offered
    assert jm.scan_jobs(None).records == []
