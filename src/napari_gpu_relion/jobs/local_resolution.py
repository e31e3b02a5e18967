"""Local resolution of two half maps: ``relion_postprocess --locres`` (RELION's LocalRes job, "Use Relion?").

The same flags as relion_postprocess's --locres mode (``--i``, ``--i2``, ``--o``, ``--mask``, ``--angpix``,
``--adhoc_bfac``, ``--locres_sampling``, ``--locres_maskrad``, ``--locres_edgwidth``, ``--locres_randomize_at``,
``--locres_minres``, ``--filter_edge_width``, ``--random_seed``; ``--locres`` itself is accepted and changes
nothing). ``--o`` is a rootname, as RELION's: its LocalRes job passes ``--o LocalRes/jobNNN/relion``; here an
existing folder given as --o means ``<folder>/relion``. Files written, as RELION names them:

- ``<o>_locres.mrc``: the local resolution (Å) of every voxel (0 where no window reaches);
- ``<o>_locres_filtered.mrc``: the average of the half maps (ad-hoc B-factor applied), locally FSC-weighted and
  low-passed at the local resolution;
- ``<o>_locres_fscs.star``: per window a block ``fsc_kkkkk_iiiii_jjjjj`` (RELION's names and columns), then a
  block ``local_resolution`` with each window's centre (voxel indices) and resolution, which RELION writes as
  free-text lines between the blocks.

The mask (as RELION) is used only to report the local resolutions inside it (> 0.5); RELION also plots their
histogram (``<o>_histogram.eps``, ``histogram.pdf``), which this job does not draw. RELION refuses --auto_bfac
with --locres; --mtf is not supported here. The method and its defaults: compute/local_resolution.py and
docs/local_resolution.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ..compute import local_resolution as LR
from ..compute.fourier import uncached_fft_plans
from ..errors import InputError
from ..events import Finished, MapUpdated, Message, Progress, Started
from ..io.atomic import ensure_not_input
from ..io.mrc import write_mrc
from ..io.star import write_star_blocks
from ..marks import memory_mark
from ..runtime.device import backend_for
from ..runtime.memory import batched_with_oom_retry, free_cached_memory, image_batch
from .common import (
    check_not_another_jobs_files,
    check_output_folder,
    check_pixel_size,
    mrc_bytes,
    param,
    prepare_output,
    require_file,
    write_note,
)
from .postprocess import load_half_maps, second_half  # the same half-map, pixel-size and mask checks

JOB_NAME = "local_resolution"
#: The rootname inside a folder given as --o (RELION's LocalRes job: <job folder>/relion).
DEFAULT_ROOT = "relion"
#: Most windows per batch: on a GPU a batch is one batched FFT (larger amortises launches); on the CPU NumPy gains
#: nothing from a larger one. The memory policy (runtime/memory.image_batch) may choose fewer.
MAX_WINDOWS_GPU = 128
MAX_WINDOWS_CPU = 4
#: The map event of the result: the locally filtered map, its surface coloured by the local resolution.
SURFACE_NAME = "local resolution (Å)"
VALUES_LABEL = "local resolution (Å)"


@dataclass(frozen=True)
class Params:
    i: Path = param(flag="--i", help="First unfiltered half map (e.g. run_half1_class001_unfil.mrc)")
    o: Path = param(flag="--o", help="Output rootname: writes <o>_locres.mrc, <o>_locres_filtered.mrc and "
                    "<o>_locres_fscs.star (RELION's LocalRes job: LocalRes/jobNNN/relion); an existing folder "
                    "means <folder>/relion")
    i2: Path | None = param(None, "--i2", "Second half map (default: --i with 'half1' replaced by 'half2')")
    mask: Path | None = param(None, "--mask", "Mask (values in [0, 1]): only to report the local resolutions "
                              "inside it (> 0.5), as RELION; not used in the calculation")
    angpix: float = param(-1.0, "--angpix", "Pixel size (Å); -1 = from the map header")
    adhoc_bfac: float = param(0.0, "--adhoc_bfac", "B-factor (Å², negative sharpens) of the locally filtered map")
    locres: bool = param(False, "--locres", "Accepted for relion_postprocess --locres command lines (this job "
                         "always estimates local resolution)")
    locres_sampling: float = param(LR.LOCRES_SAMPLING_A, "--locres_sampling", "Distance (Å) between the centres "
                                   "of the local windows (a cubic grid)")
    locres_maskrad: float = param(-1.0, "--locres_maskrad", "Radius (Å) of each window's spherical mask; "
                                  "negative = 0.5 * sampling")
    locres_edgwidth: float = param(-1.0, "--locres_edgwidth", "Width (Å) of the windows' raised-cosine edge; "
                                   "negative = sampling")
    locres_randomize_at: float = param(LR.LOCRES_RANDOMIZE_AT_A, "--locres_randomize_at",
                                       "Randomise phases from this resolution (Å) for the mask correction")
    locres_minres: float = param(LR.LOCRES_MINRES_A, "--locres_minres", "Lowest local resolution reported (Å)")
    filter_edge_width: int = param(LR.FILTER_EDGE_WIDTH, "--filter_edge_width", "Width (shells) of the raised "
                                   "cosine edge of the local low-pass filters")
    random_seed: int = param(0, "--random_seed", "Seed of the phase randomisation")
    cpu: bool = param(False, "--cpu", "Run on the CPU (NumPy) even if a GPU is present")
    gpu: str | None = param(None, "--gpu", "GPU index (default: the first GPU, if any)")

    def half2(self) -> Path:
        return second_half(self.i, self.i2)

    def rootname(self) -> Path:
        o = Path(self.o)
        return o / DEFAULT_ROOT if o.is_dir() else o

    def outputs(self) -> dict[str, Path]:
        root = self.rootname()
        return {"locres": root.with_name(root.name + "_locres.mrc"),
                "locres_filtered": root.with_name(root.name + "_locres_filtered.mrc"),
                "locres_fscs": root.with_name(root.name + "_locres_fscs.star")}

    def __post_init__(self):
        require_file(self.i, "--i half map", (".mrc", ".map"))
        require_file(self.half2(), "--i2 half map", (".mrc", ".map"))
        if self.mask is not None:
            require_file(self.mask, "--mask", (".mrc", ".map"))
        if self.o is None:
            raise InputError("--o output rootname is required")
        check_output_folder(self.rootname().parent, "--o")
        check_pixel_size(self.angpix, "--angpix", "the map header")
        for flag, v in (("--locres_sampling", self.locres_sampling), ("--locres_randomize_at",
                                                                     self.locres_randomize_at),
                        ("--locres_minres", self.locres_minres)):
            if not v > 0:
                raise InputError(f"{flag} must be a positive number of Å, got {v:g}")
        if self.filter_edge_width < 0:
            raise InputError(f"--filter_edge_width must be 0 or more shells, got {self.filter_edge_width}")
        for path in self.outputs().values():
            ensure_not_input(path, self.i, self.half2(), self.mask)


def _fsc_blocks(res: LR.LocresResult) -> dict[str, pd.DataFrame]:
    """RELION's _locres_fscs.star blocks (one per window, its names and columns), then the windows' table."""
    g = res.geometry
    N, apix = g.box, g.angpix
    i = np.arange(g.n_shells)
    ang = np.where(i > 0, N * apix / np.maximum(i, 1), 999.0)
    unmasked = res.fsc_unmasked.copy()
    if unmasked[0] <= 0:  # calculateFSCtrue sets it so before RELION writes it
        unmasked[0] = 1.0
    blocks: dict[str, pd.DataFrame] = {}
    for w, name in enumerate(g.names):
        fm, fr = res.fsc_masked[w].copy(), res.fsc_random[w].copy()
        fm[0] = 1.0 if fm[0] <= 0 else fm[0]
        fr[0] = 1.0 if fr[0] <= 0 else fr[0]
        blocks[name] = pd.DataFrame({
            "rlnSpectralIndex": i, "rlnResolution": 1.0 / ang, "rlnAngstromResolution": ang,
            "rlnFourierShellCorrelationCorrected": res.fsc_true[w],
            "rlnFourierShellCorrelationUnmaskedMaps": unmasked,
            "rlnFourierShellCorrelationMaskedMaps": fm,
            "rlnCorrectedFourierShellCorrelationPhaseRandomizedMaskedMaps": fr})
    z, y, x = g.centres.T
    blocks["local_resolution"] = pd.DataFrame({"rlnCoordinateX": x, "rlnCoordinateY": y, "rlnCoordinateZ": z,
                                               "rlnAngstromResolution": res.resolution})
    return blocks


def write_outputs(outputs: dict[str, Path], res: LR.LocresResult, apix: float) -> dict[str, Path]:
    """The two maps and the FSC STAR, written at the same time on three threads (each atomically): the maps'
    header statistics and bytes to the disk release Python's lock, so the STAR's formatting runs beside them
    (box 256: 0.60 s one after the other on the H200 machine, benchmarks/profile_locres.py)."""
    with ThreadPoolExecutor(3, thread_name_prefix="locres-write") as pool:
        futures = {"locres": pool.submit(write_mrc, outputs["locres"], res.locres, apix),
                   "locres_filtered": pool.submit(write_mrc, outputs["locres_filtered"], res.filtered, apix),
                   "locres_fscs": pool.submit(lambda: write_star_blocks(outputs["locres_fscs"], _fsc_blocks(res)))}
    # all three have ended (each file written whole or not at all): the first error is raised, naming the others
    errors = [e for e in (f.exception() for f in futures.values()) if e is not None]
    if errors:
        for other in errors[1:]:
            errors[0].add_note(f"another output failed too: {type(other).__name__}: {other}")
        raise errors[0]
    return {name: f.result() for name, f in futures.items()}


def summary_line(locres: np.ndarray, mask: np.ndarray | None, resolution: np.ndarray) -> str:
    """The local resolutions inside the mask (> 0.5; else where a window reached) and over the windows."""
    inside = locres[mask > 0.5] if mask is not None else locres[locres > 0]
    where = "inside the mask" if mask is not None else "where windows reach"
    if inside.size == 0:
        return f"no voxel {where}"
    q = np.percentile(inside, [5, 50, 95])
    return (f"local resolution {where}: median {q[1]:.2f} Å (5-95 %: {q[0]:.2f}-{q[2]:.2f} Å); windows "
            f"{resolution.min():.2f}-{resolution.max():.2f} Å")


def run(p: Params) -> Iterator:
    v1, v2, apix, mask = load_half_maps(p)
    N = v1.shape[0]
    g = LR.locres_geometry(N, apix, p.locres_sampling, p.locres_maskrad, p.locres_edgwidth,
                           p.locres_randomize_at)
    if g.n_windows == 0:
        raise InputError(f"no local-resolution window fits the {N}³ box at {apix:.3f} Å/px: the window radius "
                         f"{g.mask_radius} px (--locres_maskrad) leaves no centre inside N/2 - radius")
    outputs = p.outputs()
    folder = outputs["locres"].parent
    check_not_another_jobs_files(folder, JOB_NAME, [q for q in outputs.values() if q.exists()])
    be = backend_for(p)
    star_bytes = (g.n_windows + 1) * (g.n_shells * 120 + 1024)
    notes = prepare_output(folder, 2 * mrc_bytes(N, N, N) + star_bytes + 64 * 1024, "the local-resolution maps")
    rand_A = N * apix / g.randomize_shell if g.randomize_shell > 0 else float("inf")
    yield Started(JOB_NAME, folder, be.name,
                  f"local resolution of {N}³ half maps at {apix:.3f} Å/px in {g.n_windows} windows (every "
                  f"{g.step} px, mask radius {g.mask_radius} px + edge {g.edge_width} px, phases randomised "
                  f"beyond {rand_A:.2f} Å)")
    yield from notes
    if g.randomize_shell < 1:
        yield Message(f"--locres_randomize_at {p.locres_randomize_at:g} Å is beyond the box ({N * apix:.1f} Å): "
                      "every phase is randomised (as RELION)", "warning")
    folder.mkdir(parents=True, exist_ok=True)
    write_note(folder, JOB_NAME, p)
    K = g.n_windows
    with uncached_fft_plans(be.xp):
        lr = LR.LocalResolution(v1, v2, g, be.xp, bfactor=p.adhoc_bfac, minres=p.locres_minres,
                                filter_edge_width=p.filter_edge_width, seed=p.random_seed)
        memory_mark("local_resolution: half maps held")
        batch = image_batch(be.free_bytes(), LR.BYTES_PER_WINDOW_VOXEL * N ** 3, K,
                            most=MAX_WINDOWS_GPU if be.is_gpu else MAX_WINDOWS_CPU)
        for ev in batched_with_oom_retry(K, batch, lr.add_windows, be):
            if isinstance(ev, Message):
                yield ev
            else:
                yield Progress(ev[0], K, "windows")
        memory_mark("local_resolution: windows")
        res = lr.result()
    del lr
    free_cached_memory(be)
    paths = write_outputs(outputs, res, apix)
    # the filtered map's surface coloured by the local resolution (the viewer's LocalRes view; 0 Å: no window)
    yield MapUpdated(SURFACE_NAME, res.filtered, apix, paths["locres_filtered"], surface_values=res.locres,
                     values_mask=mask, values_label=VALUES_LABEL, values_path=paths["locres"], values_missing=0.0)
    yield Finished(paths, summary_line(res.locres, mask, res.resolution))
