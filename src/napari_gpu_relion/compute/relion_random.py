"""RELION's random draws, reproduced so that a --random_seed gives what RELION draws with that seed.

RELION 5 takes its random numbers from the C library and the C++ standard library, seeded in fixed ways:

* the sampling perturbation (HealpixSampling::resetRandomlyPerturbedSampling): one draw when the sampling is set up
  and one per iteration after ``srand(random_seed + iteration)``, each of ``rnd_unif(0.25, 0.5)`` (float
  arithmetic), added to the previous value and wrapped into [-0.5, 0.5]. The setup draw comes before RELION seeds
  the C library (MlOptimiser::initialiseGeneral sets up the sampling; initialiseWorkLoad then calls
  ``init_random_generator(random_seed)``), so it is glibc's first ``rand()`` in its default state, ``srand(1)``'s,
  for every seed: RELION 5.0.1's run_it000_sampling.star holds 0.460047 with --random_seed 1, 2, 3 and 4;
* the class seeds of 3D classification (iteration 1, or 2 after --firstiter_cc): the particles are put in a random
  order by ``std::shuffle`` with ``std::mt19937(random_seed + iteration)`` (Experiment::randomiseParticlesOrder),
  and the particle at position p of that order searches only class ``rand() % K`` after ``srand(random_seed + p)``.

The C library is glibc's ``rand()`` (the additive feedback generator of degree 31 that ``srandom`` sets up), the C++
one libstdc++'s ``std::shuffle`` (two swap positions from one draw while n^2 fits the generator's range) and its
``uniform_int_distribution`` (Lemire's multiply-and-reject with a 32-bit generator), as on the Linux builds RELION
runs from. Checked against glibc itself and against a RELION 5.0.1 run's own files (tests/test_relion_random.py).

Why: with RELION's draws our 3D classification follows RELION's run of the same seed (class sizes within 2 % for
six iterations, benchmarks/README.md), so results can be compared seed for seed. RELION's seeds are not
independent draws: seed s + 1 uses the same rand() sequence as seed s shifted by one particle (class seeds) and one
iteration (perturbations).
"""

from __future__ import annotations

import numpy as np

RAND_MAX = 2147483647
PERTURBATION_FACTOR = 0.5  # RELION's --perturb default


def glibc_first_rand(seeds) -> np.ndarray:
    """The first ``rand()`` of glibc after ``srand(seed)``, for each seed (unsigned 32-bit), as int64.

    glibc's TYPE_3 generator: r0 = seed (1 for 0), r_i = 16807 r_{i-1} mod (2^31 - 1) for i < 31 (Schrage's
    method on signed 32-bit words), r_i = r_{i-31} for i = 31..33, r_i = r_{i-31} + r_{i-3} mod 2^32 beyond; the
    k-th output is r_{k+344} >> 1 (srandom discards the first 310)."""
    s = np.atleast_1d(np.asarray(seeds, dtype=np.int64)) & 0xFFFFFFFF
    s = np.where(s == 0, 1, s)
    out = np.empty(s.shape, dtype=np.int64)
    for a in range(0, s.size, _CHUNK):  # 31 words per seed at a time: bounded memory for any number of seeds
        out.reshape(-1)[a:a + _CHUNK] = _first_output(s.reshape(-1)[a:a + _CHUNK])
    return out


_CHUNK = 1 << 16


def _first_output(s: np.ndarray) -> np.ndarray:
    """glibc_first_rand for non-zero seeds ``s`` (1-D): the 31 words of the state as a ring, r_i at i mod 31."""
    r = np.empty((31, s.size), dtype=np.int64)
    r[0] = np.where(s >= 1 << 31, s - (1 << 32), s)  # srandom_r's int32_t word
    for i in range(1, 31):
        prev = r[i - 1]
        hi = np.trunc(prev / 127773).astype(np.int64)  # C division truncates towards zero
        lo = prev - hi * 127773
        word = 16807 * lo - 2836 * hi
        r[i] = np.where(word < 0, word + 2147483647, word)
    r &= 0xFFFFFFFF
    # r_31..r_33 = r_0..r_2 leave the ring as it is; from i = 34, r_i = r_{i-31} + r_{i-3}, with r_{i-31} the word
    # the ring holds at i mod 31 (r_31..r_33 being r_0..r_2)
    for i in range(34, 345):
        r[i % 31] = (r[i % 31] + r[(i - 3) % 31]) & 0xFFFFFFFF
    return r[344 % 31] >> 1


def rnd_unif(first_rand, a: float, b: float) -> np.ndarray:
    """RELION's rnd_unif(a, b) from a rand() value, in its float (32-bit) arithmetic:
    a + float(rand()) / float(RAND_MAX / (b - a))."""
    a32, b32 = np.float32(a), np.float32(b)
    den = np.float32(np.float32(RAND_MAX) / (b32 - a32))
    return a32 + np.asarray(first_rand).astype(np.float32) / den


def wrap_perturbation(x: float, factor: float = PERTURBATION_FACTOR) -> float:
    """RELION's realWRAP(x, -factor, factor): x moved by whole periods into the closed interval."""
    lo, hi = -factor, factor
    period = hi - lo
    if lo <= x <= hi:
        return float(x)
    if x < lo:
        return float(x + period * (1 + np.floor((lo - x) / period)))
    return float(x - period * (1 + np.floor((x - hi) / period)))


#: The C library's seed when RELION draws the setup perturbation: none set yet, which glibc treats as srand(1).
UNSEEDED = 1


def perturbation_step(seed: int, iteration: int, factor: float = PERTURBATION_FACTOR) -> float:
    """What RELION adds to the perturbation at ``iteration``: rnd_unif(factor/2, factor) after srand(seed +
    iteration); at 0 (the setup draw) from the unseeded C library, the same for every seed."""
    first = glibc_first_rand([UNSEEDED if int(iteration) == 0 else int(seed) + int(iteration)])[0]
    return float(rnd_unif(first, 0.5 * factor, factor))


def next_perturbation(previous: float, seed: int, iteration: int, factor: float = PERTURBATION_FACTOR) -> float:
    """RELION's perturbation at ``iteration`` from the previous one (0 before the setup draw of iteration 0), in
    sampling steps, in [-factor, factor]."""
    return wrap_perturbation(float(previous) + perturbation_step(seed, iteration, factor), factor)


class _MT19937:
    """std::mt19937 seeded with one integer (its 32-bit outputs), via NumPy's generator with the same seeding."""

    def __init__(self, seed: int):
        self._bg = np.random.MT19937()
        self._bg._legacy_seeding(int(seed) & 0xFFFFFFFF)
        self._buf: list[int] = []

    def __call__(self) -> int:
        if not self._buf:
            self._buf = self._bg.random_raw(4096)[::-1].tolist()
        return self._buf.pop()


def _uniform_int(g: _MT19937, hi: int) -> int:
    """libstdc++'s uniform_int_distribution(0, hi) with a 32-bit generator: Lemire's method."""
    if hi >= 0xFFFFFFFF:
        raise ValueError("ranges beyond 32 bits are not used by RELION's shuffles here")
    n = hi + 1
    product = g() * n
    low = product & 0xFFFFFFFF
    if low < n:
        threshold = ((1 << 32) - n) % n
        while low < threshold:
            product = g() * n
            low = product & 0xFFFFFFFF
    return product >> 32


def relion_particle_order(n: int, seed: int) -> np.ndarray:
    """RELION's random order of n particles (one optics group, no split halves): libstdc++'s std::shuffle of
    0..n-1 with std::mt19937(seed). Returns sorted_idx: the particle at each position."""
    idx = list(range(int(n)))
    if n < 2:
        return np.asarray(idx, dtype=np.int64)
    g = _MT19937(seed)
    if 0xFFFFFFFF // n >= n:  # two swap positions from one draw
        i = 1
        if n % 2 == 0:
            j = _uniform_int(g, 1)
            idx[i], idx[j] = idx[j], idx[i]
            i += 1
        while i != n:
            b0 = i + 1
            x = _uniform_int(g, b0 * (b0 + 1) - 1)
            p1, p2 = divmod(x, b0 + 1)
            idx[i], idx[p1] = idx[p1], idx[i]
            i += 1
            idx[i], idx[p2] = idx[p2], idx[i]
            i += 1
    else:
        for i in range(1, n):
            j = _uniform_int(g, i)
            idx[i], idx[j] = idx[j], idx[i]
    return np.asarray(idx, dtype=np.int64)


def relion_seed_classes(n: int, n_classes: int, seed: int, first_iteration: int = 1) -> np.ndarray:
    """The class (0-based) each of n particles (in the STAR file's order) searches in RELION's seeding iteration
    (1, or 2 after --firstiter_cc): the particle at position p of RELION's random order takes rand() % K after
    srand(seed + p). RELION shuffles once, at the run's first iteration, with std::mt19937(seed + that iteration)."""
    order = relion_particle_order(n, int(seed) + int(first_iteration))
    first = glibc_first_rand(int(seed) + np.arange(n, dtype=np.int64))
    classes = np.empty(n, dtype=np.int64)
    classes[order] = first % int(n_classes)
    return classes
