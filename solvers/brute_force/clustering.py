"""Exhaustive reference for :func:`alpa_mini.solvers.layer_clustering.cluster_layers`.

Enumerates every set of ``L - 1`` boundaries (``itertools.combinations``), keeps the balanced
ones and returns the minimum of the same lexicographic key: (max cut bytes, max layer flops,
left-to-right sum of cut bytes, boundary positions). Only for tiny instances (tests).
"""

from __future__ import annotations

import itertools

import numpy as np
from numpy.typing import ArrayLike

from ..layer_clustering import LayerClustering, balance_limit, evaluate_clustering

__all__ = ["brute_force_clustering"]


def brute_force_clustering(
    flops: ArrayLike, cut_bytes: ArrayLike, num_layers: int, eps: float
) -> LayerClustering | None:
    """Optimal clustering by exhaustive search, or ``None`` when none is balanced."""
    f = np.asarray(flops, dtype=np.float64)
    c = np.asarray(cut_bytes, dtype=np.float64)
    n = f.shape[0]
    prefix = np.concatenate(([0.0], np.cumsum(f)))
    limit = balance_limit(float(prefix[n]), num_layers, eps)
    best_key: tuple[float, float, float, tuple[int, ...]] | None = None
    for cuts in itertools.combinations(range(n - 1), num_layers - 1):
        bounds = [0, *(k + 1 for k in cuts), n]
        layer_flops = [float(prefix[e] - prefix[s]) for s, e in itertools.pairwise(bounds)]
        if max(layer_flops) > limit:
            continue
        cut_values = [float(c[k]) for k in cuts]
        total_cut = 0.0
        for value in cut_values:
            total_cut += value
        key = (max(cut_values, default=0.0), max(layer_flops), total_cut, cuts)
        if best_key is None or key < best_key:
            best_key = key
    if best_key is None:
        return None
    starts = (0, *(k + 1 for k in best_key[3]))
    return evaluate_clustering(f, c, starts, eps)
