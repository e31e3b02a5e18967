"""Read a py-spy speedscope profile (benchmarks/cold_profile.sh: every thread, idle samples included): each thread's
seconds by what it was doing, and one thread's timeline in windows (the package's deepest frame and the leaf frame
most sampled in each).

    python benchmarks/speedscope_summary.py profile_profiled_cold.json                 # every thread's totals
    python benchmarks/speedscope_summary.py profile_profiled_cold.json --thread 2750 --window 0.1 --start 3.6 --end 8

Each thread's samples start at its own first sample, so only the main thread's times are the process's.
"""

from __future__ import annotations

import argparse
import collections
import json

#: What a sample is counted as: the first of these found anywhere in its stack, else its leaf frame.
KINDS = ("_compile_with_cache_cuda", "_get_cufft_plan_nd", "asnumpy", "importlib._bootstrap>", "_exec_fft",
         "matmul", "sort", "cumsum", "acquire", "wait")


def _names(frames: list[dict], sample: list[int]) -> list[str]:
    return [f"{frames[i]['name']}:{frames[i].get('file', '').split('/')[-1]}" for i in sample]


def totals(doc: dict, thread: str | None, start: float, end: float, top: int) -> None:
    frames = doc["shared"]["frames"]
    for p in doc["profiles"]:
        if thread is not None and thread not in p["name"]:
            continue
        t, counts, total = 0.0, collections.Counter(), 0.0
        for sample, w in zip(p["samples"], p["weights"], strict=True):
            if start <= t < end:
                names = _names(frames, sample)
                kind = next((k for k in KINDS if any(k in n for n in names)), "other: " + (names[-1] if names else "-"))
                counts[kind] += w
                total += w
            t += w
        print(f"{p['name']}: {total:.2f} s")
        for kind, s in counts.most_common(top):
            print(f"  {s:6.2f} {kind}")


def timeline(doc: dict, thread: str, window: float, start: float, end: float) -> None:
    frames = doc["shared"]["frames"]
    for p in doc["profiles"]:
        if thread not in p["name"]:
            continue
        t, buckets = 0.0, collections.defaultdict(list)
        for sample, w in zip(p["samples"], p["weights"], strict=True):
            if start <= t < end:
                buckets[int(t / window)].append(sample)
            t += w
        for b in sorted(buckets):
            def what(sample: list[int]) -> str:
                ours = [f"{frames[i]['name']}@{frames[i].get('file', '').split('src/')[-1]}" for i in sample
                        if "napari_gpu_relion" in frames[i].get("file", "")]
                names = _names(frames, sample)
                return f"{ours[-1] if ours else '-'} | {names[-1] if names else '-'}"
            common = collections.Counter(what(s) for s in buckets[b]).most_common(2)
            print(f"{b * window:6.2f} n={len(buckets[b]):3d} " + " || ".join(f"{k} x{v}" for k, v in common))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("profile")
    ap.add_argument("--thread", help="part of a thread's name (py-spy: 'Thread <id> \"<name>\"')")
    ap.add_argument("--window", type=float, help="with --thread: its timeline in windows of this many seconds")
    ap.add_argument("--start", type=float, default=0.0)
    ap.add_argument("--end", type=float, default=1e9)
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args()
    with open(a.profile) as fh:
        doc = json.load(fh)
    if a.window and a.thread:
        timeline(doc, a.thread, a.window, a.start, a.end)
    else:
        totals(doc, a.thread, a.start, a.end, a.top)


if __name__ == "__main__":
    main()
