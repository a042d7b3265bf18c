"""Bounds that steer the stage search: the bottleneck lower bound, a Lagrangian bound on the
latency sum, and the relaxed DP (memory ignored, cheapest config per range and submesh).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .problem import _INF, StageProblem
from .tables import (
    _Choices,
    _fewest_devices,
    _Frame,
    _frame,
    _no_slicing,
    _Prepared,
    _Probe,
    _probe_from,
    _range_matrix,
    _select,
    _shortest_slicing,
    _strided_windows,
    _useful,
)


def _bottleneck_lower_bound(prep: _Prepared, problem: StageProblem) -> tuple[float, float]:
    """Smallest ``t`` with a slicing whose fewest-devices submeshes (all ``<= t``) fit.

    Every feasible slicing with max stage ``t`` gives each range at least its fewest devices
    that run it within ``t`` and uses exactly ``N * M`` devices in all, so the optimum's max
    stage is ``>=`` this bound. Returns ``(bound, fewest devices of any slicing)``; the bound
    is ``inf`` when even that fewest-devices slicing needs more than the cluster has.
    """
    num_layers = problem.num_layers
    sizes = problem.submesh_sizes.astype(np.float64)
    total = problem.num_devices

    def fewest(t: float) -> float:
        nmin = _fewest_devices(prep, sizes, t)
        return _shortest_slicing(_range_matrix(num_layers, prep.iu, prep.ju, nmin, _INF))

    values = prep.reach_lo[np.isfinite(prep.reach_lo)]
    if values.size == 0:
        return _INF, _INF
    most = fewest(float(values.max()))
    if most > total:
        return _INF, most
    # Bisect on the candidate values by repeated median selection (O(n) total work):
    # fewest(lo) > total (lo = -inf stands for "below every value"), fewest(hi) <= total.
    lo, hi = -_INF, float(values.max())
    pool = values
    while True:
        pool = pool[(pool > lo) & (pool < hi)]
        if pool.size == 0:
            return hi, most
        mid = float(np.partition(pool, pool.size // 2)[pool.size // 2])
        if fewest(mid) <= total:
            hi = mid
        else:
            lo = mid


def _lagrangian_sum_bound(prep: _Prepared, problem: StageProblem) -> float:
    """Lower bound on the least latency sum of any feasible slicing (any ``t_max``).

    For any price ``lam`` per device, ``min over slicings of sum(cost + lam * size) - lam*N*M``
    is a lower bound (the device equation holds on feasible slicings; memory is relaxed).
    The bound is concave in ``lam``; bisection on the sign of its slope finds a good price.
    """
    cmin = prep.cmin
    finite = cmin[np.isfinite(cmin)]
    if finite.size == 0:
        return 0.0
    num_layers = problem.num_layers
    sizes = problem.submesh_sizes.astype(np.float64)
    total = float(problem.num_devices)
    rows = np.arange(cmin.shape[0])
    best_bound = 0.0
    lo, hi = -2.0 * float(finite.max()) - 1.0, 2.0 * float(finite.max()) + 1.0
    for _ in range(24):
        lam = 0.5 * (lo + hi)
        priced = cmin + lam * sizes[None, :]
        arg = np.argmin(priced, axis=1)
        weight = _range_matrix(num_layers, prep.iu, prep.ju, priced[rows, arg], _INF)
        used_w = _range_matrix(num_layers, prep.iu, prep.ju, sizes[arg], 0.0)
        # shortest path, tracking the devices of the chosen path for the slope
        best = np.full(num_layers + 1, _INF)
        used = np.zeros(num_layers + 1)
        best[num_layers] = 0.0
        for k in range(num_layers - 1, -1, -1):
            cand = weight[k, k:] + best[k + 1 :]
            a = int(np.argmin(cand))
            best[k] = cand[a]
            used[k] = used_w[k, k + a] + used[k + a + 1]
        if not math.isfinite(best[0]):
            return 0.0
        # guard against rounding: never claim more than is certainly true
        bound = float(best[0]) - lam * total - 1e-9 * (abs(float(best[0])) + abs(lam) * total)
        best_bound = max(best_bound, bound)
        if used[0] > total:
            lo = lam
        elif used[0] < total:
            hi = lam
        else:
            break
    return best_bound


#: Elements gathered at once in the inner DP (bounds the temporaries, keeps them in cache).
_BLOCK_ELEMS = 1 << 17


_BIG_COUNT = np.int32(1 << 30)


def _relax_rows(
    val_view: np.ndarray,
    cnt_view: np.ndarray | None,
    ids: np.ndarray,
    off: np.ndarray,
    cost: np.ndarray,
) -> tuple[np.ndarray, np.ndarray | None]:
    """One DP step for a batch of rows: ``out[r, x] = min_e cost[e] + src[ids[r, e], off[e]+x]``.

    ``ids`` is ``(rows, choices)``: the source row of every choice for every output row;
    ``val_view[row, o]`` is the window of that source row starting at column ``o``. With
    ``cnt_view``, also returns the least stage count among the choices reaching the minimum.
    """
    num_out, num_choices = ids.shape
    w = val_view.shape[2]
    step = max(1, _BLOCK_ELEMS // (w * num_out))
    best = best_cnt = None
    for q in range(0, num_choices, step):
        blk = slice(q, q + step)
        vals = val_view[ids[:, blk], off[None, blk]]  # (rows, choices, w)
        vals += cost[None, blk, None]
        low = vals.min(axis=1)
        cnt = None
        if cnt_view is not None:
            tie = vals == low[:, None, :]
            cnt = np.where(tie, cnt_view[ids[:, blk], off[None, blk]], _BIG_COUNT).min(axis=1)
        if best is None:
            best, best_cnt = low, cnt
            continue
        if cnt is not None:
            assert best_cnt is not None
            merged = np.where(low == best, np.minimum(cnt, best_cnt), best_cnt)
            best_cnt = np.where(low < best, cnt, merged)
        best = np.minimum(best, low)
    assert best is not None
    return best, best_cnt


@dataclass
class _RelaxedTables:
    """Memory-free DP tables at one ``t`` (cheapest config per range and submesh).

    ``suffix[k, pad + d]``: least sum of layers ``k..L-1`` on exactly ``d`` units;
    ``prefix[k, pad + u]``: least sum of layers ``0..k-1`` on exactly ``u`` units. Both are
    lower bounds for the memory-aware DP, which uses them to skip hopeless states.
    """

    frame: _Frame
    suffix: np.ndarray
    prefix: np.ndarray | None = None


def _relaxed_dp(
    prep: _Prepared, choices: _Choices, problem: StageProblem, t: float
) -> tuple[_Probe, _RelaxedTables | None]:
    """Least latency sum with every stage ``<= t``, memory limits ignored (one row per k)."""
    num_layers = problem.num_layers
    frame = _frame(prep, problem, t)
    sel = None if frame is None else _select(choices, frame, t, num_layers)
    if frame is None or sel is None:
        return _no_slicing(t), None
    pad = frame.pad
    rows = np.full((num_layers + 1, frame.width), np.inf)
    rows[num_layers, pad] = 0.0  # nothing left on 0 devices
    views: dict[int, np.ndarray] = {}
    for k in range(num_layers - 1, -1, -1):
        a, b = sel.ptr[k], sel.ptr[k + 1]
        if a == b:
            continue
        lo, hi = int(frame.lo[k]), int(frame.hi[k])
        w = hi - lo + 1
        if w not in views:
            views[w] = _strided_windows(rows, w)
        # rows[j + 1, d - size] for d = lo..hi, plus the stage's cost, least over choices
        low, _ = _relax_rows(
            views[w], None, sel.nxt[None, a:b], pad + lo - sel.size[a:b], sel.cost[a:b]
        )
        rows[k, pad + lo : pad + hi + 1] = low[0]
    g = float(rows[0, pad + frame.total_u])
    if not math.isfinite(g):
        return _no_slicing(t), None
    picked: list[int] = []
    k, d = 0, frame.total_u
    while k < num_layers:
        a, b = sel.ptr[k], sel.ptr[k + 1]
        vals = sel.cost[a:b] + rows[sel.nxt[a:b], pad + d - sel.size[a:b]]
        e = a + int(np.argmin(vals))
        picked.append(e)
        k, d = int(sel.nxt[e]), d - int(sel.size[e])
    later = np.arange(len(picked) - 1, -1, -1)
    memory_ok = bool(np.all(later <= sel.msc[picked]))
    return _probe_from(choices, sel.idx[picked], t, g, memory_ok), _RelaxedTables(frame, rows)


def _relaxed_prefix(
    choices: _Choices, by_end: np.ndarray, tables: _RelaxedTables, t: float, num_layers: int
) -> np.ndarray:
    """``prefix[k, pad + u]`` of :class:`_RelaxedTables`: the same DP run forward.

    ``by_end`` orders ``choices`` by last layer. Prefix ``0..k-1`` keeps ``N*M - d`` units
    for the suffix, so its window is ``N*M - hi[k] .. N*M - lo[k]``.
    """
    frame = tables.frame
    pad, total_u = frame.pad, frame.total_u
    idx = by_end[choices.cost[by_end] <= t]
    start, nxt = choices.start[idx], choices.end[idx] + 1
    size = choices.size[idx] // frame.unit
    keep = _useful(start, nxt, size, frame.lo, frame.hi)
    start, nxt, size, cost = start[keep], nxt[keep], size[keep], choices.cost[idx[keep]]
    ptr = np.searchsorted(nxt, np.arange(num_layers + 2))
    rows = np.full((num_layers + 1, frame.width), np.inf)
    rows[0, pad] = 0.0  # no layer yet on 0 devices
    views: dict[int, np.ndarray] = {}
    for k in range(1, num_layers + 1):
        a, b = ptr[k], ptr[k + 1]
        if a == b or frame.lo[k] > frame.hi[k]:
            continue
        lo, hi = total_u - int(frame.hi[k]), total_u - int(frame.lo[k])
        w = hi - lo + 1
        if w not in views:
            views[w] = _strided_windows(rows, w)
        low, _ = _relax_rows(views[w], None, start[None, a:b], pad + lo - size[a:b], cost[a:b])
        rows[k, pad + lo : pad + hi + 1] = low[0]
    return rows
