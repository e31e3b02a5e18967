"""RELION's job-folder names (io/jobdir.py) and the memory plan's arithmetic (compute/backend.plan_memory)."""


from napari_gpu_relion.compute.memory_model import estep_bytes_per_particle
from napari_gpu_relion.io.jobdir import RunFiles, data_for_classes_stack, parse_run_file
from napari_gpu_relion.runtime.memory import BATCH_FRACTION, MAX_BATCH_2D, MAX_BATCH_3D, MAX_BATCH_3D_GPU, plan_memory


def test_run_files_spell_relion_names_under_the_rootname(tmp_path):
    """--o Refine3D/job001/run writes Refine3D/job001/run_it001_..., as relion_refine does; an existing folder
    (or a trailing separator) means <folder>/run."""
    f = RunFiles.from_output(tmp_path / "Refine3D" / "job001" / "run")
    d = tmp_path / "Refine3D" / "job001"
    assert f.folder == d and f.name == "run"
    assert f.data(1) == d / "run_it001_data.star" and f.data() == d / "run_data.star"
    assert f.model(12, half=2) == d / "run_it012_half2_model.star" and f.model(3) == d / "run_it003_model.star"
    assert f.optimiser(7) == d / "run_it007_optimiser.star"
    assert f.class_map(2, 5) == d / "run_it005_class002.mrc"
    assert f.class_map(1, 4, half=1) == d / "run_it004_half1_class001.mrc" and f.class_map(1) == d / "run_class001.mrc"
    assert f.unfiltered_half_map(2) == d / "run_half2_class001_unfil.mrc"
    assert f.classes_stack(25) == d / "run_it025_classes.mrcs"
    assert RunFiles.from_output(str(tmp_path) + "/").root == tmp_path / "run"
    assert RunFiles.from_output(tmp_path).root == tmp_path / "run"  # existing folder
    assert parse_run_file(d / "run_it025_classes.mrcs") == (f, 25, "classes.mrcs")
    assert data_for_classes_stack(d / "run_it025_classes.mrcs") == d / "run_it025_data.star"
    assert data_for_classes_stack(d / "particles.mrcs") is None


def test_run_files_find_complete_iterations_and_the_latest_data(tmp_path):
    f = RunFiles(tmp_path / "run")
    for it in (1, 2, 3):
        f.data(it).write_text("x")
    for it in (1, 2):  # iteration 3 has no optimiser STAR yet: not complete
        f.optimiser(it).write_text("x")
    assert f.iterations() == [1, 2]
    assert f.latest_data() == tmp_path / "run_it003_data.star"
    f.data().write_text("x")
    assert f.latest_data() == tmp_path / "run_data.star"


def test_memory_plan_batch_follows_the_free_memory_and_honours_batch():
    """batch = BATCH_FRACTION x (free - references - accumulators) / bytes per particle, capped; --batch wins."""
    kw = dict(box=64, ndim=3, pad=2, n_references=2, rows_per_particle=4608, translations=21, coarse_pixels=300)
    per = estep_bytes_per_particle(4608, 21, 64, 300)
    grid = 128 * 128 * 65
    fixed = 2 * grid * 8 + 2 * grid * 24
    free = fixed + int(100 * per / BATCH_FRACTION) + 1
    plan = plan_memory(free, **kw)
    assert plan.reference_bytes == 2 * grid * 8 and plan.accumulator_bytes == 2 * grid * 24
    assert plan.bytes_per_particle == per and plan.batch == 100
    assert plan_memory(10**15, **kw).batch == MAX_BATCH_3D_GPU
    assert plan_memory(10**15, adaptive_chunks=False, **kw).batch == MAX_BATCH_3D  # the CPU's cap
    assert plan_memory(10**15, **(kw | {"ndim": 2})).batch == MAX_BATCH_2D
    assert plan_memory(0, **kw).batch == 1  # never 0: one particle at a time, halving on out-of-memory after
    assert plan_memory(free, requested_batch=7, **kw).batch == 7
    assert "batch 100 particles x 4608 orientations x 21 translations" in plan.describe()


def test_fine_chunk_budget_grows_with_free_memory_within_its_bounds():
    from napari_gpu_relion.runtime.memory import CHUNK_BYTES, FINE_CHUNK_FRACTION, MAX_FINE_CHUNK_BYTES, plan_memory

    kw = dict(box=128, ndim=3, pad=2, n_references=2, rows_per_particle=4608, translations=21, coarse_pixels=400)
    small = plan_memory(2 << 30, **kw)
    large = plan_memory(400 << 30, **kw)
    middle = plan_memory(30 << 30, **kw)
    assert small.fine_chunk_bytes == CHUNK_BYTES
    assert large.fine_chunk_bytes == MAX_FINE_CHUNK_BYTES
    left = (30 << 30) - middle.reference_bytes - middle.accumulator_bytes
    assert middle.fine_chunk_bytes == int(FINE_CHUNK_FRACTION * left)
    # 2D classification keeps its own, smaller fraction and bound
    from napari_gpu_relion.runtime.memory import FINE_CHUNK_FRACTION_2D, MAX_FINE_CHUNK_BYTES_2D

    assert plan_memory(400 << 30, **(kw | {"ndim": 2})).fine_chunk_bytes == MAX_FINE_CHUNK_BYTES_2D
    mid2 = plan_memory(30 << 30, **(kw | {"ndim": 2}))
    assert mid2.fine_chunk_bytes == int(FINE_CHUNK_FRACTION_2D * ((30 << 30) - mid2.reference_bytes
                                                                   - mid2.accumulator_bytes))
    # on the CPU the chunk is fixed: the order of the sums, and so the numbers, do not depend on the host's memory
    fixed = {plan_memory(f, adaptive_chunks=False, **kw).fine_chunk_bytes for f in (2 << 30, 30 << 30, 80 << 30)}
    assert fixed == {CHUNK_BYTES}
