"""The memory-aware inner DP: the least latency sum over slicings whose stages all take at most
``t`` and whose stages each tolerate the stages after them under 1F1B memory.
"""

from __future__ import annotations

import math

import numpy as np

from .bounds import _BIG_COUNT, _relax_rows, _relaxed_dp, _RelaxedTables
from .problem import _INF, StageProblem
from .tables import (
    _Choices,
    _Frame,
    _frame,
    _no_slicing,
    _Prepared,
    _Probe,
    _probe_from,
    _select,
    _strided_windows,
)


def _memory_dp(
    prep: _Prepared,
    choices: _Choices,
    problem: StageProblem,
    t: float,
    bound: tuple[_RelaxedTables, float] | None = None,
) -> _Probe:
    """Least latency sum with every stage ``<= t`` and every memory limit met.

    Long because the table's rows, stage counts and row aliases are one vectorised state
    that its build and the walk back share; the pieces that stand alone (frames, row
    relaxation, probes) live in ``tables`` and ``bounds``.

    State ``(k, r, d)``: layers ``k..L-1`` on exactly ``d`` units in at most ``r`` stages. A
    stage on ``k..j`` that tolerates ``ms`` later stages leads to ``(j + 1, min(r - 1, ms),
    d - size)``; "at most" rather than "exactly" ``r`` stages is exact because fewer later
    stages only relax the memory limits of earlier stages. Besides the frame (unit, windows),
    rows with a finite stage limit are built only where they can differ from the unlimited
    row (see below).

    ``bound = (tables, cut)``: relaxed prefix/suffix tables at the same ``t`` and a sum
    ``cut``. A state whose relaxed prefix + suffix exceeds ``cut`` lies on no slicing summing
    to ``<= cut``, so it is dropped: the result is exact when ``g <= cut``; otherwise the
    probe only says ``g > cut`` (``lower = cut``).
    """
    num_layers = problem.num_layers
    cut = _INF
    if bound is None:
        frame = _frame(prep, problem, t)
        if frame is None:
            return _no_slicing(t)
    else:
        tables, cut = bound
        assert tables.prefix is not None
        frame = tables.frame
        pad, total_u = frame.pad, frame.total_u
        cols = np.arange(total_u + 1)
        # relaxed best sum of a full slicing through (k, d), per k and d (inf outside windows)
        through = tables.suffix[:, pad:] + tables.prefix[:, pad + total_u - cols]
        slack = cut + 1e-9 * (abs(cut) + 1.0)  # never drop a state because of rounding
        ok = through <= slack
        ok &= (cols >= frame.lo[:, None]) & (cols <= frame.hi[:, None])
        any_ok = ok.any(axis=1)
        lo = np.where(any_ok, np.argmax(ok, axis=1), 1)
        hi = np.where(any_ok, total_u - np.argmax(ok[:, ::-1], axis=1), 0)
        if not (lo[0] <= total_u <= hi[0]):
            return _no_slicing(t, cut)
        frame = _Frame(frame.unit, total_u, lo, hi, frame.nmin, frame.nmax)
    sel = _select(choices, frame, t, num_layers)
    if sel is None:
        return _no_slicing(t, cut)
    unit, pad, total_u = frame.unit, frame.pad, frame.total_u
    ptr, nxt_k, size_u, cost, msc = sel.ptr, sel.nxt, sel.size, sel.cost, sel.msc

    # fewest / most devices of a slicing of k..L-1 into exactly s stages, and from them the
    # stage counts a slicing from k within the window can have (below smin_k: infeasible)
    min_dev = np.full((num_layers + 1, num_layers + 1), _INF)
    max_dev = np.full((num_layers + 1, num_layers + 1), -_INF)
    min_dev[num_layers, 0] = max_dev[num_layers, 0] = 0.0
    for k in range(num_layers - 1, -1, -1):
        min_dev[k, 1:] = np.min(frame.nmin[k, k:, None] + min_dev[k + 1 :, :-1], axis=0)
        max_dev[k, 1:] = np.max(frame.nmax[k, k:, None] + max_dev[k + 1 :, :-1], axis=0)
    fits = (min_dev <= (frame.hi * unit)[:, None]) & (max_dev >= (frame.lo * unit)[:, None])
    fits[:num_layers, 0] = False
    alive = (frame.lo <= frame.hi) & fits.any(axis=1)
    counts = np.arange(num_layers + 1)
    smin = np.where(alive, np.where(fits, counts, num_layers + 1).min(axis=1), num_layers + 1)

    # --- the table. Level UNL = "no limit on the stage count" (memory limits only). Rows
    # (k, r) for a finite r exist only for smin_k <= r < R_k: R_k is the largest stage count,
    # over the window, of the fewest-stage optimal slicing of (k, UNL, d); for r >= R_k that
    # slicing also has <= r stages, so row (k, r) equals row (k, UNL) exactly; below smin_k
    # the row is infeasible. Each row keeps, next to its values, that fewest stage count of an
    # optimal slicing (value ties broken by count): it gives R_k and lets the walk back respect
    # the limits of aliased rows. Per k, the UNL row is built first (it gives R_k), then every
    # finite level in one vectorised batch.
    unl = num_layers + 1
    big = _BIG_COUNT
    rows = np.full((4 * num_layers + 8, frame.width), np.inf)
    cnts = np.full(rows.shape, big, dtype=np.int32)
    row_of = np.full((num_layers + 1, unl + 1), -1, dtype=np.int64)
    dead_row = 0  # row 0 stays all-inf: the source of every infeasible transition
    base = 1
    rows[base, pad] = 0.0
    cnts[base, pad] = 0
    row_of[num_layers, :] = base  # k = L: nothing left, any stage limit is fine
    num_rows = 2
    limit_of = np.zeros(num_layers + 1, dtype=np.int64)  # R_k
    views: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def source_rows(k: int, levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Canonical level and row of every (level at k, choice at k) pair, shape (R, P)."""
        a, b = ptr[k], ptr[k + 1]
        after = np.where(levels == unl, num_layers, levels - 1)  # stages allowed after k
        nl = np.minimum(after[:, None], msc[None, a:b])
        pos = np.broadcast_to(nxt_k[None, a:b], nl.shape)
        lvl = np.where(nl >= limit_of[pos], unl, nl)
        ids = np.where((lvl != unl) & (lvl < smin[pos]), dead_row, row_of[pos, lvl])
        return lvl, ids

    def build(k: int, levels: np.ndarray) -> None:
        nonlocal rows, cnts, num_rows
        while num_rows + levels.size > rows.shape[0]:
            rows = np.concatenate([rows, np.full_like(rows, np.inf)])
            cnts = np.concatenate([cnts, np.full_like(cnts, big)])
            views.clear()
        a, b = ptr[k], ptr[k + 1]
        lo, hi = int(frame.lo[k]), int(frame.hi[k])
        w = hi - lo + 1
        if w not in views:
            views[w] = (_strided_windows(rows, w), _strided_windows(cnts, w))
        _, ids = source_rows(k, levels)
        off = pad + lo - size_u[a:b]  # column of d - size at d = lo
        best_val, stage_cnt = _relax_rows(*views[w], ids, off, cost[a:b])
        assert stage_cnt is not None
        new = np.arange(num_rows, num_rows + levels.size)
        num_rows += levels.size
        rows[new, pad + lo : pad + hi + 1] = best_val
        cnts[new, pad + lo : pad + hi + 1] = np.where(np.isfinite(best_val), stage_cnt + 1, big)
        row_of[k, levels] = new

    for k in range(num_layers - 1, -1, -1):
        if not alive[k] or ptr[k] == ptr[k + 1]:
            row_of[k, unl] = dead_row  # R_k = 0: every level aliases to this all-inf row
            continue
        build(k, np.array([unl]))
        row = row_of[k, unl]
        finite_cnt = cnts[row][np.isfinite(rows[row])]
        limit_of[k] = int(finite_cnt.max()) if finite_cnt.size else 0
        if smin[k] < limit_of[k]:
            build(k, np.arange(smin[k], limit_of[k]))

    g = float(rows[row_of[0, unl], pad + total_u])
    if not math.isfinite(g):
        return _no_slicing(t, cut)

    # --- walk the table forward (value ties broken by stage count) to recover the slicing
    k, level, d = 0, unl, total_u
    picked = []
    while k < num_layers:
        a, b = ptr[k], ptr[k + 1]
        row = row_of[k, level]
        lvl, ids = (x[0] for x in source_rows(k, np.array([level])))
        col = pad + d - size_u[a:b]
        vals = cost[a:b] + rows[ids, col]
        ok = (vals == rows[row, pad + d]) & (cnts[ids, col] + 1 == cnts[row, pad + d])
        if not ok.any():  # pragma: no cover - the table is self-consistent by construction
            raise AssertionError("stage DP reconstruction lost the optimum")
        e = a + int(np.argmax(ok))
        picked.append(e)
        k, level, d = int(nxt_k[e]), int(lvl[e - a]), d - int(size_u[e])
    res = _probe_from(choices, sel.idx[picked], t, g, memory_ok=True)
    if g > cut:  # a slicing, but maybe not the best one: only g(t) > cut is certain
        res.lower = cut
    return res


def _infeasible_reason(prep: _Prepared, problem: StageProblem, min_devices: float) -> str:
    """Why no slicing exists, in words, for :class:`InfeasibleError`."""
    total = problem.num_devices
    covered = np.zeros(problem.num_layers, dtype=bool)
    finite = np.isfinite(prep.cmin).any(axis=1)
    for i, j in zip(prep.iu[finite].tolist(), prep.ju[finite].tolist(), strict=True):
        covered[i : j + 1] = True
    if not covered.all():
        layer = int(np.flatnonzero(~covered)[0])
        return f"layer {layer} is in no stage with a finite cost on any submesh and config"
    if min_devices > total:
        return (
            f"every slicing needs at least {min_devices:g} devices but the cluster has "
            f"{problem.num_hosts}x{problem.devices_per_host} = {total}"
        )
    top = float(prep.relaxed.cost.max())
    if not _relaxed_dp(prep, prep.relaxed, problem, top)[0].feasible:
        return (
            f"no slicing's submesh device counts sum to exactly {problem.num_hosts}x"
            f"{problem.devices_per_host} = {total} devices"
        )
    return (
        "every slicing that uses all devices violates a 1F1B memory limit (max_succ: some stage "
        "is followed by more stages than it can hold)"
    )
