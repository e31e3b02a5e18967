"""Mean purity and changed-class curves over seeds, ours against RELION (issue 16), from vs_relion.py result JSONs.

Each JSON is one class3d run of one program (``vs_relion.py run --job class3d --sides ours|relion``) with its
per-iteration ``purity`` and ``changed``. Patterns take {K} and {seed}; a seed whose file is missing for either
program is left out of both. Writes per K the seeds used, both programs' curves per seed, their means per iteration
and the difference of the means at each iteration, with the seed-to-seed standard error of that difference.

Run:
  python benchmarks/class3d_seed_means.py --seeds 1-8 --K 2,4 \
      --ours 'results/class3d_p60_ours_K{K}_s{seed}_relion_draws_h200.json' \
      --relion 'results/class3d_p60_relion_K{K}_s{seed}_h100.json,results/class3d_p60_relion_K{K}_s{seed}_h200.json' \
      --out results/class3d_p60_seed_means_h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def _seeds(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def _load(patterns: str, side: str, K: int, seed: int) -> dict | None:
    """The first existing file among the comma-separated patterns."""
    for pat in patterns.split(","):
        path = Path(pat.format(K=K, seed=seed))
        if path.is_file():
            return json.loads(path.read_text())[side]
    return None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1-8")
    ap.add_argument("--K", default="2,4")
    ap.add_argument("--ours", required=True)
    ap.add_argument("--relion", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    res: dict = {}
    for K in (int(k) for k in a.K.split(",")):
        runs = {s: (_load(a.ours, "ours", K, s), _load(a.relion, "relion", K, s)) for s in _seeds(a.seeds)}
        runs = {s: r for s, r in runs.items() if r[0] and r[1]}
        n = min(min(len(o["purity"]), len(r["purity"])) for o, r in runs.values())
        P = {side: np.array([runs[s][i]["purity"][:n] for s in runs]) for i, side in enumerate(("ours", "relion"))}
        C = {side: np.array([[np.nan if c is None else c for c in runs[s][i]["changed"][:n]] for s in runs])
             for i, side in enumerate(("ours", "relion"))}
        d = P["ours"] - P["relion"]
        sem = d.std(axis=0, ddof=1) / np.sqrt(len(runs)) if len(runs) > 1 else np.full(n, np.nan)
        res[f"K{K}"] = {"seeds": list(runs), "purity": {k: v.tolist() for k, v in P.items()},
                        "changed": {k: v.tolist() for k, v in C.items()},
                        "mean_purity": {k: v.mean(axis=0).tolist() for k, v in P.items()},
                        "mean_changed": {k: [None if np.isnan(v[:, i]).all() else float(np.nanmean(v[:, i]))
                                             for i in range(n)] for k, v in C.items()},
                        "mean_difference": d.mean(axis=0).tolist(), "sem_difference": sem.tolist()}
        print(f"K={K}, seeds {list(runs)}")
        for it in sorted({4, 9, 14, 19, n - 1}):
            if it < n:
                print(f"  iteration {it + 1:2d}: purity ours {P['ours'][:, it].mean():.4f}, RELION "
                      f"{P['relion'][:, it].mean():.4f}, difference {d[:, it].mean():+.4f} +- {sem[it]:.4f}")
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
