"""Inter-operator stage DP (DESIGN 5.2): slice layers into pipeline stages on submeshes.

Layers ``0..L-1`` run on a cluster of ``N`` hosts x ``M`` devices. A *stage* is a contiguous
layer range ``i..j`` (inclusive) placed on one submesh ``s`` of :func:`submesh_shapes` with one
logical-mesh config ``c``; ``cost[i, j, s, c]`` is its latency (``inf``: does not fit) and
``max_succ[i, j, s, c]`` the number of later stages it tolerates under 1F1B memory. A slicing
covers every layer, its submesh device counts sum to exactly ``N * M`` and it minimises

    T = sum_stages t + (B - 1) * max_stages t          (B = number of micro-batches).

:func:`solve_stages` is exact and fast; :func:`solve_stages_reference` is Alpa's plain scheme
(every distinct ``t_max``, one full inner DP each) kept for tests and benchmarks.

How :func:`solve_stages` stays exact (details in the comments next to each step):

* ``g(t)``, the least latency sum over slicings whose stages are all ``<= t``, is
  nonincreasing in ``t`` and ``T* = min_t g(t) + (B - 1) t``. Instead of one inner DP per
  distinct cost, a best-first search probes few ``t``: an unexplored run of candidates
  ``[t_a, t_b]`` whose nearest probe to the right has ``g >= g_r`` holds no ``T`` below
  ``g_r + (B - 1) t_a``; runs that cannot beat the incumbent are dropped, and a probe whose
  optimum peaks at ``t' <= t`` settles every candidate in ``[t', t]``.
* Relaxations bound where to look: the fewest-devices slicing must fit the cluster (a lower
  bound on the optimal max stage), and a Lagrangian price on devices gives a lower bound on
  ``g`` (hence an upper bound on the useful ``t``).
* Most probes are a cheap *relaxed* DP (memory limits ignored, cheapest config per range and
  submesh): a lower bound on ``g(t)``, and exact whenever its slicing meets every memory
  limit. Otherwise the memory-aware DP runs, restricted to the states whose relaxed
  prefix + suffix sum can still matter for the search (it then either returns ``g(t)`` or
  proves ``g(t)`` above the cut).
* Inside both DPs: configs dominated within one (range, submesh) are dropped (cheaper *and*
  tolerating as many later stages), after capping ``max_succ`` at what could ever be asked of
  it; device counts are kept in units of the gcd of the usable submesh sizes and only within
  the window a full-cluster slicing can reach; rows are whole numpy vectors over devices; the
  memory-aware DP keeps "at most ``r`` stages from layer ``k`` on" only for the ``r`` that can
  differ from "unlimited" (below the stage count of the unlimited optimum).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from ..errors import InfeasibleError, SolverInputError

__all__ = [
    "Stage",
    "StageProblem",
    "StageSolution",
    "random_stage_problem",
    "solve_stages",
    "solve_stages_reference",
    "stage_objective",
    "submesh_shapes",
]

_INF = math.inf


# --------------------------------------------------------------------------- helpers


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise SolverInputError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def submesh_shapes(num_hosts: int, devices_per_host: int) -> tuple[tuple[int, int], ...]:
    """Alpa's submesh shapes ``(hosts, devices)``, in increasing device count.

    ``(1, 1), (1, 2), (1, 4), ...`` (powers of two below ``devices_per_host``), then
    ``(1, M), (2, M), ..., (N, M)``. With ``M`` not a power of two the one-host part is still
    the powers of two below ``M`` followed by ``(1, M)``; with ``M == 1`` only ``(h, 1)``.
    """
    n = _check_positive_int("num_hosts", num_hosts)
    m = _check_positive_int("devices_per_host", devices_per_host)
    shapes: list[tuple[int, int]] = []
    p = 1
    while p < m:
        shapes.append((1, p))
        p *= 2
    shapes.extend((h, m) for h in range(1, n + 1))
    return tuple(shapes)


def stage_objective(latencies: Sequence[float], num_micro_batches: int) -> float:
    """Pipeline latency ``sum(t) + (B - 1) * max(t)`` of stages with latencies ``t``."""
    lat = [float(x) for x in latencies]
    if not lat:
        raise SolverInputError("latencies must name at least one stage, got []")
    return sum(lat) + (num_micro_batches - 1) * max(lat)


def _nested_with_nulls(array: np.ndarray) -> list[Any]:
    """Nested lists with every non-finite value as ``None`` (standard JSON has no Infinity)."""
    obj = array.astype(object)
    obj[~np.isfinite(array)] = None
    return obj.tolist()


def _float_array_from_nested(data: Any) -> np.ndarray:
    """Inverse of :func:`_nested_with_nulls` (``None`` -> ``inf``)."""
    obj = np.array(data, dtype=object)
    obj[np.equal(obj, None)] = _INF
    return obj.astype(np.float64)


# --------------------------------------------------------------------------- problem


@dataclass(frozen=True, eq=False)
class StageProblem:
    """Cost table of every (layer range, submesh, config) and the pipeline parameters.

    ``cost`` and ``max_succ`` have shape ``(L, L, S, C)`` with ``S = len(submesh_shapes(N, M))``;
    entries with ``i > j`` are ignored (stored as ``inf`` / ``0``). ``cost`` may hold ``inf``
    (that stage does not fit) but no NaN and nothing negative; ``max_succ`` holds non-negative
    integers. The arrays are stored as read-only float64 / int64 copies.
    """

    num_hosts: int
    devices_per_host: int
    cost: np.ndarray
    max_succ: np.ndarray
    num_micro_batches: int
    config_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        n = _check_positive_int("num_hosts", self.num_hosts)
        m = _check_positive_int("devices_per_host", self.devices_per_host)
        b = _check_positive_int("num_micro_batches", self.num_micro_batches)
        object.__setattr__(self, "num_hosts", n)
        object.__setattr__(self, "devices_per_host", m)
        object.__setattr__(self, "num_micro_batches", b)
        shapes = submesh_shapes(n, m)
        cost = self._validated_cost(self.cost, len(shapes))
        max_succ = self._validated_max_succ(self.max_succ, cost.shape)
        cost.flags.writeable = False
        max_succ.flags.writeable = False
        object.__setattr__(self, "cost", cost)
        object.__setattr__(self, "max_succ", max_succ)
        if self.config_names is not None:
            names = tuple(self.config_names)
            if len(names) != cost.shape[3]:
                raise SolverInputError(
                    f"config_names has {len(names)} names but cost.shape[3] (configs) is "
                    f"{cost.shape[3]}; give one name per config or None"
                )
            for c, name in enumerate(names):
                if not isinstance(name, str):
                    raise SolverInputError(f"config_names[{c}] must be a str, got {name!r}")
            object.__setattr__(self, "config_names", names)

    @staticmethod
    def _validated_cost(value: ArrayLike, num_submeshes: int) -> np.ndarray:
        try:
            cost = np.array(value, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise SolverInputError(f"cost must be a numeric array, got {value!r:.80}") from exc
        if cost.ndim != 4 or cost.shape[0] != cost.shape[1] or cost.shape[0] < 1:
            raise SolverInputError(
                f"cost must have shape (L, L, S, C) with L >= 1, got shape {cost.shape}"
            )
        if cost.shape[2] != num_submeshes or cost.shape[3] < 1:
            raise SolverInputError(
                f"cost.shape[2:] must be (S, C) = ({num_submeshes}, >= 1): S is the number of "
                f"submesh_shapes for this cluster; got {cost.shape[2:]}"
            )
        num_layers = cost.shape[0]
        lower = np.tril(np.ones((num_layers, num_layers), dtype=bool), -1)
        cost[lower] = _INF  # i > j is not a range: ignored
        if np.isnan(cost).any():
            i, j, s, c = (int(x) for x in np.argwhere(np.isnan(cost))[0])
            raise SolverInputError(
                f"cost[{i}, {j}, {s}, {c}] is NaN; use a latency >= 0 or inf (does not fit)"
            )
        if (cost < 0).any():
            i, j, s, c = (int(x) for x in np.argwhere(cost < 0)[0])
            raise SolverInputError(
                f"cost[{i}, {j}, {s}, {c}] = {float(cost[i, j, s, c])!r} is negative; latencies "
                "must be >= 0 (inf means the stage does not fit)"
            )
        return cost

    @staticmethod
    def _validated_max_succ(value: ArrayLike, shape: tuple[int, ...]) -> np.ndarray:
        raw = np.asarray(value)
        if raw.shape != shape:
            raise SolverInputError(f"max_succ must have the shape of cost {shape}, got {raw.shape}")
        if raw.dtype == bool or not (
            np.issubdtype(raw.dtype, np.integer) or np.issubdtype(raw.dtype, np.floating)
        ):
            raise SolverInputError(f"max_succ must hold integers, got dtype {raw.dtype}")
        lower = np.tril(np.ones(shape[:2], dtype=bool), -1)
        if np.issubdtype(raw.dtype, np.floating):
            vals = raw.astype(np.float64)
            vals[lower] = 0.0
            bad = np.argwhere(~np.isfinite(vals) | (vals != np.floor(vals)))
            if bad.size:
                i, j, s, c = (int(x) for x in bad[0])
                raise SolverInputError(
                    f"max_succ[{i}, {j}, {s}, {c}] = {float(vals[i, j, s, c])!r} is not an integer"
                )
            if np.abs(vals).max(initial=0.0) >= 2.0**62:
                raise SolverInputError("max_succ values must be below 2**62 in magnitude")
        out = raw.astype(np.int64)
        out[lower] = 0
        if (out < 0).any():
            i, j, s, c = (int(x) for x in np.argwhere(out < 0)[0])
            raise SolverInputError(
                f"max_succ[{i}, {j}, {s}, {c}] = {int(out[i, j, s, c])} is negative; it must be "
                ">= 0 (mark a stage that never fits with cost inf instead)"
            )
        return out

    # ---- derived sizes
    @property
    def num_layers(self) -> int:
        """Number of layers ``L``."""
        return int(self.cost.shape[0])

    @property
    def num_configs(self) -> int:
        """Number of logical-mesh configs ``C`` per submesh."""
        return int(self.cost.shape[3])

    @property
    def num_devices(self) -> int:
        """Devices in the cluster, ``N * M``: every slicing uses exactly this many."""
        return self.num_hosts * self.devices_per_host

    @property
    def submesh_shapes(self) -> tuple[tuple[int, int], ...]:
        """The submesh shapes indexed by ``cost``'s third axis."""
        return submesh_shapes(self.num_hosts, self.devices_per_host)

    @property
    def submesh_sizes(self) -> np.ndarray:
        """Device count of every submesh, increasing."""
        return np.array([h * d for h, d in self.submesh_shapes], dtype=np.int64)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StageProblem):
            return NotImplemented
        return (
            self.num_hosts == other.num_hosts
            and self.devices_per_host == other.devices_per_host
            and self.num_micro_batches == other.num_micro_batches
            and self.config_names == other.config_names
            and self.cost.shape == other.cost.shape
            and bool(np.array_equal(self.cost, other.cost))
            and bool(np.array_equal(self.max_succ, other.max_succ))
        )

    __hash__ = None  # type: ignore[assignment]  # holds arrays: equal but not hashable

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; ``inf`` costs become ``None``."""
        return {
            "num_hosts": self.num_hosts,
            "devices_per_host": self.devices_per_host,
            "num_micro_batches": self.num_micro_batches,
            "config_names": None if self.config_names is None else list(self.config_names),
            "cost": _nested_with_nulls(self.cost),
            "max_succ": self.max_succ.tolist(),
        }

    def to_json(self) -> str:
        """Standard JSON (no NaN/Infinity tokens); :meth:`from_json` reads it back."""
        return json.dumps(self.to_dict(), allow_nan=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageProblem:
        """Inverse of :meth:`to_dict`."""
        names = data.get("config_names")
        return cls(
            num_hosts=data["num_hosts"],
            devices_per_host=data["devices_per_host"],
            cost=_float_array_from_nested(data["cost"]),
            max_succ=np.array(data["max_succ"], dtype=np.int64),
            num_micro_batches=data["num_micro_batches"],
            config_names=None if names is None else tuple(names),
        )

    @classmethod
    def from_json(cls, text: str) -> StageProblem:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))


# --------------------------------------------------------------------------- solution


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: layers ``layer_start..layer_end`` (inclusive) on one submesh."""

    layer_start: int
    layer_end: int
    submesh_index: int
    submesh_shape: tuple[int, int]
    config_index: int
    latency: float

    @property
    def num_layers(self) -> int:
        """Layers in this stage."""
        return self.layer_end - self.layer_start + 1

    @property
    def num_devices(self) -> int:
        """Devices of its submesh."""
        return self.submesh_shape[0] * self.submesh_shape[1]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return {
            "layer_start": self.layer_start,
            "layer_end": self.layer_end,
            "submesh_index": self.submesh_index,
            "submesh_shape": list(self.submesh_shape),
            "config_index": self.config_index,
            "latency": self.latency,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Stage:
        """Inverse of :meth:`to_dict`."""
        h, d = data["submesh_shape"]
        return cls(
            layer_start=int(data["layer_start"]),
            layer_end=int(data["layer_end"]),
            submesh_index=int(data["submesh_index"]),
            submesh_shape=(int(h), int(d)),
            config_index=int(data["config_index"]),
            latency=float(data["latency"]),
        )


@dataclass(frozen=True)
class StageSolution:
    """An optimal slicing and how it was found.

    ``objective`` is ``sum_latency + (B - 1) * max_latency``. ``tmax_trace`` lists, for every
    ``t_max`` the solver evaluated exactly (ascending), the ``T`` of the slicing it found with
    every stage ``<= t_max`` (``inf``: none exists). The reference solves every candidate
    fully, so there it is the best such ``T``.
    """

    stages: tuple[Stage, ...]
    objective: float
    sum_latency: float
    max_latency: float
    num_micro_batches: int
    tmax_trace: tuple[tuple[float, float], ...]
    solve_time_s: float
    method: str

    @property
    def num_stages(self) -> int:
        """Number of pipeline stages."""
        return len(self.stages)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; an infeasible ``T`` in the trace becomes ``None``."""
        return {
            "stages": [s.to_dict() for s in self.stages],
            "objective": self.objective,
            "sum_latency": self.sum_latency,
            "max_latency": self.max_latency,
            "num_micro_batches": self.num_micro_batches,
            "tmax_trace": [[t, v if math.isfinite(v) else None] for t, v in self.tmax_trace],
            "solve_time_s": self.solve_time_s,
            "method": self.method,
        }

    def to_json(self) -> str:
        """Standard JSON (no NaN/Infinity tokens); :meth:`from_json` reads it back."""
        return json.dumps(self.to_dict(), allow_nan=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageSolution:
        """Inverse of :meth:`to_dict`."""
        return cls(
            stages=tuple(Stage.from_dict(s) for s in data["stages"]),
            objective=float(data["objective"]),
            sum_latency=float(data["sum_latency"]),
            max_latency=float(data["max_latency"]),
            num_micro_batches=int(data["num_micro_batches"]),
            tmax_trace=tuple(
                (float(t), _INF if v is None else float(v)) for t, v in data["tmax_trace"]
            ),
            solve_time_s=float(data["solve_time_s"]),
            method=str(data["method"]),
        )

    @classmethod
    def from_json(cls, text: str) -> StageSolution:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))


def _make_solution(
    problem: StageProblem,
    choices: Sequence[tuple[int, int, int, int]],
    trace: Sequence[tuple[float, float]],
    start_time: float,
    method: str,
) -> StageSolution:
    """Build a :class:`StageSolution` from ``(start, end, submesh, config)`` choices."""
    shapes = problem.submesh_shapes
    stages = tuple(
        Stage(i, j, s, shapes[s], c, float(problem.cost[i, j, s, c])) for i, j, s, c in choices
    )
    lat = [st.latency for st in stages]
    return StageSolution(
        stages=stages,
        objective=stage_objective(lat, problem.num_micro_batches),
        sum_latency=sum(lat),
        max_latency=max(lat),
        num_micro_batches=problem.num_micro_batches,
        tmax_trace=tuple(sorted(trace)),
        solve_time_s=time.perf_counter() - start_time,
        method=method,
    )


# --------------------------------------------------------------------------- fast solver


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


def _memory_dp(
    prep: _Prepared,
    choices: _Choices,
    problem: StageProblem,
    t: float,
    bound: tuple[_RelaxedTables, float] | None = None,
) -> _Probe:
    """Least latency sum with every stage ``<= t`` and every memory limit met.

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


def _probe_from(choices: _Choices, idx: np.ndarray, t: float, g: float, memory_ok: bool) -> _Probe:
    """A :class:`_Probe` for the choices ``idx`` (first stage first)."""
    picked = tuple(
        (int(choices.start[e]), int(choices.end[e]), int(choices.mesh[e]), int(choices.config[e]))
        for e in idx
    )
    return _Probe(t, g, picked, float(choices.cost[idx].max()), memory_ok)


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


class _Search:
    """The ``t_max`` search of :func:`solve_stages`, with its probes and incumbent.

    Two kinds of probe at a threshold ``t``: the *relaxed* DP ignores memory limits and keeps
    one cheapest config per (range, submesh); it is several times cheaper, its sum is a lower
    bound on ``g(t)``, and when its slicing happens to meet every memory limit it *is* an
    exact optimum at ``t``. Only otherwise does the memory-aware DP run, and then only over
    the states whose relaxed prefix + suffix can still matter (a sum cut, see
    :func:`_memory_dp`).
    """

    def __init__(self, prep: _Prepared, problem: StageProblem) -> None:
        self.prep = prep
        self.problem = problem
        self.b1 = problem.num_micro_batches - 1
        self.exact_choices = prep.exact
        self.relaxed_choices = prep.relaxed
        self.relaxed_by_end = np.argsort(prep.relaxed.end, kind="stable")
        self.relaxed_at: dict[float, _Probe] = {}
        self.tables_at: dict[float, _RelaxedTables] = {}
        self.exact_at: dict[float, _Probe] = {}
        self.found: dict[float, float] = {}  # t -> T of the slicing found there (inf: none)
        self.bounds: list[tuple[float, float]] = []  # (t, lower bound on g(t') for t' <= t)
        self.failed_below = -_INF  # every t <= this is infeasible
        self.t_lb = 0.0  # every feasible slicing peaks at >= this
        self.best: _Probe | None = None

    def best_value(self) -> float:
        """``T`` of the incumbent (``inf`` if none)."""
        return self.best.g + self.b1 * self.best.t_actual if self.best else _INF

    def restrict(self, t_hi: float) -> None:
        """Forget every choice that no probe at ``t <= t_hi`` can use: cheaper probes.

        That is every choice above ``t_hi``, and every choice that cannot join two window
        states at ``t_hi``: windows only shrink as ``t`` decreases (fewer submeshes qualify).
        """
        lo, hi, _, _ = _device_windows(self.prep, self.problem, t_hi)
        for name in ("exact_choices", "relaxed_choices"):
            ch = getattr(self, name).below(t_hi)
            keep = np.flatnonzero(_useful(ch.start, ch.end + 1, ch.size, lo, hi))
            setattr(self, name, _Choices(*(getattr(ch, f)[keep] for f in _CHOICE_FIELDS)))
        self.relaxed_by_end = np.argsort(self.relaxed_choices.end, kind="stable")

    def _offer(self, res: _Probe) -> None:
        if res.feasible and res.memory_ok and res.g + self.b1 * res.t_actual < self.best_value():
            self.best = res

    def _record_exact(self, res: _Probe) -> _Probe:
        self._offer(res)
        if res.feasible or not math.isfinite(res.lower):
            value = res.g + self.b1 * res.t_actual if res.feasible else _INF
            self.found[res.t] = min(value, self.found.get(res.t, _INF))
        if res.feasible and not math.isfinite(res.lower):
            self.exact_at[res.t] = res
            self.bounds.append((res.t, res.g))
        elif math.isfinite(res.lower):
            self.bounds.append((res.t, res.lower))
        else:
            self.exact_at[res.t] = res
            self.failed_below = max(self.failed_below, res.t)
        return res

    def relaxed(self, t: float) -> _Probe:
        """Relaxed probe at ``t``; recorded as exact when its slicing meets memory limits."""
        if t in self.relaxed_at:
            return self.relaxed_at[t]
        res, tables = _relaxed_dp(self.prep, self.relaxed_choices, self.problem, t)
        self.relaxed_at[t] = res
        if not res.feasible or res.memory_ok:  # relaxed infeasible => exact infeasible
            self._record_exact(res)
        else:
            assert tables is not None
            self.tables_at = {t: tables}  # only the latest is ever reused
            self.bounds.append((t, res.g))
        return res

    def exact(self, t: float, cut: float = _INF) -> _Probe:
        """Exact optimum at ``t`` if it sums to ``<= cut`` (else only ``g(t) > cut``)."""
        if t in self.exact_at:
            return self.exact_at[t]
        res = self.relaxed(t)
        if t in self.exact_at:
            return res
        bound = None
        if math.isfinite(cut):
            tables = self.tables_at.get(t)
            if tables is None:  # evicted by a later relaxed probe: rebuild it
                tables = _relaxed_dp(self.prep, self.relaxed_choices, self.problem, t)[1]
                assert tables is not None
            tables.prefix = _relaxed_prefix(
                self.relaxed_choices, self.relaxed_by_end, tables, t, self.problem.num_layers
            )
            bound = (tables, cut)
        res = _memory_dp(self.prep, self.exact_choices, self.problem, t, bound)
        return self._record_exact(res)

    def trace(self) -> list[tuple[float, float]]:
        """``(t, T of the slicing found there)`` of every memory-aware probe (``inf``: none
        exists at ``t``)."""
        return list(self.found.items())

    # ---- the phases
    def first_incumbent(self, t_lb: float, top: float) -> None:
        """Gallop up from the bottleneck bound until some slicing is feasible."""
        t = t_lb
        step = max(t_lb * 2.0**-10, (top - t_lb) * 2.0**-30, 1e-300)
        while not self.exact(t).feasible:
            if t >= top:
                return
            t = min(top, t + step)
            step *= 2.0

    def explore(self, lo: float, sum_lb: float) -> None:
        """Find a strong incumbent early (a heuristic: exactness comes from :meth:`certify`).

        Relaxed probes on a ladder ``lo + delta * (2**i - 1)`` up to the current ``t_hi``
        (cheap, tight thresholds first), then a golden-section search of ``g(t) + (B - 1) t``
        around the best rung, and one exact probe at the best point found.
        """
        b1 = self.b1

        def t_hi() -> float:
            return (self.best_value() - sum_lb) / b1

        def value(t: float) -> float:
            res = self.relaxed(t)
            return res.g + b1 * res.t_actual if res.feasible else _INF

        hi = t_hi()
        if not hi > lo:
            return
        delta = (hi - lo) * 2.0**-10
        rungs, values = [lo], [value(lo)]
        while rungs[-1] < t_hi():  # t_hi shrinks as the incumbent improves
            rungs.append(min(lo + delta * (2.0 ** len(rungs) - 1.0), t_hi()))
            values.append(value(rungs[-1]))
        i = int(np.argmin(values))
        a, b = rungs[max(i - 1, 0)], rungs[min(i + 1, len(rungs) - 1)]
        inv_phi = (math.sqrt(5.0) - 1.0) / 2.0
        c, d = b - inv_phi * (b - a), a + inv_phi * (b - a)
        fc, fd = value(c), value(d)
        for _ in range(10):
            if (b - a) * b1 <= 1e-4 * self.best_value():
                break
            if fc <= fd:
                b, d, fd = d, c, fc
                c = b - inv_phi * (b - a)
                fc = value(c)
            else:
                a, c, fc = c, d, fd
                d = a + inv_phi * (b - a)
                fd = value(d)
        candidates = [*zip(values, rungs, strict=True), (fc, c), (fd, d)]
        t = min(candidates)[1]
        # it can only improve the incumbent if g(t) < best - (B - 1) * (least feasible t)
        self.exact(t, self.best_value() - b1 * max(self.failed_below, self.t_lb))

    def certify(self, sum_lb: float) -> None:
        """Probe candidates until none can beat the incumbent (exact; see solve_stages)."""
        b1 = self.b1
        t_hi = (self.best_value() - sum_lb) / b1
        costs = self.exact_choices.cost
        cand = np.unique(costs[(costs > self.failed_below) & (costs <= t_hi)])
        done = np.zeros(cand.size, dtype=bool)
        settled = 0
        while True:
            # settle what the exact probes so far decide: an optimum at t peaking at t' <= t
            # makes g constant on [t', t] (nothing there beats it); infeasible t: all below
            for p in list(self.exact_at.values())[settled:]:
                if p.feasible:
                    done[(cand >= p.t_actual) & (cand <= p.t)] = True
            settled = len(self.exact_at)
            done[cand <= self.failed_below] = True
            open_idx = np.flatnonzero(~done)
            if open_idx.size == 0:
                return
            breaks = np.flatnonzero(np.diff(open_idx) > 1)
            run_lo = open_idx[np.r_[0, breaks + 1]]
            run_hi = open_idx[np.r_[breaks, open_idx.size - 1]]
            # g is nonincreasing: a probe (exact, relaxed or cut) at t bounds g on t' <= t
            pts = sorted(self.bounds)
            pt = np.array([x[0] for x in pts])
            pg = np.maximum.accumulate(np.array([x[1] for x in pts])[::-1])[::-1]
            right = np.searchsorted(pt, cand[run_hi], side="left")
            g_right = np.where(right < pt.size, pg[np.minimum(right, pt.size - 1)], sum_lb)
            g_right = np.maximum(g_right, sum_lb)
            best = self.best_value()
            # candidates t with g_right + (B - 1) t >= best cannot beat the incumbent
            limit = np.searchsorted(cand, (best - g_right) / b1, side="left") - 1
            for lo, hi, lim in zip(run_lo.tolist(), run_hi.tolist(), limit.tolist(), strict=True):
                if lim < hi:
                    done[max(lo, lim + 1) : hi + 1] = True
            live = limit >= run_lo
            if not live.any():
                return
            # the run whose best case is lowest, probed at its highest useful candidate; an
            # exact probe there only matters if g(t) < best - (B - 1) * (run's lowest t)
            i = int(np.argmin(np.where(live, g_right + b1 * cand[run_lo], np.inf)))
            top = min(run_hi[i], limit[i])
            t = float(cand[top])
            if t not in self.relaxed_at:
                self.relaxed(t)
                continue
            res = self.exact(t, best - b1 * float(cand[run_lo[i]]))
            if math.isfinite(res.lower):
                # g(t') >= g(t) > best - (B - 1) * t_lo for every t' <= t: the run is done
                done[run_lo[i] : top + 1] = True


def solve_stages(problem: StageProblem) -> StageSolution:
    """Exact optimal slicing of all layers into stages (see the module docstring).

    Raises :class:`InfeasibleError` when no slicing uses all devices with finite costs and
    satisfied memory limits; the message says which constraint binds.
    """
    t0 = time.perf_counter()
    prep = _prepare(problem)
    search = _Search(prep, problem)
    t_lb, min_devices = _bottleneck_lower_bound(prep, problem)
    if not math.isfinite(t_lb):
        raise InfeasibleError(
            _infeasible_reason(prep, problem, min_devices), min_devices=min_devices
        )
    search.t_lb = t_lb
    top = float(prep.exact.cost.max())
    if search.b1 == 0:
        search.exact(top)  # B = 1: T is the plain latency sum, least with every stage allowed
    else:
        search.first_incumbent(t_lb, top)
    if search.best is None:
        raise InfeasibleError(_infeasible_reason(prep, problem, min_devices))
    if search.b1 > 0:
        # g(t) >= sum_lb for every t, so no t above t_hi can beat the incumbent
        sum_lb = _lagrangian_sum_bound(prep, problem)
        search.restrict((search.best_value() - sum_lb) / search.b1)
        search.explore(max(search.failed_below, t_lb), sum_lb)
        search.certify(sum_lb)
    assert search.best is not None
    return _make_solution(problem, search.best.choices, search.trace(), t0, "stage_dp")


# --------------------------------------------------------------------------- reference


def _reference_inner(problem: StageProblem, t: float) -> tuple[float, list[tuple[int, ...]]]:
    """Alpa's inner DP with every stage ``<= t``: ``F[s, k, d]`` = least latency sum of layers
    ``k..L-1`` in exactly ``s`` stages on exactly ``d`` devices, memory limits included."""
    num_layers = problem.num_layers
    total = problem.num_devices
    sizes = problem.submesh_sizes
    cost, max_succ = problem.cost, problem.max_succ
    under = cost <= t
    f = np.full((num_layers + 1, num_layers + 1, total + 1), np.inf)
    f[0, num_layers, 0] = 0.0
    for s in range(1, num_layers + 1):
        # a stage followed by s - 1 later stages needs max_succ >= s - 1
        best_cfg = np.where(under & (max_succ >= s - 1), cost, np.inf).min(axis=3)  # (k, j, m)
        for m, n in enumerate(sizes):
            shifted = np.full((num_layers, total + 1), np.inf)  # [j, d] = F[s-1, j+1, d-n]
            shifted[:, n:] = f[s - 1, 1:, : total + 1 - n]
            cand = (best_cfg[:, :, m, None] + shifted[None, :, :]).min(axis=1)
            np.minimum(f[s, :num_layers], cand, out=f[s, :num_layers])
    best_s = int(np.argmin(f[:, 0, total]))
    g = float(f[best_s, 0, total])
    if not math.isfinite(g):
        return g, []
    # walk back through the table
    choices: list[tuple[int, ...]] = []
    k, s, d = 0, best_s, total
    while k < num_layers:
        target = f[s, k, d]
        found = False
        for j in range(k, num_layers):
            for m, n in enumerate(sizes):
                if n > d:
                    continue
                ok = under[k, j, m] & (max_succ[k, j, m] >= s - 1)
                if not ok.any():
                    continue
                c = int(np.argmin(np.where(ok, cost[k, j, m], np.inf)))
                if cost[k, j, m, c] + f[s - 1, j + 1, d - n] == target:
                    choices.append((k, j, m, c))
                    k, s, d = j + 1, s - 1, d - int(n)
                    found = True
                    break
            if found:
                break
        if not found:  # pragma: no cover - the table is self-consistent by construction
            raise AssertionError("reference DP reconstruction lost the optimum")
    return g, choices


def solve_stages_reference(problem: StageProblem) -> StageSolution:
    """Alpa's scheme: every distinct finite cost as ``t_max`` (ascending), one full inner DP
    each, stopping once ``(B - 1) * t_max`` alone reaches the best ``T``. Slow but simple."""
    t0 = time.perf_counter()
    b1 = problem.num_micro_batches - 1
    finite = problem.cost[np.isfinite(problem.cost)]
    best_val, best_choices = _INF, None
    trace: list[tuple[float, float]] = []
    for t in np.unique(finite):
        if b1 * t >= best_val:
            break
        g, choices = _reference_inner(problem, float(t))
        if not math.isfinite(g):
            trace.append((float(t), _INF))
            continue
        lat = [float(problem.cost[c]) for c in choices]
        val = stage_objective(lat, problem.num_micro_batches)
        trace.append((float(t), val))
        if val < best_val:
            best_val, best_choices = val, choices
    if best_choices is None:
        raise InfeasibleError(
            "no slicing uses exactly all "
            f"{problem.num_hosts}x{problem.devices_per_host} devices with finite costs and "
            "satisfied memory limits"
        )
    return _make_solution(problem, best_choices, trace, t0, "reference")


# --------------------------------------------------------------------------- generator


def random_stage_problem(
    num_layers: int,
    num_hosts: int,
    devices_per_host: int,
    num_configs: int = 4,
    num_micro_batches: int = 64,
    seed: int = 0,
) -> StageProblem:
    """A realistic synthetic cost table (transformer-like layers on a GPU cluster).

    Compute divides over devices with imperfect efficiency; config ``c`` splits ``n`` devices
    into ``tp = n ** (c / (C - 1))`` tensor-parallel x ``n / tp`` data-parallel ways, trading
    per-layer activation all-reduces (tp) against gradient all-reduces (dp). A collective over
    an axis that spans hosts pays the slow inter-host link. Memory holds the parameters (split
    by tp) plus one activation set per in-flight micro-batch (1F1B: later stages + 1), so small
    submeshes cannot hold long ranges (inf) and ``max_succ`` shrinks with range length.
    """
    num_layers = _check_positive_int("num_layers", num_layers)
    num_configs = _check_positive_int("num_configs", num_configs)
    rng = np.random.default_rng(seed)
    shapes = submesh_shapes(num_hosts, devices_per_host)
    hosts = np.array([h for h, _ in shapes], dtype=np.float64)
    per_host = np.array([d for _, d in shapes], dtype=np.float64)
    n = hosts * per_host
    total = num_hosts * devices_per_host
    flops = rng.uniform(0.8, 1.2, num_layers)
    flops[0] *= 1.5  # embedding-ish first layer
    flops[-1] *= 2.0  # LM-head-ish last layer
    params = rng.uniform(0.8, 1.2, num_layers)
    acts = rng.uniform(0.8, 1.2, num_layers) * rng.uniform(0.1, 0.3)
    iu, ju = np.triu_indices(num_layers)
    length = (ju - iu + 1.0)[:, None]  # (P, 1) per range p = layers iu[p]..ju[p]

    def range_sum(x: np.ndarray) -> np.ndarray:
        prefix = np.concatenate(([0.0], np.cumsum(x)))
        return (prefix[ju + 1] - prefix[iu])[:, None]

    r_flops, r_params, r_acts = range_sum(flops), range_sum(params), range_sum(acts)
    # memory per device: the model fits on the cluster with room to spare, not on one device
    capacity = rng.uniform(2.0, 4.0) * params.sum() / min(total, num_layers)
    intra_beta, inter_beta = 0.02, 0.25  # time per unit moved, per link kind
    alpha = 0.002  # latency per collective call

    compute = r_flops / n * (1.0 + 0.07 * np.log2(n))  # (P, S)
    exps = np.linspace(0.0, 1.0, num_configs) if num_configs > 1 else np.array([0.5])
    noise = rng.uniform(0.95, 1.05, (len(shapes), num_configs))
    cost_u = np.empty((iu.size, len(shapes), num_configs))
    succ_u = np.empty(cost_u.shape, dtype=np.int64)
    for c, e in enumerate(exps):
        tp = n**e
        dp = n / tp
        tp_beta = np.where(tp <= per_host, intra_beta, inter_beta)  # tp axis inside one host?
        dp_beta = np.where(hosts == 1, intra_beta, inter_beta)
        tp_comm = 2.0 * (tp - 1.0) / tp * r_acts / dp * tp_beta + (tp > 1) * alpha * length
        # gradient sync once per iteration, amortised over a typical 16 micro-batches
        dp_comm = (2.0 * (dp - 1.0) / dp * r_params / tp * dp_beta + (dp > 1) * alpha) / 16.0
        latency = (compute + tp_comm + dp_comm) * noise[:, c]
        # 1F1B: parameters (split by tp) + one activation set per in-flight micro-batch
        slots = np.floor((capacity - r_params / tp) / (r_acts / n))
        fits = slots >= 1
        cost_u[:, :, c] = np.where(fits, latency, np.inf)
        succ_u[:, :, c] = np.where(fits, np.minimum(slots - 1, 10**6), 0)
    cost = np.full((num_layers, num_layers, len(shapes), num_configs), np.inf)
    max_succ = np.zeros(cost.shape, dtype=np.int64)
    cost[iu, ju] = cost_u
    max_succ[iu, ju] = succ_u
    names = tuple(f"tp=n^{e:.2f}" for e in exps)
    return StageProblem(
        num_hosts=num_hosts,
        devices_per_host=devices_per_host,
        cost=cost,
        max_succ=max_succ,
        num_micro_batches=num_micro_batches,
        config_names=names,
    )
