"""How alike the classes of a 3D classification are: what a user needs to judge the number of classes."""

from __future__ import annotations

import numpy as np


def class_report(refs: list[np.ndarray], pdf_class: np.ndarray, mask: np.ndarray, empty_below: float = 0.01) -> str:
    """Empty classes (< ``empty_below`` of the particles) and the most alike pair of the others by real-space
    correlation inside the particle mask (a state split over two classes gives a pair that correlates better
    than any two different states)."""
    K = len(refs)
    empty = [k + 1 for k in range(K) if pdf_class[k] < empty_below]
    live = [k for k in range(K) if pdf_class[k] >= empty_below]
    parts = [f"empty class(es): {', '.join(map(str, empty))}" if empty else "no empty class"]
    if len(live) >= 2:
        v = np.stack([(np.asarray(refs[k], np.float64) * mask)[mask > 0] for k in live])
        v -= v.mean(axis=1, keepdims=True)
        v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-30)
        c = v @ v.T
        pairs = [(c[a, b], live[a] + 1, live[b] + 1) for a in range(len(live)) for b in range(a + 1, len(live))]
        cc, a, b = max(pairs)
        parts.append(f"most alike: classes {a} and {b} (map correlation {cc:.3f}"
                     + (f"; the least alike pair {min(pairs)[0]:.3f})" if len(pairs) > 1 else ")"))
    return "; ".join(parts)
