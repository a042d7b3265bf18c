"""Operator clustering into layers (DESIGN 5.3).

A traced training step is a sequence of ``n`` equations in program order. ``flops[k]`` is the
compute of equation ``k`` and ``cut_bytes[k]`` (length ``n - 1``) the bytes of tensors that
cross a boundary placed between equations ``k`` and ``k + 1``. :func:`cluster_layers` splits
the sequence into exactly ``L`` contiguous, non-empty layers whose flops are each at most
:func:`balance_limit` (``(1 + eps) * total / L``, plus a 1e-9 relative slack for rounding) and
picks, among those, the clustering that is smallest in this lexicographic order
(the *tie-break rule*; :mod:`.brute_force.clustering` applies the same order):

1. the largest ``cut_bytes`` over the ``L - 1`` chosen boundaries (0 when ``L == 1``);
2. the largest layer flops (balance: a fat layer bounds the best stage time the stage DP can
   reach, whereas only some layer boundaries become stage boundaries);
3. the sum of ``cut_bytes`` over the chosen boundaries;
4. the boundary positions themselves, lexicographically earliest.

Definitions that both solvers share, so results compare exactly: the flops of layer
``[s, e)`` are ``P[e] - P[s]`` with ``P = [0, cumsum(flops)]`` in float64, and the reported sum
of cut bytes is the left-to-right float64 sum. With integer-valued inputs (below 2**53) every
comparison is exact; with fractional byte counts the DP adds cuts in another order, so sums
that tie in exact arithmetic may be ordered by rounding.

Algorithm (all steps exact, proofs in the comments):

* the optimal max cut ``T*`` is the smallest distinct ``cut_bytes`` value ``T`` for which
  "``L`` balanced layers using only boundaries with ``cut_bytes <= T``" is feasible, found by
  binary search (feasibility is monotone in ``T``; each check is a greedy, see
  :func:`_min_layers`);
* the optimal max layer flops ``F*`` under ``T*`` by bisection on the float64 bit patterns with
  the same greedy check (at most 64 checks, each ``O(L log n)``);
* the minimal sum of cut bytes with layers ``<= F*`` and boundaries ``<= T*`` by a suffix DP
  over (layers, position) with vectorised sparse-table window minima, and the
  lexicographically earliest optimal boundaries by a forward walk through that table.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from .errors import InfeasibleError, SolverInputError

__all__ = [
    "BALANCE_RTOL",
    "LayerClustering",
    "LayerCountSearch",
    "balance_limit",
    "cluster_layers",
    "cut_bytes_from_tensors",
    "evaluate_clustering",
    "search_num_layers",
]

#: Relative slack added to the balance limit so that exactly balanced clusterings of
#: fractional flops are not rejected because of prefix-sum rounding.
BALANCE_RTOL = 1e-9

_ULP = float(np.finfo(np.float64).eps)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class LayerClustering:
    """One clustering of ``num_equations`` equations into contiguous layers and its costs.

    ``layer_starts[i]`` is the first equation of layer ``i`` (``layer_starts[0] == 0``);
    layer ``i`` covers ``[layer_starts[i], layer_starts[i + 1])``. ``boundary_cut_bytes[i]`` is
    the cut between layer ``i`` and ``i + 1`` (``cut_bytes[layer_starts[i + 1] - 1]``).
    """

    layer_starts: tuple[int, ...]
    num_equations: int
    layer_flops: tuple[float, ...]
    boundary_cut_bytes: tuple[float, ...]
    max_cut_bytes: float
    sum_cut_bytes: float
    max_layer_flops: float
    total_flops: float
    balance_limit: float
    eps: float

    @property
    def num_layers(self) -> int:
        """Number of layers ``L``."""
        return len(self.layer_starts)

    @property
    def layer_ranges(self) -> tuple[tuple[int, int], ...]:
        """Half-open equation ranges ``(start, end)`` of every layer."""
        ends = (*self.layer_starts[1:], self.num_equations)
        return tuple(zip(self.layer_starts, ends, strict=True))

    @property
    def cut_positions(self) -> tuple[int, ...]:
        """Boundary positions ``k`` (cut between equation ``k`` and ``k + 1``), ascending."""
        return tuple(s - 1 for s in self.layer_starts[1:])

    @property
    def is_balanced(self) -> bool:
        """Whether every layer's flops are within :attr:`balance_limit`."""
        return self.max_layer_flops <= self.balance_limit

    def equation_layers(self) -> np.ndarray:
        """Layer index of every equation, shape ``(num_equations,)``."""
        marks = np.zeros(self.num_equations, dtype=np.int64)
        marks[list(self.layer_starts[1:])] = 1
        return np.cumsum(marks)

    def objective(self) -> tuple[float, float, float, tuple[int, ...]]:
        """The lexicographic key that :func:`cluster_layers` minimises (see module doc)."""
        return (self.max_cut_bytes, self.max_layer_flops, self.sum_cut_bytes, self.cut_positions)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (tuples become lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def to_json(self) -> str:
        """JSON text; :meth:`from_json` reads it back to an equal object."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerClustering:
        """Inverse of :meth:`to_dict`."""
        return cls(
            layer_starts=tuple(int(s) for s in data["layer_starts"]),
            num_equations=int(data["num_equations"]),
            layer_flops=tuple(float(x) for x in data["layer_flops"]),
            boundary_cut_bytes=tuple(float(x) for x in data["boundary_cut_bytes"]),
            max_cut_bytes=float(data["max_cut_bytes"]),
            sum_cut_bytes=float(data["sum_cut_bytes"]),
            max_layer_flops=float(data["max_layer_flops"]),
            total_flops=float(data["total_flops"]),
            balance_limit=float(data["balance_limit"]),
            eps=float(data["eps"]),
        )

    @classmethod
    def from_json(cls, text: str) -> LayerClustering:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))


@dataclass(frozen=True)
class LayerCountSearch:
    """Every candidate layer count evaluated by :func:`search_num_layers` and the one chosen.

    ``results[i]`` is the optimal clustering for ``candidates[i]`` or ``None`` when that count
    is infeasible, with the reason in ``failures[i]``. ``reference_max_cut_bytes`` is the
    smallest max cut among feasible candidates with at least two layers (``nan`` if none).
    """

    candidates: tuple[int, ...]
    results: tuple[LayerClustering | None, ...]
    failures: tuple[str | None, ...]
    chosen_num_layers: int
    reference_max_cut_bytes: float
    cut_tolerance: float
    eps: float

    @property
    def chosen(self) -> LayerClustering:
        """The clustering for :attr:`chosen_num_layers`."""
        result = self.results[self.candidates.index(self.chosen_num_layers)]
        assert result is not None
        return result

    def rows(self) -> list[dict[str, Any]]:
        """One summary dict per candidate, for tables and notebooks."""
        rows = []
        for num_layers, result, failure in zip(
            self.candidates, self.results, self.failures, strict=True
        ):
            row: dict[str, Any] = {"num_layers": num_layers, "feasible": result is not None}
            if result is not None:
                row.update(
                    max_cut_bytes=result.max_cut_bytes,
                    sum_cut_bytes=result.sum_cut_bytes,
                    max_layer_flops=result.max_layer_flops,
                )
            else:
                row["reason"] = failure
            row["chosen"] = num_layers == self.chosen_num_layers
            rows.append(row)
        return rows

    def to_json(self) -> str:
        """JSON text; :meth:`from_json` reads it back to an equal object."""
        ref = self.reference_max_cut_bytes
        return json.dumps(
            {
                "candidates": list(self.candidates),
                "results": [None if r is None else r.to_dict() for r in self.results],
                "failures": list(self.failures),
                "chosen_num_layers": self.chosen_num_layers,
                "reference_max_cut_bytes": None if math.isnan(ref) else ref,
                "cut_tolerance": self.cut_tolerance,
                "eps": self.eps,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> LayerCountSearch:
        """Inverse of :meth:`to_json`."""
        data = json.loads(text)
        ref = data["reference_max_cut_bytes"]
        return cls(
            candidates=tuple(int(c) for c in data["candidates"]),
            results=tuple(
                None if r is None else LayerClustering.from_dict(r) for r in data["results"]
            ),
            failures=tuple(data["failures"]),
            chosen_num_layers=int(data["chosen_num_layers"]),
            reference_max_cut_bytes=math.nan if ref is None else float(ref),
            cut_tolerance=float(data["cut_tolerance"]),
            eps=float(data["eps"]),
        )


# --------------------------------------------------------------------------- validation


def _vector(name: str, values: ArrayLike, length: int | None = None) -> np.ndarray:
    """1-D float64 copy of ``values``; finite and >= 0 everywhere, else SolverInputError."""
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise SolverInputError(f"{name} must be a 1-D sequence of numbers: {err}") from err
    if arr.ndim != 1:
        raise SolverInputError(f"{name} must be 1-D, got shape {arr.shape}")
    if length is not None and arr.shape[0] != length:
        raise SolverInputError(f"{name} must have length {length}, got {arr.shape[0]}")
    bad = np.flatnonzero(~np.isfinite(arr) | (arr < 0))
    if bad.size:
        i = int(bad[0])
        raise SolverInputError(
            f"{name}[{i}] = {float(arr[i])!r} is invalid: values must be finite and >= 0"
        )
    return arr


def _int_arg(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise SolverInputError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise SolverInputError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _nonneg_float(name: str, value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError) as err:
        raise SolverInputError(f"{name} must be a finite number >= 0, got {value!r}") from err
    if not math.isfinite(out) or out < 0:
        raise SolverInputError(f"{name} must be a finite number >= 0, got {value!r}")
    return out


def _inputs(
    flops: ArrayLike, cut_bytes: ArrayLike, num_layers: Any, eps: Any
) -> tuple[np.ndarray, np.ndarray, int, float]:
    f = _vector("flops", flops)
    if f.shape[0] == 0:
        raise SolverInputError("flops must hold at least one equation, got an empty sequence")
    c = _vector("cut_bytes", cut_bytes, f.shape[0] - 1)
    return f, c, _int_arg("num_layers", num_layers, 1), _nonneg_float("eps", eps)


# --------------------------------------------------------------------------- shared definitions


def _prefix(flops: np.ndarray) -> np.ndarray:
    """``P`` with ``P[0] = 0`` and ``P[k + 1] = flops[0] + ... + flops[k]`` (float64)."""
    out = np.zeros(flops.shape[0] + 1, dtype=np.float64)
    np.cumsum(flops, out=out[1:])
    return out


def balance_limit(total_flops: float, num_layers: int, eps: float) -> float:
    """Largest flops a layer may have: ``(1 + eps) * total / L`` times ``1 + BALANCE_RTOL``."""
    return (1.0 + eps) * total_flops / num_layers * (1.0 + BALANCE_RTOL)


def evaluate_clustering(
    flops: ArrayLike, cut_bytes: ArrayLike, layer_starts: Sequence[int], eps: float = 0.1
) -> LayerClustering:
    """Costs of a given clustering (e.g. from user pipeline markers); balance is not enforced.

    ``layer_starts`` must start at 0 and increase strictly below ``len(flops)``; check
    :attr:`LayerClustering.is_balanced` for the balance constraint.
    """
    starts = tuple(int(s) for s in layer_starts)
    f, c, num_layers, eps_f = _inputs(flops, cut_bytes, max(len(starts), 1), eps)
    n = f.shape[0]
    if not starts or starts[0] != 0:
        raise SolverInputError(f"layer_starts[0] must be 0, got {starts[:1] or 'nothing'}")
    for i in range(1, len(starts)):
        if not starts[i - 1] < starts[i] < n:
            raise SolverInputError(
                f"layer_starts[{i}] = {starts[i]} is invalid: must be > layer_starts[{i - 1}] "
                f"= {starts[i - 1]} and < num_equations = {n}"
            )
    return _evaluate(_prefix(f), c, starts, num_layers, eps_f)


def _evaluate(
    prefix: np.ndarray, cut_bytes: np.ndarray, starts: tuple[int, ...], num_layers: int, eps: float
) -> LayerClustering:
    n = prefix.shape[0] - 1
    bounds = np.asarray((*starts, n), dtype=np.int64)
    layer_flops = prefix[bounds[1:]] - prefix[bounds[:-1]]
    cuts = [float(cut_bytes[s - 1]) for s in starts[1:]]
    total = float(prefix[n])
    return LayerClustering(
        layer_starts=starts,
        num_equations=n,
        layer_flops=tuple(float(x) for x in layer_flops),
        boundary_cut_bytes=tuple(cuts),
        max_cut_bytes=max(cuts, default=0.0),
        sum_cut_bytes=sum(cuts, 0.0),
        max_layer_flops=float(layer_flops.max()),
        total_flops=total,
        balance_limit=balance_limit(total, num_layers, eps),
        eps=eps,
    )


# --------------------------------------------------------------------------- feasibility core
#
# Below, ``pp`` is the prefix array restricted to the *allowed layer starts*: index 0 is
# position 0, the last index is position n, and the indices in between are the positions
# k + 1 of allowed boundaries k. A layer is a pair of indices a < b with flops pp[b] - pp[a].


def _reach(pp: np.ndarray, a: int, limit: float) -> int:
    """Largest index ``b >= a`` with ``pp[b] - pp[a] <= limit`` (float64 difference, exact)."""
    base = float(pp[a])
    x = base + limit
    # Rounding is monotone, so pp[b] - pp[a] is non-decreasing in b and the answer is the end
    # of a prefix. Comparing pp[b] with base + limit instead of the difference can disagree
    # only within a few ulps of x, so the exact difference test is done only in that band.
    margin = 8.0 * _ULP * x + 1e-300
    lo = int(np.searchsorted(pp, x - margin, side="left"))
    hi = int(np.searchsorted(pp, x + margin, side="right"))
    # Indices below lo surely pass and indices from hi on surely fail.
    b = lo - 1
    if hi > lo:
        b += int(np.searchsorted(pp[lo:hi] - base, limit, side="right"))
    return max(min(b, pp.shape[0] - 1), a)


def _reach_all(pp: np.ndarray, limit: float) -> np.ndarray:
    """:func:`_reach` for every index at once."""
    last = pp.shape[0] - 1
    idx = np.arange(pp.shape[0])
    r = np.clip(np.searchsorted(pp, pp + limit, side="right") - 1, idx, last)
    over = pp[r] - pp > limit
    under = (r < last) & (pp[np.minimum(r + 1, last)] - pp <= limit)
    for a in np.flatnonzero(over | under):
        r[a] = _reach(pp, int(a), limit)
    return r


def _min_layers(pp: np.ndarray, limit: float, cap: int) -> tuple[int, float]:
    """Fewest layers with flops <= ``limit`` covering all of ``pp`` and their largest flops.

    Returns ``(cap + 1, inf)`` when more than ``cap`` layers are needed or one gap between
    consecutive allowed starts alone exceeds ``limit``.

    Why this decides exact-``L`` feasibility: greedily extending each layer as far as possible
    gives the fewest layers (its i-th boundary is never left of the i-th boundary of any valid
    clustering, by induction), and from a valid clustering with ``j`` layers one gets one with
    ``j + 1`` by splitting any layer at an allowed start inside it (both parts have flops <= the
    original, as flops >= 0 and rounding is monotone). So the achievable layer counts are the
    whole interval ``[greedy count, len(pp) - 1]`` and ``L`` layers exist iff
    ``greedy count <= L <= len(pp) - 1``.
    """
    last = pp.shape[0] - 1
    a, count, widest = 0, 0, 0.0
    while a < last:
        if count >= cap:
            return cap + 1, math.inf
        b = _reach(pp, a, limit)
        if b == a:
            return cap + 1, math.inf
        widest = max(widest, float(pp[b] - pp[a]))
        count += 1
        a = b
    return count, widest


def _feasible(pp: np.ndarray, limit: float, num_layers: int) -> bool:
    if pp.shape[0] - 1 < num_layers:
        return False
    if pp.shape[0] > 1 and float(np.max(np.diff(pp))) > limit:
        return False
    return _min_layers(pp, limit, num_layers)[0] <= num_layers


def _bits(x: float) -> int:
    return int(np.float64(x).view(np.int64))


def _min_bottleneck(pp: np.ndarray, num_layers: int, upper: float) -> float:
    """Smallest max layer flops over clusterings of ``pp`` into ``num_layers`` layers.

    Requires a feasible ``upper``. Exact: the optimum is one of the float64 differences
    ``pp[b] - pp[a]``; we keep ``lo`` infeasible and ``hi`` a feasible *realised* difference
    (the widest layer of a greedy clustering), and bisect on the bit patterns, which order
    non-negative float64 like their values, until no float lies strictly between them; then
    the optimum, being a float in ``(lo, hi]``, is ``hi``. At most ~64 greedy checks.
    """
    widest_gap = float(np.max(np.diff(pp)))
    if _min_layers(pp, widest_gap, num_layers)[0] <= num_layers:
        return widest_gap  # no layer can be thinner than the widest gap between starts
    lo = widest_gap
    count, hi = _min_layers(pp, upper, num_layers)
    assert count <= num_layers
    while _bits(hi) - _bits(lo) > 1:
        mid_bits = (_bits(lo) + _bits(hi)) // 2
        mid = float(np.int64(mid_bits).view(np.float64))
        count, widest = _min_layers(pp, mid, num_layers)
        if count <= num_layers:
            hi = widest
        else:
            lo = mid
    return hi


def _allowed_starts(cut_bytes: np.ndarray, threshold: float) -> np.ndarray:
    n = cut_bytes.shape[0] + 1
    inner = np.flatnonzero(cut_bytes <= threshold) + 1
    return np.concatenate(([0], inner, [n])).astype(np.int64)


# --------------------------------------------------------------------------- min-sum DP


def _window_min(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``min(values[lo[i] : hi[i] + 1])`` for every ``i`` (``inf`` where ``lo > hi``).

    Sparse table: level ``t`` holds minima of windows of length ``2**t``; a query is the min of
    two (overlapping) level-``t`` windows with ``2**t <= length < 2**(t + 1)``.
    """
    out = np.full(lo.shape[0], np.inf)
    length = hi - lo + 1
    valid = np.flatnonzero(length > 0)
    if valid.size == 0:
        return out
    qlo, qlen = lo[valid], length[valid]
    level = np.frexp(qlen.astype(np.float64))[1].astype(np.int64) - 1  # floor(log2(qlen))
    num_levels = int(level.max()) + 1
    m = values.shape[0]
    table = np.full((num_levels, m), np.inf)
    table[0] = values
    for t in range(1, num_levels):
        half = 1 << (t - 1)
        width = m - (1 << t) + 1
        np.minimum(table[t - 1, :width], table[t - 1, half : half + width], out=table[t, :width])
    right = qlo + qlen - (1 << level)
    out[valid] = np.minimum(table[level, qlo], table[level, right])
    return out


def _min_sum_starts(
    pp: np.ndarray, boundary_cost: np.ndarray, num_layers: int, limit: float
) -> list[int]:
    """Indices into ``pp`` of the layer starts minimising the summed boundary cost.

    Among ``num_layers``-layer clusterings with flops <= ``limit``, returns the one with the
    smallest sum of ``boundary_cost`` (cost of starting a layer at index ``b``), breaking ties
    by the lexicographically earliest starts.

    ``g[j, a]`` = min cost to split ``[a, last)`` into ``j`` layers. A layer starting at ``a``
    ends at some ``b`` in ``[a + 1, reach(a)]``, so
    ``g[j, a] = min over b in [a + 1, min(reach(a), last - 1)] of cost[b] + g[j - 1, b]``:
    a window minimum, vectorised per ``j``. Walking forward from ``a = 0`` and taking the
    first ``b`` that attains ``g[j, a]`` yields the earliest first start among all optimal
    clusterings, then the earliest second start, and so on: lexicographically earliest.
    """
    m = pp.shape[0]
    last = m - 1
    reach = _reach_all(pp, limit)
    lo = np.arange(m) + 1
    hi = np.minimum(reach, last - 1)
    g = np.full((num_layers + 1, m), np.inf)
    g[1, :last] = np.where(reach[:last] == last, 0.0, np.inf)
    for j in range(2, num_layers + 1):
        g[j] = _window_min(boundary_cost + g[j - 1], lo, hi)
    if not math.isfinite(g[num_layers, 0]):
        raise AssertionError("min-sum DP found no clustering although feasibility was proven")
    starts, a = [0], 0
    for j in range(num_layers, 1, -1):
        # Same elementwise sum as in the DP, so the window minimum is bit-identical.
        cand = boundary_cost[a + 1 : hi[a] + 1] + g[j - 1, a + 1 : hi[a] + 1]
        a = a + 1 + int(np.argmin(cand))
        starts.append(a)
    return starts


# --------------------------------------------------------------------------- public solvers


def cluster_layers(
    flops: ArrayLike, cut_bytes: ArrayLike, num_layers: int, eps: float = 0.1
) -> LayerClustering:
    """Optimal balanced clustering of the equation sequence into ``num_layers`` layers.

    Minimises (max cut bytes, max layer flops, sum of cut bytes, earliest boundaries) subject
    to every layer's flops <= :func:`balance_limit` (see the module docstring). Raises
    :class:`SolverInputError` for malformed input and :class:`InfeasibleError` (with ``cause``
    and ``min_eps`` in ``details``) when no clustering is balanced.
    """
    f, c, num_layers, eps = _inputs(flops, cut_bytes, num_layers, eps)
    n = f.shape[0]
    prefix = _prefix(f)
    total = float(prefix[n])
    limit = balance_limit(total, num_layers, eps)
    if num_layers == 1:
        return _evaluate(prefix, c, (0,), 1, eps)
    if num_layers > n or not _feasible(prefix, limit, num_layers):
        _raise_infeasible(f, prefix, num_layers, eps, limit)

    # 1. Smallest threshold T with a feasible clustering using only cuts <= T. Feasibility is
    # monotone in T (a larger T only adds allowed boundaries) and holds at max(cut_bytes),
    # where every boundary is allowed (checked above), so binary search is exact.
    thresholds = np.unique(c)
    lo, hi = -1, thresholds.shape[0] - 1  # thresholds[lo] infeasible (or none), [hi] feasible
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _feasible(prefix[_allowed_starts(c, float(thresholds[mid]))], limit, num_layers):
            hi = mid
        else:
            lo = mid
    positions = _allowed_starts(c, float(thresholds[hi]))
    pp = prefix[positions]

    # 2. Smallest max layer flops among clusterings using only those boundaries.
    bottleneck = _min_bottleneck(pp, num_layers, limit)

    # 3. Min sum of cut bytes, then earliest boundaries, with layers <= bottleneck.
    boundary_cost = np.zeros(positions.shape[0])
    boundary_cost[1:-1] = c[positions[1:-1] - 1]
    idx = _min_sum_starts(pp, boundary_cost, num_layers, bottleneck)
    return _evaluate(prefix, c, tuple(int(positions[i]) for i in idx), num_layers, eps)


def _raise_infeasible(
    flops: np.ndarray, prefix: np.ndarray, num_layers: int, eps: float, limit: float
) -> None:
    n = flops.shape[0]
    if num_layers > n:
        raise InfeasibleError(
            f"num_layers = {num_layers} exceeds the number of equations {n}: every layer "
            f"needs at least one equation, so no eps helps; use num_layers <= {n}",
            cause="too_many_layers",
            num_layers=num_layers,
            num_equations=n,
            min_eps=None,
        )
    total = float(prefix[n])
    # Every boundary is allowed here; the bottleneck of the best clustering gives the eps.
    best = _min_bottleneck(prefix, num_layers, total)
    min_eps = max(0.0, best * num_layers / total - 1.0)
    heaviest = int(np.argmax(flops))
    if flops[heaviest] > limit:
        cause = "equation_exceeds_limit"
        why = (
            f"equation {heaviest} alone has {flops[heaviest]:.6g} flops > balance limit "
            f"{limit:.6g} = (1 + eps) * total / num_layers"
        )
    else:
        cause = "unbalanced"
        why = (
            f"every clustering into {num_layers} layers has a layer with more than "
            f"{limit:.6g} flops (the best achievable max layer has {best:.6g})"
        )
    raise InfeasibleError(
        f"no balanced clustering with eps = {eps:g}: {why}; the smallest eps that works is "
        f"{min_eps:.6g}",
        cause=cause,
        num_layers=num_layers,
        num_equations=n,
        balance_limit=limit,
        min_max_layer_flops=best,
        min_eps=min_eps,
        equation=heaviest if cause == "equation_exceeds_limit" else None,
    )


def search_num_layers(
    flops: ArrayLike,
    cut_bytes: ArrayLike,
    candidates: Iterable[int],
    eps: float = 0.1,
    cut_tolerance: float = 0.1,
) -> LayerCountSearch:
    """Cluster for every candidate layer count and choose one for pipeline planning.

    Criterion: let ``ref`` be the smallest optimal max cut among feasible candidates with at
    least two layers; choose the *largest* such candidate whose max cut is
    ``<= (1 + cut_tolerance) * ref``. More layers give the stage DP more freedom, but not at the
    price of cutting through fat tensors. A single layer (max cut 0 by definition) is chosen
    only when no multi-layer candidate is feasible. Raises :class:`InfeasibleError` when no
    candidate is feasible.
    """
    f, c, _, eps_f = _inputs(flops, cut_bytes, 1, eps)
    tol = _nonneg_float("cut_tolerance", cut_tolerance)
    try:
        values = [] if isinstance(candidates, str | bytes) else list(candidates)
    except TypeError:
        values = []
    if not values:
        raise SolverInputError(
            f"candidates must hold at least one layer count (integers >= 1), got {candidates!r}"
        )
    counts = sorted({_int_arg(f"candidates[{i}]", v, 1) for i, v in enumerate(values)})
    results: list[LayerClustering | None] = []
    failures: list[str | None] = []
    for num_layers in counts:
        try:
            results.append(cluster_layers(f, c, num_layers, eps_f))
            failures.append(None)
        except InfeasibleError as err:
            results.append(None)
            failures.append(str(err))
    multi = [r for r in results if r is not None and r.num_layers >= 2]
    if multi:
        ref = min(r.max_cut_bytes for r in multi)
        chosen = max(r.num_layers for r in multi if r.max_cut_bytes <= (1.0 + tol) * ref)
    elif any(r is not None for r in results):
        ref, chosen = math.nan, 1
    else:
        raise InfeasibleError(
            f"no candidate layer count is feasible with eps = {eps_f:g}: "
            + "; ".join(f"L={k}: {msg}" for k, msg in zip(counts, failures, strict=True)),
            candidates=tuple(counts),
            failures=tuple(failures),
        )
    return LayerCountSearch(
        candidates=tuple(counts),
        results=tuple(results),
        failures=tuple(failures),
        chosen_num_layers=chosen,
        reference_max_cut_bytes=ref,
        cut_tolerance=tol,
        eps=eps_f,
    )


# --------------------------------------------------------------------------- cut vector


def cut_bytes_from_tensors(
    num_equations: int,
    producers: ArrayLike,
    last_consumers: ArrayLike,
    sizes: ArrayLike,
) -> np.ndarray:
    """Bytes crossing each boundary, from the tensors of an equation graph.

    Tensor ``t`` produced by equation ``producers[t]`` and last read by equation
    ``last_consumers[t]`` crosses boundary ``k`` (between equations ``k`` and ``k + 1``) for
    ``producers[t] <= k < last_consumers[t]``; a tensor whose last consumer is not after its
    producer crosses nothing. Pass ``last_consumers[t] = num_equations`` for a step output that
    stays live to the end.

    Graph inputs (parameters, the batch) are produced by no equation and are not counted:
    they live with whichever stage uses them rather than flowing across the boundary. A caller
    that wants to charge a graph input as if forwarded from the start can pass producer 0,
    which makes it cross exactly the boundaries before its last consumer.

    Returns a float64 array of length ``num_equations - 1`` (difference array + cumsum).
    """
    n = _int_arg("num_equations", num_equations, 1)
    size = _vector("sizes", sizes)
    num_tensors = size.shape[0]
    prod = _index_vector("producers", producers, num_tensors, 0, n - 1)
    cons = _index_vector("last_consumers", last_consumers, num_tensors, 0, n)
    live = cons > prod
    diff = np.zeros(n + 1, dtype=np.float64)
    np.add.at(diff, prod[live], size[live])
    np.subtract.at(diff, cons[live], size[live])
    return np.cumsum(diff[: n - 1])


def _index_vector(name: str, values: ArrayLike, length: int, low: int, high: int) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.shape[0] != length:
        raise SolverInputError(
            f"{name} must be 1-D with one entry per tensor (length {length}), got shape {arr.shape}"
        )
    if length == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        integral = np.zeros(length, dtype=bool)
        if arr.dtype.kind == "f":
            integral = np.isfinite(arr) & (arr == np.round(arr))
        if not integral.all():
            i = int(np.flatnonzero(~integral)[0])
            raise SolverInputError(
                f"{name}[{i}] = {arr[i].item()!r} is invalid: must be an integer equation index"
            )
    out = arr.astype(np.int64)
    bad_idx = np.flatnonzero((out < low) | (out > high))
    if bad_idx.size:
        i = int(bad_idx[0])
        raise SolverInputError(
            f"{name}[{i}] = {out[i]} is out of range: must be in [{low}, {high}]"
        )
    return out
