"""The job's background file writing (io/write_queue.py) and the images kept in memory (--preread_images):
files written in the order handed over, a failed write raised in the job's thread, a job's files whole when it
reports itself finished, and images read from their stack only once, in a background thread ahead of the job
(jobs/read_ahead.py) or when asked for."""

from __future__ import annotations

import functools
import shutil
import threading
import time
from pathlib import Path

import mrcfile
import numpy as np
import pytest

from napari_gpu_relion.errors import InputError
from napari_gpu_relion.events import Finished
from napari_gpu_relion.io.mrc import read_mrc
from napari_gpu_relion.io.particle_images import load_images
from napari_gpu_relion.io.write_queue import WriteQueue
from napari_gpu_relion.jobs import class3d, em, particles
from napari_gpu_relion.jobs import refine3d as refine3d_job
from napari_gpu_relion.jobs.particles import load_particle_set
from napari_gpu_relion.jobs.simulate import make_sample_data

SAMPLE = Path(__file__).resolve().parents[1] / "sample_data"


def test_writes_run_in_the_order_handed_over_and_drain_waits_for_them():
    done, gate = [], threading.Event()
    q = WriteQueue()
    q.put(lambda: (gate.wait(5), done.append(1)))
    for k in range(2, 6):
        q.put(done.append, k)
    assert done == []  # the first write holds the thread; nothing ran out of order
    gate.set()
    q.drain()
    assert done == [1, 2, 3, 4, 5]
    q.close()


def test_a_failed_write_is_raised_in_the_jobs_thread_and_the_writes_after_it_are_skipped():
    done = []
    q = WriteQueue()

    def fail():
        raise InputError("disk full", path="/x/run_it003_class001.mrc")

    q.put(fail)
    q.put(done.append, "after")
    with pytest.raises(InputError, match="disk full"):
        q.drain()
    assert done == []
    q.put(done.append, "again")  # the error was reported once; the queue writes again
    q.close()
    assert done == ["again"]


def test_writes_handed_over_before_a_failure_was_reported_are_skipped_in_both_lanes(monkeypatch):
    """Two lanes: an MRC write fails while a STAR write waits in the other lane; the job's next put reports the
    failure, and the waiting write (handed over before the report) is skipped, the writes after it run."""
    from napari_gpu_relion.io import write_queue  # noqa: PLC0415

    def no_helper():
        raise OSError("no helper in this test")

    monkeypatch.setattr(write_queue, "_Helper", no_helper)  # the STAR lane writes on its own thread
    gate, started, done = threading.Event(), threading.Event(), []

    @write_queue.formats_text
    def held():
        started.set()
        gate.wait(30)
        done.append("held")

    @write_queue.formats_text
    def star(x):
        done.append(x)

    def fail():
        raise InputError("disk full", path="/x/run_it003_class001.mrc")

    q = WriteQueue("test", helper_process=True)
    q.put(held)
    q.put(star, "before")  # waits behind the held write
    assert started.wait(30)  # the held write runs before the failure (on a loaded machine its lane starts late)
    q.put(fail)  # the other lane: fails at once
    for _ in range(600):
        if q._error is not None:
            break
        time.sleep(0.05)
    with pytest.raises(InputError, match="disk full"):
        q.put(star, "never handed over")
    q.put(star, "after")
    gate.set()
    q.drain()
    assert done == ["held", "after"], done
    assert "could not start" in q.helper_note
    q.close()


def test_a_helper_that_dies_after_starting_formatting_processes_is_noticed_not_waited_for(tmp_path, monkeypatch):
    """The helper's formatting processes (io/star.FORMAT_WORKERS_ENV) do not hold its answer pipe: when the helper
    is killed, the next STAR write sees it stopped and is written on the thread (not a job that hangs)."""
    import pandas as pd  # noqa: PLC0415

    from napari_gpu_relion.io.star import read_star, write_star_blocks  # noqa: PLC0415

    monkeypatch.setenv("NAPARI_GPU_RELION_FORMAT_WORKERS", "2")
    n = 25_000
    df = pd.DataFrame({"rlnAngleRot": np.random.default_rng(0).uniform(-180, 180, n),
                       "rlnClassNumber": np.ones(n, int)})
    q = WriteQueue("test", helper_process=True)
    q.put(write_star_blocks, tmp_path / "first.star", {"particles": df})  # the helper starts its processes
    q.drain()
    q._helper._proc.kill()
    q._helper._proc.wait(10)
    done = threading.Event()

    def again():
        q.put(write_star_blocks, tmp_path / "again.star", {"particles": df})
        q.drain()
        done.set()

    threading.Thread(target=again, daemon=True).start()
    assert done.wait(60), "the write after the helper died did not finish in 60 s"
    assert "stopped" in q.helper_note
    assert len(read_star(tmp_path / "again.star")["particles"]) == n
    q.close()


def test_writes_through_the_helper_process_give_the_same_files_and_errors(tmp_path):
    """A large job's STAR writes run in a helper process (their formatting does not hold the job's lock), its MRC
    writes on the thread: the same bytes as a write in this process, a failed write raised here with its own
    message, and a write the helper cannot take (not picklable) written on the worker thread, saying so."""
    from napari_gpu_relion.io.model_star import read_optimiser_star, write_optimiser_star  # noqa: PLC0415
    from napari_gpu_relion.io.mrc import write_mrc  # noqa: PLC0415
    from napari_gpu_relion.io.star import read_particles, write_particles  # noqa: PLC0415

    table = read_particles(SAMPLE / "particles.star")
    vol = np.random.default_rng(0).standard_normal((24, 24, 24)).astype(np.float32)
    write_particles(tmp_path / "here.star", table)
    write_mrc(tmp_path / "here.mrc", vol, 2.5)
    q = WriteQueue("test", helper_process=True)
    q.put(write_particles, tmp_path / "there.star", table)
    q.put(write_mrc, tmp_path / "there.mrc", vol, 2.5)
    q.drain()
    assert q._helper is not None and q._helper._proc.poll() is None  # a process of its own did the writing
    assert q.helper_note is None
    assert (tmp_path / "there.star").read_bytes() == (tmp_path / "here.star").read_bytes()
    there, here = (tmp_path / "there.mrc").read_bytes(), (tmp_path / "here.mrc").read_bytes()
    assert there[:224] == here[:224] and there[1024:] == here[1024:]  # the labels (224-1023) hold the time
    (tmp_path / "a_file").write_text("not a folder")
    q.put(write_particles, tmp_path / "a_file" / "x.star", table)
    with pytest.raises(OSError, match="a_file"):
        q.drain()

    class Local:  # a class of a function's own does not pickle; its value formats as "7"
        def __str__(self):
            return "7"

    q.put(write_optimiser_star, tmp_path / "local.star", {"rlnCurrentIteration": Local()})  # written here
    q.put(write_particles, tmp_path / "after.star", table)  # the helper takes the next write again
    q.drain()
    assert "cannot take" in q.helper_note and q._helper is not None
    assert read_optimiser_star(tmp_path / "local.star")["rlnCurrentIteration"] == 7
    assert (tmp_path / "after.star").read_bytes() == (tmp_path / "here.star").read_bytes()
    proc = q._helper._proc
    q.close()
    assert q._helper is None
    assert proc.wait(timeout=30) == 0  # the helper ended by itself once its stdin closed (not killed)


def test_star_writes_in_the_helper_run_beside_the_other_writes_and_put_after_all_waits_for_both(tmp_path):
    """With a helper process the STAR writes (formats_text) do not wait behind an MRC write held on the thread, and
    a put_after_all write (the optimiser STAR) appears only after every write handed over before it."""
    from napari_gpu_relion.io.model_star import read_optimiser_star, write_optimiser_star  # noqa: PLC0415

    gate, done = threading.Event(), []
    q = WriteQueue("test", helper_process=True)
    q.put(lambda: (gate.wait(30), done.append("held")))  # not a STAR writer: the thread's lane, held
    q.put(write_optimiser_star, tmp_path / "beside.star", {"rlnCurrentIteration": 3})
    for _ in range(600):  # written by the helper while the thread's lane is held (at most 30 s)
        if (tmp_path / "beside.star").exists():
            break
        time.sleep(0.05)
    assert read_optimiser_star(tmp_path / "beside.star")["rlnCurrentIteration"] == 3 and done == []
    q.put_after_all(write_optimiser_star, tmp_path / "after.star", {"rlnCurrentIteration": 4})
    time.sleep(1.0)
    assert not (tmp_path / "after.star").exists() and done == []  # still behind the held write
    gate.set()
    q.drain()
    assert done == ["held"] and read_optimiser_star(tmp_path / "after.star")["rlnCurrentIteration"] == 4
    name, seconds = q.slowest_since(0, 1).rsplit(" ", 2)[:2]  # the held write was the slowest, >= 1 s
    assert name == "<lambda>" and float(seconds) >= 1.0, q.slowest_since(0)
    assert q.slowest_since(2) == q.slowest_since(2, 1) and q.slowest_since(2).startswith("after.star ")
    assert q._helper is not None and q.helper_note is None  # the STAR writes went through the helper
    q.close()


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A small simulated set (box 32, 120 particles), searched at HEALPix order 0: the jobs below test file writing
    and the kept images, not the science (a few seconds each on 2 CPU cores instead of over a minute)."""
    return make_sample_data(tmp_path_factory.mktemp("wq"), box=32, angpix=6.0, n_particles=120, snr=0.2,
                            diameter=134.4, ini_high=60.0, n_micrographs=0)


def _class3d(data: Path, out: Path) -> class3d.Params:
    return class3d.Params(i=data / "particles.star", o=out / "run", ref=data / "reference.mrc", K=2, iter=2,
                          ctf=True, particle_diameter=134.4, healpix_order=0, cpu=True, batch=50)


@pytest.mark.slow
def test_a_jobs_files_are_whole_when_it_reports_finished_and_a_write_error_stops_it(small, tmp_path, monkeypatch):
    events = list(class3d.run(_class3d(small, tmp_path / "a")))
    fin = events[-1]
    assert isinstance(fin, Finished)
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    for i in (1, 2):
        for f in ("class001.mrc", "class002.mrc", "model.star", "data.star", "optimiser.star"):
            assert f"run_it{i:03d}_{f}" in names
    assert not [n for n in names if "-tmp-" in n]  # no temporaries left
    assert read_mrc(fin.outputs["class001"]).data.shape == (32, 32, 32)

    calls = []

    def failing_write_mrc(path, data, pixel_size, **kw):
        calls.append(Path(path).name)
        raise InputError("no space left on device", path=str(path))

    monkeypatch.setattr(class3d, "write_mrc", failing_write_mrc)
    with pytest.raises(InputError, match="no space left on device"):
        list(class3d.run(_class3d(small, tmp_path / "b")))
    assert calls == ["run_it001_class001.mrc"]  # the first failure stops the job; nothing after it is written
    assert not list((tmp_path / "b").glob("run_it*_optimiser.star"))


def _copy_sample(dst: Path) -> Path:
    (dst / "particles").mkdir(parents=True)
    shutil.copy(SAMPLE / "particles.star", dst / "particles.star")
    shutil.copy(SAMPLE / "particles" / "particles.mrcs", dst / "particles" / "particles.mrcs")
    return dst / "particles.star"


def test_kept_images_are_read_from_their_stack_once_and_equal_the_disk(tmp_path):
    star = _copy_sample(tmp_path / "d")
    ps = load_particle_set(star, ctf=True, halves=False)
    disk = ps.images(np.arange(len(ps)))
    ps.keep_images_in_memory()
    rows = np.array([5, 3, 5, 0, len(ps) - 1])
    np.testing.assert_array_equal(ps.images(rows), disk[rows])
    first = ps.images(np.arange(len(ps)))
    np.testing.assert_array_equal(first, disk)
    for stack in {n.split("@")[1] for n in ps.table.particles["rlnImageName"]}:
        (tmp_path / "d" / stack).unlink()  # the files are gone: the images come from memory
    np.testing.assert_array_equal(ps.images(np.arange(len(ps))[::-1]), disk[::-1])


def _slowed_set(tmp_path: Path, monkeypatch, delay_s: float):
    """The sample particles with their images kept in memory, each reading of images ``delay_s`` slower."""
    ps = load_particle_set(_copy_sample(tmp_path / "d"), ctf=True, halves=False)
    ps.keep_images_in_memory()
    read = ps._read

    def slow(rows):
        time.sleep(delay_s)
        return read(rows)
    monkeypatch.setattr(ps, "_read", slow)
    return ps


def test_only_reading_images_counts_as_reading_time(tmp_path, monkeypatch):
    """seconds_reading (what MPI ranks' shares leave out of their speed) grows by the time spent in the reads of
    images not kept yet, and not when the images come from memory."""
    ps = _slowed_set(tmp_path, monkeypatch, 0.2)
    ps.images(np.arange(10))
    first = ps.seconds_reading
    assert first >= 0.2
    for _ in range(5):
        ps.images(np.arange(10))  # held: no reading
    assert ps.seconds_reading - first < 0.2


def test_reading_time_parts_say_who_read(tmp_path, monkeypatch):
    """The parts of seconds_reading (the log's breakdown): rows no reader has started are the job's thread's own
    reading; rows of a slow background reader are waiting for it; the parts add up to the total."""
    waiting, own, _ = particles.READING_PARTS
    ps = _slowed_set(tmp_path, monkeypatch, 0.2)
    ps.images(np.arange(4))  # no reader: the thread reads them itself
    assert ps.reading_parts[own] >= 0.2 and ps.reading_parts[waiting] == 0.0
    ps.read_ahead(np.arange(4, len(ps)))  # a background reader with the same slow reads
    ps.images(np.arange(4, 8))  # its first block: the thread waits for it
    assert ps.reading_parts[waiting] >= 0.15
    assert ps.reading_parts[own] < 0.4  # the reader's rows were not read again by the thread
    assert abs(sum(ps.reading_parts.values()) - ps.seconds_reading) < 0.05
    ps.stop_reading()


def test_a_particle_set_parses_its_image_names_once_and_reads_the_same_images(tmp_path, monkeypatch):
    """The job's reads (block by block, by a background reader) and its data STAR's names use the locations
    parsed when the set was loaded: the same images as load_images parsing the names, the same rlnImageName."""
    from napari_gpu_relion.io import particle_images  # noqa: PLC0415

    star = _copy_sample(tmp_path / "d")
    ps = load_particle_set(star, ctf=True, halves=False)
    ps.keep_images_in_memory()
    ps.read_ahead(np.arange(len(ps))[::-1])  # a background reader, as the jobs run it
    parsed = []
    parse = particle_images._parse_names
    monkeypatch.setattr(particle_images, "_parse_names", lambda *a: parsed.append(1) or parse(*a))
    rows = np.array([len(ps) - 1, 3, 0, 3])
    got = ps.images(rows)
    got_all = ps.images(np.arange(len(ps)))
    names = particles.data_star_table(tmp_path / "elsewhere" / "run_it001_data.star", ps)["rlnImageName"]
    assert parsed == []
    np.testing.assert_array_equal(got, particle_images.load_images(ps.table, rows=rows))
    assert parsed == [1]
    np.testing.assert_array_equal(got_all, particle_images.load_images(ps.table))
    with pytest.raises(ValueError, match="locations of 3 rows"):
        particle_images.load_images(ps.table, rows=[0], locations=([Path("x")] * 3, np.zeros(3, dtype=np.int64)))
    assert names.tolist() == particle_images.image_names_for(ps.table, tmp_path / "elsewhere" / "x.star").tolist()
    assert names.iloc[0] != ps.table.particles["rlnImageName"].iloc[0]  # made absolute: another folder


def test_images_are_kept_when_asked_or_small_and_a_request_larger_than_the_ram_is_refused():
    ps = load_particle_set(SAMPLE / "particles.star", ctf=True, halves=False)
    need = ps.image_bytes
    note = em.keep_images(ps, False, 3 * need)  # more than a quarter of the RAM: read from the disk
    assert ps.kept is None and "read from the disk" in note
    with pytest.raises(InputError, match="--preread_images"):
        em.keep_images(ps, True, need - 1)
    assert ps.kept is None
    assert "kept in memory" in em.keep_images(ps, True, 2 * need)
    assert ps.kept is not None and ps.kept.shape == (len(ps), ps.box, ps.box)
    ps2 = load_particle_set(SAMPLE / "particles.star", ctf=True, halves=False)
    em.keep_images(ps2, False, 4 * need)
    assert ps2.kept is not None


@pytest.mark.slow  # over 10 s on 2 cores (the fast loop, -m 'not slow and not long', leaves it out)
def test_refine3d_results_do_not_depend_on_keeping_the_images_or_writing_in_the_background(small, tmp_path,
                                                                                            monkeypatch):
    def run(out: Path, preread: bool) -> dict[str, bytes]:
        p = refine3d_job.Params(i=small / "particles.star", o=out / "run", ref=small / "reference.mrc", ctf=True,
                                particle_diameter=134.4, flatten_solvent=True, healpix_order=0,
                                auto_local_healpix_order=3, auto_iter_max=2, cpu=True, preread_images=preread)
        list(refine3d_job.run(p))
        # MRC files by their values (their header labels carry the time of writing); the optimiser STARs name
        # their own folders
        return {q.name: read_mrc(q).data.tobytes() if q.suffix == ".mrc" else q.read_bytes()
                for q in sorted(out.iterdir()) if q.suffix in (".mrc", ".star") and "optimiser" not in q.name}

    a = run(tmp_path / "a", preread=True)
    # the former behaviour: images read from the disk, every write done in the job's thread before it goes on
    monkeypatch.setattr(em.EMJob, "save", lambda self, fn, *args, **kw: fn(*args, **kw))
    monkeypatch.setattr(em, "keep_images", lambda ps, asked, available: "read from the disk")
    b = run(tmp_path / "b", preread=False)
    assert sorted(a) == sorted(b) and len(a) >= 9
    for name in a:
        assert a[name] == b[name], name  # maps, model and data STARs bit for bit


def test_images_moved_to_another_array_keep_what_was_read_and_read_the_rest_once(tmp_path):
    """keep_images_on (the GPU path uses CuPy; NumPy here): the rows already read move over, the others are read
    from the stack when first asked for, and afterwards no file is needed."""
    star = _copy_sample(tmp_path / "d")
    ps = load_particle_set(star, ctf=True, halves=False)
    disk = ps.images(np.arange(len(ps)))
    ps.keep_images_in_memory()
    ps.images(np.arange(0, len(ps), 3))
    before = ps.in_memory.copy()
    ps.keep_images_on(np)
    np.testing.assert_array_equal(ps.in_memory, before)
    np.testing.assert_array_equal(ps.kept[before], disk[before])
    np.testing.assert_array_equal(ps.images(np.arange(len(ps))[::-1]), disk[::-1])
    assert ps.in_memory.all()
    for stack in {n.split("@")[1] for n in ps.table.particles["rlnImageName"]}:
        (tmp_path / "d" / stack).unlink()
    np.testing.assert_array_equal(ps.images(np.arange(len(ps))), disk)


def test_a_store_smaller_than_the_set_keeps_a_ranks_rows_and_reads_the_rest(tmp_path):
    """keep_images_on with a capacity (an MPI rank's store on its GPU; NumPy here): the rows kept equal the disk,
    rows beyond its room come from the stack each time, and retain frees the rows the rank no longer has so that
    its next rows take their places."""
    from napari_gpu_relion.io import particle_images  # noqa: PLC0415

    star = _copy_sample(tmp_path / "d")
    ps = load_particle_set(star, ctf=True, halves=False)
    n = len(ps)
    disk = ps.images(np.arange(n))
    ps.keep_images_on(np, capacity=6)
    assert ps.kept.shape == (6, ps.box, ps.box)
    first = np.array([7, 2, 9, 2, 4])
    ps.retain(first)
    np.testing.assert_array_equal(ps.images(first), disk[first])
    assert ps.in_memory.sum() == 4
    more = np.array([0, 1, 7, 11])  # 7 held; three new rows for two places: 0 and 1 kept, 11 read and not kept
    np.testing.assert_array_equal(ps.images(more), disk[more])
    assert ps.in_memory.sum() == 6 and ps.in_memory[[7, 2, 9, 4, 0, 1]].all() and not ps.in_memory[11]
    reads = []
    real = particle_images.load_images
    import napari_gpu_relion.jobs.particles as particles_module  # noqa: PLC0415

    particles_module.load_images = lambda *a, **k: reads.append(len(k["rows"])) or real(*a, **k)
    try:
        np.testing.assert_array_equal(ps.images(more), disk[more])
        assert reads == [1]  # the row without a place, again
        ps.retain(np.array([11, 12, 13, 7]))  # the rank's next block: 0, 1, 2, 4 and 9 go
        assert ps.in_memory.sum() == 1 and ps.in_memory[7]
        reads.clear()
        np.testing.assert_array_equal(ps.images(np.array([13, 11, 12, 7])), disk[[13, 11, 12, 7]])
        assert reads == [3] and ps.in_memory[[7, 11, 12, 13]].all()
        reads.clear()
        np.testing.assert_array_equal(ps.images(np.array([12, 7, 13, 11])), disk[[12, 7, 13, 11]])
        assert reads == []  # all four from the store
    finally:
        particles_module.load_images = real


def test_the_device_image_policy_counts_a_ranks_rows_with_a_margin():
    from napari_gpu_relion.runtime import memory  # noqa: PLC0415

    each = 256 * 256 * 4
    free = 4 * 100_000 * each
    assert memory.device_images_capacity(100_000, each, free) == 100_000
    assert memory.device_images_capacity(100_001, each, free) == 0
    # a rank with 50,000 of 200,000 particles keeps room for 62,500 when they fit, whatever the whole set's size
    assert memory.device_images_capacity(200_000, each, free, own_rows=50_000) == 62_500
    assert memory.device_images_capacity(200_000, each, free, own_rows=90_000) == 0
    assert memory.device_images_capacity(1000, each, free, own_rows=900) == 1000  # never more than the set


@pytest.mark.parametrize("threads", [1, 3])
def test_images_read_ahead_in_the_background_equal_the_disk_whatever_the_order_asked(tmp_path, monkeypatch, threads):
    """The reader reads blocks of its order in a thread (or several); images() takes what is ready, waits only for
    rows being read, and reads itself the rows the reader has not started (asked out of order) or was never given.
    The same images as the disk, each row read once; afterwards no file is needed, the reader's threads have ended,
    and a second read_ahead has nothing to do."""
    monkeypatch.setattr(particles, "BLOCK_ROWS", 7)
    star = _copy_sample(tmp_path / "d")
    ps = load_particle_set(star, ctf=True, halves=False)
    n = len(ps)
    disk = ps.images(np.arange(n))
    ps.keep_images_in_memory()
    reads = []
    read = ps._read

    def counted(rows):
        reads.append(np.asarray(rows).copy())
        return read(rows)

    monkeypatch.setattr(ps, "_read", counted)
    order = np.r_[np.arange(n - 1, 10, -1), np.arange(0, 6)]  # rows 6..10 are not the reader's
    ps.read_ahead(np.r_[order, order[:5]], threads)  # repeated rows are read once
    reader = ps.ahead
    assert reader is not None
    for rows in (np.array([0, n - 1, 8]), np.arange(n)[::3], np.array([7, 9, 10, 6]), np.arange(n)):
        np.testing.assert_array_equal(ps.images(rows), disk[rows])
    assert ps.in_memory.all() and ps.ahead is None and not reader.alive
    done = np.concatenate(reads)
    assert np.array_equal(np.sort(done), np.arange(n))  # every row read once, by the reader or by images()
    for stack in {name.split("@")[1] for name in ps.table.particles["rlnImageName"]}:
        (tmp_path / "d" / stack).unlink()
    ps.read_ahead(np.arange(n))
    assert ps.ahead is None
    np.testing.assert_array_equal(ps.images(np.arange(n)[::-1]), disk[::-1])


def test_several_reader_threads_hand_the_blocks_over_in_order_each_row_once():
    """Four threads read blocks that take random times: next() gives them in the blocks' order (ctf_refine's
    batches need it), each unclaimed row once, never a claimed row (a block wholly claimed is skipped); at most
    ``ahead_blocks`` blocks are read beyond the last one taken."""
    from napari_gpu_relion.jobs.read_ahead import ImageReadAhead  # noqa: PLC0415

    rng = np.random.default_rng(3)
    order = rng.permutation(200)
    delays = rng.uniform(0, 0.01, 200)
    lock, ahead_seen, taken = threading.Lock(), [], [0]
    started = [0]

    def read(rows):
        with lock:
            started[0] += 1
            ahead_seen.append(started[0] - taken[0])
        time.sleep(float(delays[rows].max()))
        return rows[:, None, None].astype(np.float32) * np.ones((1, 2, 2), np.float32)

    reader = ImageReadAhead(read, order, 200, 9, ahead_blocks=3, threads=4)
    claimed = order[45:54]  # the sixth block, claimed before a thread may start it (3 ahead of none taken)
    reader.claim(claimed)
    got = []
    while (item := reader.next(wait=True)) is not None:
        rows, images = item
        time.sleep(0.01)  # a slow job: unbounded threads would run many blocks ahead
        with lock:
            taken[0] += 1
        np.testing.assert_array_equal(images[:, 0, 0], rows)
        got.append(rows)
    assert reader.finished and not reader.alive
    done = np.concatenate(got)
    np.testing.assert_array_equal(done, order[~np.isin(order, claimed)])  # in order, each row once, none claimed
    assert max(ahead_seen) <= 3 + 1  # a thread starts a block only while fewer than 3 wait beyond the last taken


def _one_row_blocks(tmp_path: Path, monkeypatch):
    """The sample set with its images kept in memory, read ahead in blocks of one row, three blocks ahead; returns
    (set, its star, every image from the disk)."""
    monkeypatch.setattr(particles, "BLOCK_ROWS", 1)
    star = _copy_sample(tmp_path / "d")
    ps = load_particle_set(star, ctf=True, halves=False)
    disk = ps.images(np.arange(len(ps)))
    ps.keep_images_in_memory()
    monkeypatch.setattr(ps, "read_ahead", functools.partial(ps.read_ahead, ahead_bytes=3 * ps.box * ps.box * 4))
    return ps, star, disk


@pytest.mark.slow
def test_a_request_takes_the_blocks_read_when_asked_not_all_that_fast_threads_read_meanwhile(tmp_path, monkeypatch):
    """Fast reader threads and a slow store: a request for a few rows takes the blocks that were ready when it
    came (at most the reader's bound ahead) and its own rows, not block after block as the threads keep reading
    (the whole set went into one initial-model request on 2 H200s: 20.9 s, then 33.8 s moving it to the GPU)."""
    ps, _, disk = _one_row_blocks(tmp_path, monkeypatch)
    n = len(ps)
    store = ps._store

    def slow_store(rows, data):
        time.sleep(0.02)  # the threads read the next block meanwhile
        store(rows, data)

    monkeypatch.setattr(ps, "_store", slow_store)
    ps.read_ahead(np.arange(n), threads=3)
    reader = ps.ahead
    deadline = time.monotonic() + 10
    while reader.ready() < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reader.ready() == 3  # the bound: no thread starts a fourth block
    np.testing.assert_array_equal(ps.images([n - 1]), disk[[n - 1]])
    assert ps.in_memory.sum() == 1 + 3 and ps.in_memory[[0, 1, 2, n - 1]].all()
    np.testing.assert_array_equal(ps.images(np.arange(n)), disk)  # the rest as before: each row once
    ps.stop_reading()


def test_rows_asked_in_the_readers_order_are_read_by_its_threads_and_rows_far_ahead_by_the_caller(tmp_path,
                                                                                                   monkeypatch):
    """A request for rows the reader will reach within its bound plus the blocks they fill leaves them to its
    threads (past the bound), and the caller waits for them; rows far ahead in its order are the caller's."""
    ps, _, disk = _one_row_blocks(tmp_path, monkeypatch)
    n = len(ps)
    by = {}
    read = ps._read

    def named(rows):
        for r in rows:
            by[int(r)] = threading.current_thread().name
        return read(rows)

    monkeypatch.setattr(ps, "_read", named)
    ps.read_ahead(np.arange(n), threads=2)
    np.testing.assert_array_equal(ps.images(np.arange(10)), disk[:10])  # 10 blocks: past the bound of 3
    assert all(by[r].startswith("particle images") for r in range(10)), by
    np.testing.assert_array_equal(ps.images(np.arange(50, 55)), disk[50:55])  # beyond 10 + 3 + 5 blocks
    assert all(by[r] == threading.current_thread().name for r in range(50, 55)), by
    ps.stop_reading()


def test_a_request_lets_the_threads_read_past_the_bound_only_as_far_as_its_rows_fill(tmp_path, monkeypatch):
    """Rows asked for in the reader's order: its threads read past the bound up to them (while the job's slow store
    takes the first blocks). Rows scattered over the set: the threads read no further than the bound plus as many
    blocks as the rows fill; the rest are the caller's (a scattered request let them read most of the set)."""
    ps, star, disk = _one_row_blocks(tmp_path, monkeypatch)
    n = len(ps)
    store, read, seen = ps._store, ps._read, []

    def slow_store(rows, data):
        time.sleep(0.02)
        store(rows, data)

    def watched(rows):
        reader = ps.ahead
        if reader is not None:
            seen.append(reader._started - reader._taken)  # noqa: SLF001 - blocks started beyond the last taken
        return read(rows)

    monkeypatch.setattr(ps, "_store", slow_store)
    monkeypatch.setattr(ps, "_read", watched)
    ps.read_ahead(np.arange(n), threads=3)
    np.testing.assert_array_equal(ps.images(np.arange(12)), disk[:12])
    assert max(seen) > 3 + 1  # past the bound of 3 blocks (and the one a thread may start at it)
    ps.stop_reading()

    ps = load_particle_set(star, ctf=True, halves=False)
    ps.keep_images_in_memory()
    read = ps._read
    by_threads = []

    def counted(rows):
        if threading.current_thread().name.startswith("particle images"):
            by_threads.extend(int(r) for r in rows)
        return read(rows)

    monkeypatch.setattr(ps, "_read", counted)
    monkeypatch.setattr(particles, "BLOCK_ROWS", 4)  # three blocks of four rows ahead:
    monkeypatch.setattr(ps, "read_ahead", functools.partial(ps.read_ahead, ahead_bytes=3 * 4 * ps.box * ps.box * 4))
    ps.read_ahead(np.arange(n), threads=3)
    scattered = np.arange(0, 13 * 30, 13)  # 30 rows in 30 blocks, which 30 rows would fill 8 of
    assert n >= 13 * 30
    np.testing.assert_array_equal(ps.images(scattered), disk[scattered])
    time.sleep(0.2)  # threads that were let go further would have read on meanwhile
    # the bound (3 blocks), 8 blocks, one more per thread: 14 blocks of 4 rows (taking the 30 touched: 132 rows)
    assert len(by_threads) <= 4 * (3 + 8 + 3), sorted(by_threads)
    ps.stop_reading()


def test_a_reader_whose_threads_ended_without_a_block_raises_instead_of_waiting(monkeypatch):
    """Threads that end without handing a block over (not a read error, which is handed over) leave next(wait=True)
    a clear error, not a job that waits for ever."""
    from napari_gpu_relion.jobs.read_ahead import ImageReadAhead  # noqa: PLC0415

    monkeypatch.setattr(ImageReadAhead, "_run", lambda self: None)
    reader = ImageReadAhead(lambda rows: np.zeros((len(rows), 2, 2), np.float32), np.arange(10), 10, 5, 2,
                            threads=2)
    reader.join(5.0)
    with pytest.raises(RuntimeError, match="ended before block 0 of 2"):
        reader.next(wait=True)
    assert reader.finished and reader.next(wait=True) is None


@pytest.mark.parametrize("threads", [1, 3])
def test_a_bad_image_met_by_the_reader_is_raised_in_the_jobs_thread(tmp_path, monkeypatch, threads):
    """An image with a NaN pixel, read by the background reader (one thread or several): the job's thread gets the
    same InputError (stack, image number, STAR line) as a read in its own thread, at its next request; the reader
    has stopped."""
    monkeypatch.setattr(particles, "BLOCK_ROWS", 5)
    star = _copy_sample(tmp_path / "d")
    stack = tmp_path / "d" / "particles" / "particles.mrcs"
    with mrcfile.open(stack, mode="r+") as m:
        img = m.data[12].copy()
        img[3, 4] = np.nan
        m.data[12] = img
    ps = load_particle_set(star, ctf=True, halves=False)
    with pytest.raises(InputError) as direct:
        ps.images(np.arange(10, 14))
    ps = load_particle_set(star, ctf=True, halves=False)
    ps.keep_images_in_memory()
    ps.read_ahead(np.arange(len(ps)), threads)
    reader = ps.ahead
    reader.join(timeout=10)  # the reader has met the bad block and stopped
    assert not reader.alive
    with pytest.raises(InputError) as ahead:
        for _ in range(4):  # the blocks before the bad one come first
            ps.images(np.arange(5))
    assert str(ahead.value) == str(direct.value) and "image 13 of stack" in str(ahead.value)
    assert ps.ahead is None


def test_stop_reading_ends_the_reader_soon_and_the_rest_is_read_when_asked(tmp_path, monkeypatch):
    """A job that ends (cancel, error) stops its reader after the block in hand; the rows it did not read are read
    in the job's thread when asked for."""
    monkeypatch.setattr(particles, "BLOCK_ROWS", 1)
    ps = _slowed_set(tmp_path, monkeypatch, 0.05)
    disk = load_images(ps.table)
    ps.read_ahead(np.arange(len(ps)))
    reader = ps.ahead
    np.testing.assert_array_equal(ps.images([0]), disk[[0]])
    t0 = time.perf_counter()
    ps.stop_reading()
    assert not reader.alive and time.perf_counter() - t0 < 1.0
    assert ps.ahead is None and not ps.in_memory.all()
    np.testing.assert_array_equal(ps.images(np.arange(len(ps))), disk)


def test_a_data_star_handed_to_the_writer_says_the_state_when_handed_over_not_later(tmp_path):
    """save_data_star copies the particles' values (particle_state) and the write thread makes the table: changes
    the next iteration makes to the set afterwards are not in the file, and the file equals the table made at once."""
    from napari_gpu_relion.io.star import read_star  # noqa: PLC0415

    star = _copy_sample(tmp_path / "d")
    ps = load_particle_set(star, ctf=True, halves=False)
    ps.angles[:] = np.arange(3 * len(ps)).reshape(-1, 3)
    ps.classes[:] = 2
    ps.pmax[:] = 0.25
    path = tmp_path / "run" / "run_it001_data.star"
    expected = particles.data_star_table(path, ps)
    state = particles.particle_state(ps)
    ps.angles += 100.0
    ps.classes[:] = 0
    ps.pmax[:] = 0.75
    ps.offsets_px += 3.0
    particles.write_data_star(path, state)
    got = read_star(path)["particles"]
    for col in ("rlnAngleRot", "rlnAnglePsi", "rlnClassNumber", "rlnMaxValueProbDistribution", "rlnOriginXAngst"):
        np.testing.assert_allclose(got[col].to_numpy(float), expected[col].to_numpy(float), rtol=1e-6)
    assert got["rlnImageName"].tolist() == expected["rlnImageName"].tolist()
    assert got["rlnClassNumber"].tolist() == [3] * len(ps)
    assert state.kept is None and state.ahead is None


def test_reader_threads_leave_half_the_hosts_cores_to_the_jobs(monkeypatch):
    """read_threads: READ_THREADS per rank at most, the ranks of a host together at most half the cores they may
    use, one at least (a 2-core machine keeps one reader thread)."""
    from napari_gpu_relion.jobs import read_ahead  # noqa: PLC0415

    for cores, ranks, want in ((16, 1, 4), (16, 2, 4), (16, 4, 2), (16, 16, 1), (2, 1, 1), (1, 1, 1), (64, 1, 4)):
        monkeypatch.setattr(read_ahead, "usable_cores", lambda c=cores: c)
        assert read_ahead.read_threads(ranks) == want, (cores, ranks)


def test_a_readers_bound_raised_while_it_runs_lets_its_threads_read_further():
    """ImageReadAhead.raise_ahead: with nothing taken, the threads stop at the bound (2 blocks); raised to 6 they
    go on to 6 and stop there; a lower value never lowers it. ParticleSet.read_ahead on a running reader raises it
    so (a job raises it once its images' store is on the GPU)."""
    from napari_gpu_relion.jobs.read_ahead import ImageReadAhead  # noqa: PLC0415

    started = []
    lock = threading.Lock()

    def read(rows):
        with lock:
            started.append(int(rows[0]))
        return rows[:, None, None].astype(np.float32) * np.ones((1, 2, 2), np.float32)

    def settled(count: int) -> int:
        deadline = time.monotonic() + 5
        while len(started) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # a thread that would read past the bound has had time to start
        return len(started)

    reader = ImageReadAhead(read, np.arange(40), 40, 4, ahead_blocks=2, threads=3)
    try:
        assert settled(2) == 2
        reader.raise_ahead(6)
        assert settled(6) == 6
        reader.raise_ahead(3)  # never lower
        assert reader.next(wait=True)[0][0] == 0
        assert settled(7) == 7  # one taken: one more block, 6 ahead of the taken one
    finally:
        reader.stop()


def test_an_em_job_reads_ahead_little_before_its_store_is_made_and_the_policys_share_after(tmp_path, monkeypatch):
    """jobs/em.py: the reader starts with runtime.memory.READ_AHEAD_MIN_BYTES (what the initial model takes goes to
    the host's store and is moved to the GPU's later) and gets the memory policy's share of the host
    (read_ahead_bytes) once the images' store is made."""
    from napari_gpu_relion.jobs import class3d, em  # noqa: PLC0415
    from napari_gpu_relion.runtime.memory import READ_AHEAD_MIN_BYTES  # noqa: PLC0415

    share = 7 * READ_AHEAD_MIN_BYTES
    monkeypatch.setattr(em, "read_ahead_bytes", lambda available, ranks=1: share)
    asked = []
    real = particles.ParticleSet.read_ahead

    class Seen(Exception):
        """Both bounds asked: the rest of the job (its E-step) is not this test's."""

    def recorded(self, order, threads=1, ahead_bytes=READ_AHEAD_MIN_BYTES, upload=None):
        asked.append(ahead_bytes)
        out = real(self, order, threads, ahead_bytes, upload)
        if len(asked) == 2:
            self.stop_reading()
            raise Seen
        return out

    monkeypatch.setattr(particles.ParticleSet, "read_ahead", recorded)
    star = _copy_sample(tmp_path / "d")
    with pytest.raises(Seen):
        list(class3d.run(class3d.Params(i=star, ref=SAMPLE / "reference.mrc", o=tmp_path / "c3" / "run", K=1,
                                        iter=1, healpix_order=1, ctf=True, particle_diameter=150.0, cpu=True,
                                        preread_images=True)))
    assert asked == [READ_AHEAD_MIN_BYTES, share], asked


def test_the_readers_next_step_applies_to_the_blocks_its_threads_start_after_it_is_given():
    """ImageReadAhead.then (how the threads copy blocks to the job's GPU once its store is there): blocks started
    before keep the images read, blocks started after hand over step(images), in order, each row once."""
    from napari_gpu_relion.jobs.read_ahead import ImageReadAhead  # noqa: PLC0415

    def read(rows):
        return rows[:, None, None].astype(np.float32) * np.ones((1, 2, 2), np.float32)

    reader = ImageReadAhead(read, np.arange(40), 40, 4, ahead_blocks=2, threads=2)
    try:
        first = [reader.next(wait=True) for _ in range(2)]  # the bound held the threads at 2 blocks ahead...
        reader.then(lambda images: ("stepped", images))  # ...so at most 2 more were started before this
        rest = []
        while (item := reader.next(wait=True)) is not None:
            rest.append(item)
    finally:
        reader.stop()
    stepped = [isinstance(images, tuple) for _, images in rest]
    assert not any(isinstance(images, tuple) for _, images in first)
    assert sum(stepped) >= len(rest) - 2 and stepped == sorted(stepped)  # once the step is given, every later one
    rows = np.concatenate([r for r, _ in first + rest])
    np.testing.assert_array_equal(rows, np.arange(40))
    for r, images in rest:
        np.testing.assert_array_equal((images[1] if isinstance(images, tuple) else images)[:, 0, 0], r)


def test_a_reader_upload_is_left_out_without_a_store_on_the_gpu(tmp_path):
    """ParticleSet.read_ahead gives its reader the upload only for a store on a GPU: a host store's blocks stay
    NumPy arrays, and images() returns the disk's images."""
    ps = load_particle_set(_copy_sample(tmp_path / "d"), ctf=True, halves=False)
    ps.keep_images_in_memory()
    calls = []
    ps.read_ahead(np.arange(len(ps)), threads=2, upload=lambda a: calls.append(1) or a)
    got = ps.images(np.arange(len(ps)))
    ps.stop_reading()
    assert calls == []
    np.testing.assert_array_equal(got, load_images(ps.table))
