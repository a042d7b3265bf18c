"""The stage DP's problem and answer: ``StageProblem`` (the cost table, JSON round-trip), ``Stage``,
``StageSolution``, the submesh shapes of a cluster and the objective ``T``.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from ..errors import SolverInputError

__all__ = ["Stage", "StageProblem", "StageSolution", "stage_objective", "submesh_shapes"]


_INF = math.inf


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise SolverInputError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def submesh_shapes(num_hosts: int, devices_per_host: int) -> tuple[tuple[int, int], ...]:
    """Alpa's submesh shapes ``(hosts, devices)``, in increasing device count.

    ``(1, 1), (1, 2), (1, 4), ...`` (powers of two below ``devices_per_host``), then
    ``(1, M), (2, M), ..., (N, M)``. With ``M`` not a power of two the one-host part is the
    powers of two that divide ``M``, then ``(1, M)``: each width divides the next, so any
    choice whose device counts fill the cluster also packs into its hosts (with 3 devices a
    host, widths 1 and 2 could fill 6 devices as 2 + 2 + 2 yet not fit two hosts of 3).
    With ``M == 1`` only ``(h, 1)``.
    """
    n = _check_positive_int("num_hosts", num_hosts)
    m = _check_positive_int("devices_per_host", devices_per_host)
    shapes: list[tuple[int, int]] = []
    p = 1
    while p < m and m % p == 0:
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


def _json_float(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _arrays_from_cells(shape: Any, cells: Any) -> tuple[np.ndarray, np.ndarray]:
    """The dense ``cost`` and ``max_succ`` arrays of a sparse record (see ``to_dict``)."""
    if (
        not isinstance(shape, list | tuple)
        or len(shape) != 4
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shape)
    ):
        raise SolverInputError(f"shape: expected [L, L, S, C] of positive integers, got {shape!r}")
    if not isinstance(cells, list | tuple):
        raise SolverInputError(f"cells: expected a list of cells, got {type(cells).__name__}")
    cost = np.full(tuple(shape), _INF)
    max_succ = np.zeros(tuple(shape), dtype=np.int64)
    for k, cell in enumerate(cells):
        ok = isinstance(cell, list | tuple) and len(cell) == 6
        at = tuple(cell[:4]) if ok else ()
        ok = ok and all(
            isinstance(a, int) and not isinstance(a, bool) and 0 <= a < n
            for a, n in zip(at, shape, strict=True)
        )
        value, succ = (cell[4], cell[5]) if ok else (None, None)
        if (
            not ok
            or not (value is None or isinstance(value, int | float))
            or not (isinstance(succ, int) and not isinstance(succ, bool))
        ):
            raise SolverInputError(
                f"cells[{k}]: expected [i, j, submesh, config, cost or null, max_succ] with "
                f"indices inside shape {list(shape)}, got {cell!r:.120}"
            )
        cost[at] = _INF if value is None else float(value)
        max_succ[at] = succ
    return cost, max_succ


def _shape_pairs(value: Any) -> tuple[tuple[int, int], ...]:
    """``submeshes`` as a tuple of (hosts, devices) pairs of ints."""
    if not isinstance(value, list | tuple):
        raise SolverInputError(f"submeshes: expected a list of [hosts, devices], got {value!r:.80}")
    pairs = []
    for k, pair in enumerate(value):
        ok = isinstance(pair, list | tuple) and len(pair) == 2
        ok = ok and all(isinstance(x, int | np.integer) and not isinstance(x, bool) for x in pair)
        if not ok:
            raise SolverInputError(
                f"submeshes[{k}]: expected [hosts, devices] as two ints, got {pair!r:.80}"
            )
        pairs.append((int(pair[0]), int(pair[1])))
    return tuple(pairs)


def _checked_submeshes(value: Any, n: int, m: int) -> tuple[tuple[int, int], ...]:
    """``submeshes``, checked to be distinct shapes of ``submesh_shapes(n, m)`` in its order
    (increasing device count, which the DP's device windows assume)."""
    shapes = _shape_pairs(value)
    every = submesh_shapes(n, m)
    where = {s: k for k, s in enumerate(every)}
    for k, s in enumerate(shapes):
        if s not in where:
            raise SolverInputError(
                f"submeshes[{k}] = {s} is not a submesh shape of {n} hosts x {m} devices; "
                f"valid shapes: {every[:6]}{' ...' if len(every) > 6 else ''}"
            )
    order = [where[s] for s in shapes]
    if not shapes or order != sorted(set(order)):
        raise SolverInputError(
            f"submeshes: expected distinct shapes in increasing device count (submesh_shapes "
            f"order), at least one; got {shapes[:8]}"
        )
    return shapes


def _float_array_from_nested(data: Any) -> np.ndarray:
    """A dense record's nested lists as an array (``None`` -> ``inf``)."""
    obj = np.array(data, dtype=object)
    obj[np.equal(obj, None)] = _INF
    return obj.astype(np.float64)


@dataclass(frozen=True, eq=False)
class StageProblem:
    """Cost table of every (layer range, submesh, config) and the pipeline parameters.

    ``cost`` and ``max_succ`` have shape ``(L, L, S, C)``: ``S`` indexes ``submeshes``, the
    shapes a planner searches (a subsequence of ``submesh_shapes(N, M)``; None: all of
    them, as Alpa). Entries with ``i > j`` are ignored (stored as ``inf`` / ``0``). ``cost``
    may hold ``inf`` (that stage does not fit) but no NaN and nothing negative;
    ``max_succ`` holds non-negative integers. The arrays are stored as read-only float64 /
    int64 copies.
    """

    num_hosts: int
    devices_per_host: int
    cost: np.ndarray
    max_succ: np.ndarray
    num_micro_batches: int
    config_names: tuple[str, ...] | None = None
    # Only the searched shapes get a column: a 1T model's 384 hosts have 387 shapes, of which
    # the planner searches 12-20, and a dense table of all of them took half a GiB per count.
    submeshes: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        n = _check_positive_int("num_hosts", self.num_hosts)
        m = _check_positive_int("devices_per_host", self.devices_per_host)
        b = _check_positive_int("num_micro_batches", self.num_micro_batches)
        object.__setattr__(self, "num_hosts", n)
        object.__setattr__(self, "devices_per_host", m)
        object.__setattr__(self, "num_micro_batches", b)
        if self.submeshes is not None:
            object.__setattr__(self, "submeshes", _checked_submeshes(self.submeshes, n, m))
        shapes = self.submesh_shapes
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
                f"submeshes (all submesh_shapes of the cluster where None); got {cost.shape[2:]}"
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
        if self.submeshes is not None:
            return self.submeshes
        return submesh_shapes(self.num_hosts, self.devices_per_host)

    @property
    def submesh_sizes(self) -> np.ndarray:
        """Device count of every submesh, increasing."""
        return np.array([h * d for h, d in self.submesh_shapes], dtype=np.int64)

    def plus(self, extra: ArrayLike) -> StageProblem:
        """This problem with ``extra[i, j, s]`` seconds (finite, >= 0; shape ``(L, L, S)``)
        added to every config's cell of range ``i..j`` on submesh ``s``. It shares this
        problem's ``max_succ`` and copies only ``cost``: a charged variant of a large table
        (a GB at Megatron's 1T) costs one new cost array, not a revalidated pair."""
        add = np.asarray(extra, dtype=np.float64)
        if add.shape != self.cost.shape[:3]:
            raise SolverInputError(
                f"extra must have shape (L, L, S) = {self.cost.shape[:3]}, got {add.shape}"
            )
        if not (np.isfinite(add).all() and (add >= 0).all()):
            raise SolverInputError("extra must hold finite seconds >= 0")
        cost = self.cost + add[:, :, :, None]  # inf stays inf: i > j and misfits unchanged
        cost.flags.writeable = False
        out = copy.copy(self)
        object.__setattr__(out, "cost", cost)
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StageProblem):
            return NotImplemented
        return (
            self.num_hosts == other.num_hosts
            and self.devices_per_host == other.devices_per_host
            and self.num_micro_batches == other.num_micro_batches
            and self.config_names == other.config_names
            and self.submesh_shapes == other.submesh_shapes
            and self.cost.shape == other.cost.shape
            and bool(np.array_equal(self.cost, other.cost))
            and bool(np.array_equal(self.max_succ, other.max_succ))
        )

    __hash__ = None  # type: ignore[assignment]  # holds arrays: equal but not hashable

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: the table's ``shape`` and, as ``cells``, one ``[i, j, submesh,
        config, cost, max_succ]`` per cell with a finite cost or a nonzero ``max_succ`` (every
        other cell is ``inf`` / 0). A planner's table is mostly empty (a 1T model's on 384
        hosts: 39M cells, about 1% of them set), and dense nested lists of it took GiBs."""
        set_cells = np.isfinite(self.cost) | (self.max_succ != 0)
        at = np.argwhere(set_cells).tolist()  # C order, as boolean indexing
        costs = [_json_float(x) for x in self.cost[set_cells].tolist()]
        cells = zip(at, costs, self.max_succ[set_cells].tolist(), strict=True)
        return {
            "num_hosts": self.num_hosts,
            "devices_per_host": self.devices_per_host,
            "num_micro_batches": self.num_micro_batches,
            "config_names": None if self.config_names is None else list(self.config_names),
            "submeshes": None if self.submeshes is None else [list(s) for s in self.submeshes],
            "shape": list(self.cost.shape),
            "cells": [[*at, cost, succ] for at, cost, succ in cells],
        }

    def to_json(self) -> str:
        """Standard JSON (no NaN/Infinity tokens); :meth:`from_json` reads it back."""
        return json.dumps(self.to_dict(), allow_nan=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageProblem:
        """Inverse of :meth:`to_dict`; also reads the dense ``cost`` / ``max_succ`` nested
        lists that records written before the sparse form hold (and, without
        ``submeshes``, a table over every submesh shape, as records before it)."""
        names, submeshes = data.get("config_names"), data.get("submeshes")
        if "cells" in data:
            cost, max_succ = _arrays_from_cells(data.get("shape"), data["cells"])
        else:
            cost = _float_array_from_nested(data["cost"])
            max_succ = np.array(data["max_succ"], dtype=np.int64)
        return cls(
            num_hosts=data["num_hosts"],
            devices_per_host=data["devices_per_host"],
            cost=cost,
            max_succ=max_succ,
            num_micro_batches=data["num_micro_batches"],
            config_names=None if names is None else tuple(names),
            submeshes=None if submeshes is None else _shape_pairs(submeshes),
        )

    @classmethod
    def from_json(cls, text: str) -> StageProblem:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))


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
