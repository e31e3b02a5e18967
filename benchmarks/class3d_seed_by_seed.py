"""Our class3d runs against RELION's, seed by seed (issue 16): with RELION's own random draws (the sampling
perturbation's setup draw only since the forty-fifth session: before it, seeds other than 1 had every perturbation
off RELION's by a constant, 0.035 of a step per seed after 1; the class seeds were RELION's)
(compute/relion_random.py) a seed gives both programs the same class seeds and sampling perturbations, so their
runs can be compared per iteration, not only as means over seeds.

Inputs: our runs (``vs_relion.py run --job class3d --sides ours`` or the class3d command line, any --o rootnames,
each with its K and seed) in the data folder made by ``vs_relion.py make-data`` (truth.star), and RELION's result
JSONs of the same K and seed (``vs_relion.py run --sides relion``). Writes per seed and iteration: the class sizes
(sorted), purity, fraction of particles that changed class, for both; and where a RELION run folder is given, the
fraction of particles in the same class as RELION's at each iteration both have.

Run (CPU or GPU machine):
  python benchmarks/class3d_seed_by_seed.py --data /tmp/p60 \
      --ours K2:1:/tmp/exp/k2s1/run,K2:2:/tmp/exp/k2s2/run \
      --relion_json 'benchmarks/results/class3d_p60_relion_K{K}_s{seed}_h100.json' \
      [--relion_run K2:1:/tmp/p60/relion_class3d_k2s1/run] --out benchmarks/results/x.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_relion  # noqa: E402


def _runs(spec: str) -> dict[tuple[int, int], Path]:
    out = {}
    for item in filter(None, spec.split(",")):
        k, seed, root = item.split(":", 2)
        out[(int(k.lstrip("K")), int(seed))] = Path(root)
    return out


def _classes_per_iteration(root: Path, names) -> dict[int, np.ndarray]:
    out = {}
    for f in sorted(root.parent.glob(root.name + "_it*_data.star")):
        it = int(re.search(r"_it(\d{3})_", f.name).group(1))
        if it:
            out[it] = vs_relion.particles_of(f).set_index("rlnImageName").loc[names, "rlnClassNumber"].to_numpy()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--ours", required=True, help="K<k>:<seed>:<rootname>,...")
    ap.add_argument("--relion_json", required=True, help="path pattern with {K} and {seed}")
    ap.add_argument("--relion_run", default="", help="K<k>:<seed>:<RELION rootname>,... (per-particle comparison)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    truth = vs_relion.particles_of(Path(a.data) / "truth.star").set_index("rlnImageName")
    relion_runs = _runs(a.relion_run)
    res: dict = {"data": a.data, "seeds": {}}
    for (K, seed), root in sorted(_runs(a.ours).items()):
        ours = vs_relion.evaluate(root, truth, "class3d", 1.0)
        rel = json.loads(Path(a.relion_json.format(K=K, seed=seed)).read_text())
        rel = rel.get("relion", rel)
        n = len(ours["purity"])
        row = {"iterations": n,
               "ours": {"class_sizes": [sorted(c.values()) for c in ours["class_sizes"]],
                        "purity": ours["purity"], "changed": ours["changed"]},
               "relion": {"class_sizes": [sorted(c.values()) for c in rel["class_sizes"][:n]],
                          "purity": rel["purity"][:n], "changed": rel["changed"][:n]}}
        if (K, seed) in relion_runs:
            mine = _classes_per_iteration(root, truth.index)
            theirs = _classes_per_iteration(relion_runs[(K, seed)], truth.index)
            row["same_class_as_relion"] = {it: float((mine[it] == theirs[it]).mean())
                                           for it in sorted(set(mine) & set(theirs))}
        res["seeds"][f"K{K}_s{seed}"] = row
        print(f"K={K} seed {seed}: smaller classes ours {row['ours']['class_sizes']}\n"
              f"                RELION {row['relion']['class_sizes']}\n"
              f"  purity ours {np.round(row['ours']['purity'], 3).tolist()}\n"
              f"       RELION {np.round(row['relion']['purity'], 3).tolist()}", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
