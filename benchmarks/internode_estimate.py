"""What the sums between ranks of an EM job would cost over a network between nodes (issue 47, "Nodes"), from the
bytes each rank sent in a measured run on one host (the job's log: "iteration N per rank: ..., sent A / B MB").

A rank's bytes per iteration are two kinds (jobs/em.py, runtime/distributed.py):
- the finished maps. Logs before the forty-second session gathered them as a sum over the ranks of a zero-filled
  array of every class's map (K maps of box^3 float32 whatever the rank count): an allreduce of ``maps`` bytes.
  Since then each rank sends its own block once (gather_items, allgather_rows), K/2 maps on 2 ranks: give
  ``--maps_by allgather`` for such a log;
- each class's accumulator block (the part insertion reaches) reduced to the class's owner rank, one class after
  another: a rank sends its partial block of every class it does not own. With two ranks that is K/2 blocks, so
  the K blocks together are twice (sent - maps).
On n nodes joined by one link of L Gb/s each (one rank per node, ring collectives): an allreduce of P bytes sends
2 P (n-1)/n per rank; in a ring reduce every rank but the root sends the whole block, so the busiest rank (the one
owning fewest classes, ceil(K/n) at most and none when n > K) sends (K - floor(K/n)) blocks. The time is the
busiest rank's bytes over L/8 GB/s (the link's full rate: a lower bound). The iteration's work on n nodes is the
2-rank E-step times 2/n (the particles split evenly; the work every rank repeats, all references and coarse
projections, does not shrink, so the work is taken too short and the transfer's share too high) plus the 2-rank
M-step times ceil(K/n) / ceil(K/2) (each rank reconstructs its
own classes). The maps' allgather sends (n-1) ceil(K/n) maps per rank (NCCL's allgather takes equal parts, so the
parts are the largest owner block); ``transfer_s_maps_by_sum`` is the former sum's figure.

    python benchmarks/internode_estimate.py --log results/class3d_..._n2_....log --K 6 --box 256 --nodes 2,8 \
        --link_gbps 100 --out results/internode_estimate_....json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

PER_RANK = re.compile(r"iteration (\d+) per rank: .*?E-step ([\d.]+) / ([\d.]+) s.*?sent ([\d.]+) / ([\d.]+) MB")
TIMING = re.compile(r"iteration (\d+) timing: E-step ([\d.]+) s.*?M-step ([\d.]+) s")


def read_log(text: str) -> dict[int, dict]:
    """Per iteration of a 2-rank run: the most bytes a rank sent, the E-step (the job's, with the wait) and M-step."""
    its: dict[int, dict] = {}
    for m in PER_RANK.finditer(text):
        its.setdefault(int(m[1]), {})["sent_bytes"] = max(float(m[4]), float(m[5])) * 1e6
    for m in TIMING.finditer(text):
        its.setdefault(int(m[1]), {}).update(estep_s=float(m[2]), mstep_s=float(m[3]))
    return {k: v for k, v in sorted(its.items()) if {"sent_bytes", "estep_s", "mstep_s"} <= set(v)}


def estimate(it: dict, maps_bytes: float, K: int, nodes: int, link_gbps: float, maps_by: str = "sum") -> dict:
    """One iteration on ``nodes`` nodes from its 2-rank figures (K classes, maps_bytes for all K maps; ``maps_by``:
    how the logged run gathered the maps, "sum" (all K maps counted per rank) or "allgather" (its own K/2))."""
    counted = maps_bytes if maps_by == "sum" else maps_bytes * -(-K // 2) / K
    block = 2.0 * max(it["sent_bytes"] - counted, 0.0) / K  # one class's accumulator block
    maps_wire = 2 * maps_bytes * (nodes - 1) / nodes
    blocks_wire = (K - K // nodes) * block
    one_map = maps_bytes / K
    allgather_wire = (nodes - 1) * -(-K // nodes) * one_map
    rate = link_gbps / 8 * 1e9  # bytes per second
    work = it["estep_s"] * 2 / nodes + it["mstep_s"] * -(-K // nodes) / -(-K // 2)
    wire = allgather_wire + blocks_wire  # the maps as the jobs gather them now (gather_items)
    return {"nodes": nodes, "sent_per_rank_GB": round(wire / 1e9, 3), "transfer_s": round(wire / rate, 3),
            "work_s": round(work, 3), "transfer_of_work": round(wire / rate / work, 3),
            "transfer_s_maps_by_sum": round((maps_wire + blocks_wire) / rate, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--log", required=True, help="the job's log of a 2-rank run")
    ap.add_argument("--K", type=int, required=True, help="classes (2 halves of auto-refine: 1 each)")
    ap.add_argument("--box", type=int, required=True)
    ap.add_argument("--nodes", default="2,8")
    ap.add_argument("--link_gbps", type=float, default=100.0)
    ap.add_argument("--maps_by", choices=("sum", "allgather"), default="sum",
                    help="how the logged run gathered the maps (allgather from the forty-second session on)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    its = read_log(Path(a.log).read_text())
    maps = a.K * a.box ** 3 * 4.0
    rows = []
    for k, it in its.items():
        rows.append({"iteration": k, "sent_2_ranks_MB": round(it["sent_bytes"] / 1e6, 1),
                     "estimates": [estimate(it, maps, a.K, int(n), a.link_gbps, a.maps_by)
                                   for n in a.nodes.split(",")]})
    summary = {}
    for n in a.nodes.split(","):
        got = [e for r in rows for e in r["estimates"] if e["nodes"] == int(n)]
        summary[n] = {"transfer_s": [got[0]["transfer_s"], statistics.median(g["transfer_s"] for g in got),
                                     got[-1]["transfer_s"]],
                      "transfer_of_work": [got[0]["transfer_of_work"],
                                           statistics.median(g["transfer_of_work"] for g in got),
                                           got[-1]["transfer_of_work"]]}
    out = {"log": a.log, "K": a.K, "box": a.box, "link_gbps": a.link_gbps, "maps_MB": round(maps / 1e6, 1),
           "summary (first, median, last iteration)": summary, "iterations": rows}
    print(json.dumps(out["summary (first, median, last iteration)"]))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
