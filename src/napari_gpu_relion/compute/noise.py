"""Counter-based Gaussian noise: each value is a function of (seed, particle, element), so the noise a particle
gets does not depend on which batch (or MPI rank) it is processed in, and NumPy and CuPy draw the same numbers
(integer hashing is exact on both; only the final log/cos round differently, ~1e-16 relative)."""

from __future__ import annotations

import numpy as np

from .backend import get_array_module

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_SEED_MUL = np.uint64(0xD1B54A32D192ED03)


def _splitmix64(x):
    """SplitMix64's output function (Steele, Lea & Flood 2014) on uint64 arrays (wrap-around arithmetic)."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def counter_normal(seed: int, ids, shape: tuple[int, ...], xp=None):
    """(len(ids), *shape) float64 standard normal values; value j of particle ``ids[i]`` depends only on
    (seed, ids[i], j). Box-Muller on two hashed uniforms in (0, 1]."""
    xp = xp if xp is not None else get_array_module(ids)
    n_per = int(np.prod(shape))
    ids = xp.asarray(ids, dtype=np.uint64)
    j = xp.arange(n_per, dtype=np.uint64)
    with np.errstate(over="ignore"):
        base = np.uint64(int(seed) & 0xFFFFFFFFFFFFFFFF) * _SEED_MUL
        counter = (ids[:, None] * np.uint64(n_per) + j[None, :]) * np.uint64(2) + base
        u1 = ((_splitmix64(counter) >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53
        u2 = ((_splitmix64(counter + np.uint64(1)) >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53
    g = xp.sqrt(-2.0 * xp.log(u1)) * xp.cos(2.0 * np.pi * u2)
    return g.reshape((ids.shape[0],) + tuple(shape))
