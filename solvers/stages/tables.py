"""The stage DP's tables, prepared once per problem: configs dominated within a (range, submesh)
dropped, ``max_succ`` capped, device counts in units of the usable submesh sizes' gcd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .problem import _INF, StageProblem


@dataclass
class _Choices:
    """Flat (range, submesh, config) stage choices with finite cost, grouped by first layer.

    ``msc`` is the stage's ``max_succ`` capped at what could ever be asked of it (see
    :func:`_prepare`); ``size`` is the submesh's device count.
    """

    start: np.ndarray
    end: np.ndarray
    mesh: np.ndarray
    config: np.ndarray
    size: np.ndarray
    cost: np.ndarray
    msc: np.ndarray

    def below(self, t: float) -> _Choices:
        """The choices with ``cost <= t`` (grouping preserved)."""
        keep = np.flatnonzero(self.cost <= t)
        return _Choices(*(getattr(self, f)[keep] for f in _CHOICE_FIELDS))


_CHOICE_FIELDS = ("start", "end", "mesh", "config", "size", "cost", "msc")


@dataclass
class _Prepared:
    """Everything :func:`solve_stages` derives once from the problem.

    ``exact`` keeps every undominated config; ``relaxed`` one cheapest config per (range,
    submesh) and is used with memory limits ignored. The ``(P, S)`` arrays are per range
    ``p = (iu[p], ju[p])`` of the upper triangle, memory ignored, for the relaxations.
    """

    exact: _Choices
    relaxed: _Choices
    iu: np.ndarray
    ju: np.ndarray
    cmin: np.ndarray  # cheapest config of range p on submesh s
    reach_lo: np.ndarray  # min over submeshes s' <= s of cmin (nonincreasing in s)
    reach_hi: np.ndarray  # min over submeshes s' >= s of cmin (nondecreasing in s)
    col_min: np.ndarray  # (S,) cheapest stage of any range on submesh s


def _prepare(problem: StageProblem) -> _Prepared:
    """Collapse configs and flatten the cost table (see :class:`_Prepared`)."""
    num_layers = problem.num_layers
    total = problem.num_devices
    sizes = problem.submesh_sizes
    num_configs = problem.num_configs
    iu, ju = np.triu_indices(num_layers)  # ranges in start-major order
    # (C, P, S): one contiguous (range, submesh) table per config
    costs = np.moveaxis(problem.cost, 3, 0)[:, iu, ju]
    # A stage ending at layer j is followed by at most L-1-j stages (one layer each) and at most
    # N*M - size stages (one device each), so max_succ above that bound never binds: capping is
    # exact, and it makes many configs comparable (two configs that both never bind tie).
    cap = np.minimum((num_layers - 1 - ju)[:, None], (total - sizes)[None, :])
    mscs = np.minimum(np.moveaxis(problem.max_succ, 3, 0)[:, iu, ju], cap[None])

    # cheapest config per (range, submesh); among equally cheap ones the most tolerant
    cmin, best_ms = costs[0].copy(), mscs[0].copy()
    best_c = np.zeros(cmin.shape, dtype=np.int64)
    for c in range(1, num_configs):
        better = (costs[c] < cmin) | ((costs[c] == cmin) & (mscs[c] > best_ms))
        cmin = np.where(better, costs[c], cmin)
        best_ms = np.where(better, mscs[c], best_ms)
        best_c[better] = c

    # Config c is dominated when another config is no more expensive and tolerates no fewer
    # later stages (strictly better in one, or a full tie broken by lower index). For every
    # (t, required later stages) the cheapest admissible config is then never dominated, since
    # domination is a strict partial order and the dominator is admissible whenever c is.
    keep = np.isfinite(costs)
    for c in range(num_configs):
        for c2 in range(c + 1, num_configs):
            c2_le, c_le = costs[c2] <= costs[c], costs[c] <= costs[c2]
            c2_ge, c_ge = mscs[c2] >= mscs[c], mscs[c] >= mscs[c2]
            keep[c] &= ~(c2_le & c2_ge & ~(c_le & c_ge))  # c2 strictly better than c
            keep[c2] &= ~(c_le & c_ge)  # c at least as good as c2 (full ties: lower index)
    p, s, c = np.nonzero(np.moveaxis(keep, 0, 2))  # (p, s, c) order: grouped by start
    exact = _Choices(iu[p], ju[p], s, c, sizes[s], costs[c, p, s], mscs[c, p, s])
    p, s = np.nonzero(np.isfinite(cmin))
    relaxed = _Choices(iu[p], ju[p], s, best_c[p, s], sizes[s], cmin[p, s], best_ms[p, s])
    return _Prepared(
        exact=exact,
        relaxed=relaxed,
        iu=iu,
        ju=ju,
        cmin=cmin,
        reach_lo=np.minimum.accumulate(cmin, axis=1),
        reach_hi=np.ascontiguousarray(np.minimum.accumulate(cmin[:, ::-1], axis=1)[:, ::-1]),
        col_min=cmin.min(axis=0),
    )


def _range_matrix(
    num_layers: int, iu: np.ndarray, ju: np.ndarray, values: np.ndarray, fill: float
) -> np.ndarray:
    """``(L, L)`` matrix with ``values`` on the upper triangle and ``fill`` elsewhere."""
    out = np.full((num_layers, num_layers), fill)
    out[iu, ju] = values
    return out


def _fewest_devices(prep: _Prepared, sizes: np.ndarray, t: float) -> np.ndarray:
    """Per range: fewest devices of a submesh running it within ``t`` (``inf``: none)."""
    slow = np.count_nonzero(prep.reach_lo > t, axis=1)
    return np.where(slow < sizes.size, sizes[np.minimum(slow, sizes.size - 1)], np.inf)


def _most_devices(prep: _Prepared, sizes: np.ndarray, t: float) -> np.ndarray:
    """Per range: most devices of a submesh running it within ``t`` (``-inf``: none)."""
    last = np.count_nonzero(prep.reach_hi <= t, axis=1) - 1
    return np.where(last >= 0, sizes[np.maximum(last, 0)], -np.inf)


def _shortest_slicing(weight: np.ndarray) -> float:
    """Least sum of ``weight[i, j]`` over slicings of all layers into ranges (DAG path)."""
    num_layers = weight.shape[0]
    best = np.full(num_layers + 1, _INF)
    best[num_layers] = 0.0
    for k in range(num_layers - 1, -1, -1):
        best[k] = np.min(weight[k, k:] + best[k + 1 :])
    return float(best[0])


@dataclass
class _Probe:
    """Result of one inner DP at ``t``.

    ``g`` is the least latency sum with every stage ``<= t`` and ``choices`` a slicing reaching
    it (``(start, end, submesh, config)`` per stage). When ``g`` is ``inf``, ``lower`` says what
    is known: ``inf`` means no slicing exists; a finite value means the DP was cut at that sum
    (every slicing sums to more). ``memory_ok`` says whether the slicing meets every memory
    limit (always true for the memory-aware DP).
    """

    t: float
    g: float
    choices: tuple[tuple[int, int, int, int], ...]
    t_actual: float  # max latency of that slicing (<= t)
    memory_ok: bool
    lower: float = _INF

    @property
    def feasible(self) -> bool:
        """Whether the probe found a slicing."""
        return math.isfinite(self.g)


def _no_slicing(t: float, lower: float = _INF) -> _Probe:
    return _Probe(t, _INF, (), _INF, False, lower)


def _strided_windows(rows: np.ndarray, w: int) -> np.ndarray:
    """Read-only view ``out[row, o] = rows[row, o:o + w]`` (a cheap sliding window)."""
    s0, s1 = rows.strides
    return np.lib.stride_tricks.as_strided(
        rows,
        shape=(rows.shape[0], rows.shape[1] - w + 1, w),
        strides=(s0, s1, s1),
        writeable=False,
    )


def _useful(
    start: np.ndarray, nxt: np.ndarray, size: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> np.ndarray:
    """Mask of the choices (first layer, layer after the last, size) that can join a window
    state at ``start`` to one at ``nxt`` (sizes and windows in the same unit)."""
    alive = lo <= hi
    return alive[start] & alive[nxt] & (size >= lo[start] - hi[nxt]) & (size <= hi[start] - lo[nxt])


@dataclass
class _Frame:
    """What bounds the inner DP at one ``t``: device unit and per-layer device windows.

    Device counts are kept in units of ``unit``, the gcd of the submesh sizes usable within
    ``t`` (every count reachable from ``N * M`` is a multiple of it). ``lo[k]..hi[k]`` (units)
    are the devices that layers ``k..L-1`` can have in a full-cluster slicing: the fewest /
    most devices of a suffix slicing, intersected with ``N * M`` minus the most / fewest of a
    prefix slicing (memory relaxed). States outside lie on no slicing that uses exactly
    ``N * M`` devices. ``lo > hi`` marks a dead layer.
    """

    unit: int
    total_u: int
    lo: np.ndarray
    hi: np.ndarray
    nmin: np.ndarray  # (L, L) fewest devices of a submesh running range i..j within t
    nmax: np.ndarray  # (L, L) most devices of such a submesh

    @property
    def pad(self) -> int:
        """Left padding of every table row, so that ``d - size`` never indexes below 0."""
        return self.total_u

    @property
    def width(self) -> int:
        """Columns of a table row: the padding, then ``d = 0..N*M`` (units)."""
        return 2 * self.total_u + 1


def _device_windows(
    prep: _Prepared, problem: StageProblem, t: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Device windows of :class:`_Frame` in devices (unrounded), with ``nmin`` and ``nmax``."""
    num_layers = problem.num_layers
    total = problem.num_devices
    sizes = problem.submesh_sizes.astype(np.float64)
    nmin = _range_matrix(num_layers, prep.iu, prep.ju, _fewest_devices(prep, sizes, t), _INF)
    nmax = _range_matrix(num_layers, prep.iu, prep.ju, _most_devices(prep, sizes, t), -_INF)
    # shortest paths over layers for min and max at once (max x = -min -x): prefix 0..j and
    # suffix k..L-1, fewest (row 0) and most (row 1) devices
    both = np.stack([nmin, -nmax])
    pre = np.full((2, num_layers + 1), _INF)
    suf = np.full((2, num_layers + 1), _INF)
    pre[:, 0] = suf[:, num_layers] = 0.0
    for j in range(num_layers):
        pre[:, j + 1] = (pre[:, : j + 1] + both[:, : j + 1, j]).min(axis=1)
        k = num_layers - 1 - j
        suf[:, k] = (both[:, k, k:] + suf[:, k + 1 :]).min(axis=1)
    lo = np.maximum(np.maximum(suf[0], total + pre[1]), 0.0)
    hi = np.minimum(np.minimum(-suf[1], total - pre[0]), float(total))
    return lo, hi, nmin, nmax


def _frame(prep: _Prepared, problem: StageProblem, t: float) -> _Frame | None:
    """The :class:`_Frame` at ``t``, or ``None`` when it already proves no slicing exists."""
    total = problem.num_devices
    usable = prep.col_min <= t
    if not usable.any():
        return None
    unit = int(np.gcd.reduce(problem.submesh_sizes[usable]))
    if total % unit:
        return None
    lo, hi, nmin, nmax = _device_windows(prep, problem, t)
    lo, hi = np.ceil(lo / unit), np.floor(hi / unit)
    total_u = total // unit
    if not lo[0] <= total_u <= hi[0]:
        return None
    alive = lo <= hi
    return _Frame(
        unit,
        total_u,
        np.where(alive, lo, 1).astype(np.int64),
        np.where(alive, hi, 0).astype(np.int64),
        nmin,
        nmax,
    )


@dataclass
class _Selected:
    """The choices of one DP: cost ``<= t`` and able to join two window states."""

    idx: np.ndarray  # indices into the _Choices
    start: np.ndarray
    nxt: np.ndarray  # layer after the stage
    size: np.ndarray  # devices, in frame units
    cost: np.ndarray
    msc: np.ndarray
    ptr: np.ndarray  # choices with first layer k are ptr[k]:ptr[k + 1]


def _select(choices: _Choices, frame: _Frame, t: float, num_layers: int) -> _Selected | None:
    """Choices usable at ``t`` within ``frame`` (``None`` when there are none)."""
    idx = np.flatnonzero(choices.cost <= t)
    start = choices.start[idx]
    nxt = choices.end[idx] + 1
    size = choices.size[idx] // frame.unit
    keep = _useful(start, nxt, size, frame.lo, frame.hi)
    idx = idx[keep]
    if idx.size == 0:
        return None
    start = start[keep]
    return _Selected(
        idx,
        start,
        nxt[keep],
        size[keep],
        choices.cost[idx],
        choices.msc[idx],
        np.searchsorted(start, np.arange(num_layers + 1)),
    )


def _probe_from(choices: _Choices, idx: np.ndarray, t: float, g: float, memory_ok: bool) -> _Probe:
    """A :class:`_Probe` for the choices ``idx`` (first stage first)."""
    picked = tuple(
        (int(choices.start[e]), int(choices.end[e]), int(choices.mesh[e]), int(choices.config[e]))
        for e in idx
    )
    return _Probe(t, g, picked, float(choices.cost[idx].max()), memory_ok)
