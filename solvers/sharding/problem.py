"""The intra-operator sharding problem: data, IOPDDL file format, validation and evaluation.

A problem has nodes (one per operator or tensor) that each pick one of k_v strategies, and
edges whose k_u x k_v matrices price every pair of neighbouring choices (resharding). Nodes
are live on [start, end); at every time point the usages of live nodes must fit the limit.
This is the format of the IOPDDL contest (ASPLOS/EuroSys 2025), so its public instances are
our external benchmark.

Storage is flat numpy arrays with offsets, which keeps 65k-node instances cheap to validate,
evaluate and turn into an ILP; ``ShardingProblem.from_lists`` builds one from nested lists.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import SolverInputError

__all__ = [
    "FORBIDDEN_COST",
    "Evaluation",
    "ShardingProblem",
    "check_choice",
    "evaluate",
    "interval_peak",
    "load_iopddl",
    "save_iopddl",
]

#: Costs at or above this are forbidden choices. IOPDDL marks them with ~1e18; real costs in
#: its instances stay below 1e13, so 1e17 separates the two with room on both sides.
FORBIDDEN_COST = 1e17


def _offsets(sizes: np.ndarray) -> np.ndarray:
    out = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=out[1:])
    return out


@dataclass(frozen=True, eq=False)
class ShardingProblem:
    """One sharding problem in flat form.

    ``node_costs[node_offsets[v] + i]`` is the cost of strategy i of node v (``inf`` or any
    value >= ``FORBIDDEN_COST`` forbids it); ``node_usages`` likewise. ``edge_costs`` holds each
    edge's k_u x k_v matrix row-major, edge after edge. ``aliases`` are node pairs that must
    pick the same strategy index (a donated input and its updated output).
    """

    num_strategies: np.ndarray
    node_costs: np.ndarray
    node_usages: np.ndarray
    intervals: np.ndarray
    edges: np.ndarray
    edge_costs: np.ndarray
    usage_limit: float | None = None
    aliases: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), dtype=np.int64))
    name: str = ""
    node_names: tuple[str, ...] | None = None
    strategy_names: tuple[tuple[str, ...], ...] | None = None

    def __post_init__(self) -> None:
        def fix(attr: str, dtype: Any, shape_tail: tuple[int, ...] = ()) -> np.ndarray:
            value = np.asarray(getattr(self, attr), dtype=dtype)
            if value.size == 0:
                value = value.reshape((0, *shape_tail))
            object.__setattr__(self, attr, value)
            return value

        k = fix("num_strategies", np.int64)
        costs = fix("node_costs", np.float64)
        usages = fix("node_usages", np.float64)
        intervals = fix("intervals", np.int64, (2,))
        edges = fix("edges", np.int64, (2,))
        ecosts = fix("edge_costs", np.float64)
        aliases = fix("aliases", np.int64, (2,))
        n = len(k)
        if k.ndim != 1:
            raise SolverInputError(f"num_strategies: expected a 1-D array, got shape {k.shape}")
        bad = np.flatnonzero(k < 1)
        if bad.size:
            raise SolverInputError(
                f"nodes.costs[{bad[0]}]: node {bad[0]} has {k[bad[0]]} strategies; "
                "every node needs at least one"
            )
        total = int(k.sum())
        for attr, arr in (("node_costs", costs), ("node_usages", usages)):
            if arr.shape != (total,):
                raise SolverInputError(
                    f"{attr}: expected {total} entries (sum of strategies), got shape {arr.shape}"
                )
        _check_values("nodes.costs", costs, self.node_offsets, allow_inf=True)
        _check_values("nodes.usages", usages, self.node_offsets, allow_inf=False)
        if intervals.shape != (n, 2):
            raise SolverInputError(
                f"nodes.intervals: expected shape ({n}, 2), got {intervals.shape}"
            )
        bad = np.flatnonzero((intervals[:, 0] > intervals[:, 1]) | (intervals[:, 0] < 0))
        if bad.size:
            v = int(bad[0])
            raise SolverInputError(
                f"nodes.intervals[{v}]: {intervals[v].tolist()} is not a valid [start, end) "
                "with 0 <= start <= end"
            )
        for attr, pairs in (("edges.nodes", edges), ("aliases", aliases)):
            if pairs.ndim != 2 or pairs.shape[1] != 2:
                raise SolverInputError(f"{attr}: expected shape (m, 2), got {pairs.shape}")
            bad = np.flatnonzero(((pairs < 0) | (pairs >= n)).any(axis=1))
            if bad.size:
                i = int(bad[0])
                raise SolverInputError(
                    f"{attr}[{i}]: {pairs[i].tolist()} names a node outside 0..{n - 1}"
                )
        if ecosts.shape != (int(self.edge_offsets[-1]),):
            raise SolverInputError(
                f"edges.costs: expected {int(self.edge_offsets[-1])} entries in all "
                f"(sum of |S_u|*|S_v|), got shape {ecosts.shape}"
            )
        _check_values("edges.costs", ecosts, self.edge_offsets, allow_inf=True)
        bad = np.flatnonzero(k[aliases[:, 0]] != k[aliases[:, 1]]) if len(aliases) else []
        if len(bad):
            i = int(bad[0])
            u, v = aliases[i].tolist()
            raise SolverInputError(
                f"aliases[{i}]: nodes {u} and {v} have {k[u]} and {k[v]} strategies; "
                "aliased nodes must have the same number"
            )
        if self.usage_limit is not None:
            limit = float(self.usage_limit)
            if not math.isfinite(limit) or limit < 0:
                raise SolverInputError(
                    f"usage_limit: {self.usage_limit!r} is not a finite number >= 0 (or None)"
                )
            object.__setattr__(self, "usage_limit", limit)
        self._check_labels()

    def _check_labels(self) -> None:
        """Optional labels (for tables and notebooks) must match the nodes they describe."""
        k = self.num_strategies
        if self.node_names is not None:
            names = tuple(str(x) for x in self.node_names)
            if len(names) != len(k):
                raise SolverInputError(f"node_names: expected {len(k)} names, got {len(names)}")
            object.__setattr__(self, "node_names", names)
        if self.strategy_names is not None:
            rows = tuple(tuple(str(x) for x in row) for row in self.strategy_names)
            if len(rows) != len(k):
                raise SolverInputError(f"strategy_names: expected {len(k)} lists, got {len(rows)}")
            for v, row in enumerate(rows):
                if len(row) != k[v]:
                    raise SolverInputError(
                        f"strategy_names[{v}]: expected {k[v]} names (one per strategy), "
                        f"got {len(row)}"
                    )
            object.__setattr__(self, "strategy_names", rows)

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_lists(
        cls,
        costs: Sequence[Sequence[float]],
        usages: Sequence[Sequence[float]] | None = None,
        intervals: Sequence[Sequence[int]] | None = None,
        edges: Sequence[Sequence[int]] = (),
        edge_costs: Sequence[Any] = (),
        usage_limit: float | None = None,
        aliases: Sequence[Sequence[int]] = (),
        name: str = "",
        node_names: Sequence[str] | None = None,
        strategy_names: Sequence[Sequence[str]] | None = None,
    ) -> ShardingProblem:
        """Build from nested lists; edge costs may be k_u x k_v matrices or flat row-major."""
        n = len(costs)
        k = np.array([len(c) for c in costs], dtype=np.int64)
        if usages is None:
            usages = [[0.0] * int(kv) for kv in k]
        if len(usages) != n:
            raise SolverInputError(f"nodes.usages: expected {n} nodes, got {len(usages)}")
        for v, (c, u) in enumerate(zip(costs, usages, strict=True)):
            if len(u) != len(c):
                raise SolverInputError(
                    f"nodes.usages[{v}]: expected {len(c)} entries (one per strategy of "
                    f"nodes.costs[{v}]), got {len(u)}"
                )
        if intervals is None:
            intervals = [[0, 0]] * n
        if len(intervals) != n:
            raise SolverInputError(f"nodes.intervals: expected {n} nodes, got {len(intervals)}")
        for v, iv in enumerate(intervals):
            if len(iv) != 2:
                raise SolverInputError(
                    f"nodes.intervals[{v}]: expected [start, end], got {list(iv)!r}"
                )
        if len(edges) != len(edge_costs):
            raise SolverInputError(
                f"edges.costs: expected {len(edges)} matrices (one per edge), got {len(edge_costs)}"
            )
        flat_edges = []
        for e, (pair, mat) in enumerate(zip(edges, edge_costs, strict=True)):
            if len(pair) != 2:
                raise SolverInputError(f"edges.nodes[{e}]: expected [u, v], got {list(pair)!r}")
            u, v = int(pair[0]), int(pair[1])
            if not (0 <= u < n and 0 <= v < n):
                raise SolverInputError(
                    f"edges.nodes[{e}]: [{u}, {v}] names a node outside 0..{n - 1}"
                )
            arr = np.asarray(mat, dtype=np.float64).reshape(-1)
            if arr.size != k[u] * k[v]:
                raise SolverInputError(
                    f"edges.costs[{e}]: edge ({u}, {v}) needs {k[u]}x{k[v]} = {k[u] * k[v]} "
                    f"entries (|S_u|*|S_v|), got {arr.size}"
                )
            flat_edges.append(arr)
        return cls(
            num_strategies=k,
            node_costs=np.concatenate([np.asarray(c, np.float64) for c in costs]) if n else [],
            node_usages=np.concatenate([np.asarray(u, np.float64) for u in usages]) if n else [],
            intervals=np.asarray(intervals, dtype=np.int64).reshape(n, 2),
            edges=np.asarray(edges, dtype=np.int64).reshape(-1, 2),
            edge_costs=np.concatenate(flat_edges) if flat_edges else np.zeros(0),
            usage_limit=usage_limit,
            aliases=np.asarray(aliases, dtype=np.int64).reshape(-1, 2),
            name=name,
            node_names=None if node_names is None else tuple(node_names),
            strategy_names=None if strategy_names is None else tuple(map(tuple, strategy_names)),
        )

    # ----------------------------------------------------------------- views
    @property
    def num_nodes(self) -> int:
        return len(self.num_strategies)

    @property
    def num_edges(self) -> int:
        return len(self.edges)

    @cached_property
    def node_offsets(self) -> np.ndarray:
        """``node_offsets[v]:node_offsets[v+1]`` slices node v's strategies."""
        return _offsets(self.num_strategies)

    @cached_property
    def edge_offsets(self) -> np.ndarray:
        """``edge_offsets[e]:edge_offsets[e+1]`` slices edge e's flat matrix."""
        k = self.num_strategies
        sizes = k[self.edges[:, 0]] * k[self.edges[:, 1]] if len(self.edges) else np.zeros(0)
        return _offsets(np.asarray(sizes, dtype=np.int64))

    def node_label(self, v: int) -> str:
        return self.node_names[v] if self.node_names is not None else f"node {v}"

    def strategy_label(self, v: int, i: int) -> str:
        return self.strategy_names[v][i] if self.strategy_names is not None else str(i)

    def costs_of(self, v: int) -> np.ndarray:
        return self.node_costs[self.node_offsets[v] : self.node_offsets[v + 1]]

    def usages_of(self, v: int) -> np.ndarray:
        return self.node_usages[self.node_offsets[v] : self.node_offsets[v + 1]]

    def edge_matrix(self, e: int) -> np.ndarray:
        u, v = self.edges[e]
        flat = self.edge_costs[self.edge_offsets[e] : self.edge_offsets[e + 1]]
        return flat.reshape(self.num_strategies[u], self.num_strategies[v])

    def with_usage_limit(self, usage_limit: float | None) -> ShardingProblem:
        """The same problem under another memory budget (for what-if studies)."""
        return dataclasses.replace(self, usage_limit=usage_limit)

    def summary(self) -> dict[str, Any]:
        """Sizes that tell how hard an instance is."""
        return {
            "name": self.name,
            "nodes": self.num_nodes,
            "edges": self.num_edges,
            "strategies": int(self.num_strategies.sum()),
            "max_strategies": int(self.num_strategies.max()) if self.num_nodes else 0,
            "edge_entries": int(self.edge_offsets[-1]),
            "time_points": int(self.intervals.max()) if self.num_nodes else 0,
            "usage_limit": self.usage_limit,
        }

    # ----------------------------------------------------------------- IOPDDL JSON
    def to_iopddl_dict(self) -> dict[str, Any]:
        """The contest's JSON structure (plus ``aliases`` when there are any)."""
        off, eoff = self.node_offsets, self.edge_offsets

        def clean(values: np.ndarray) -> list[float | int]:
            # inf is not JSON: write the contest's own forbidden marker instead.
            out = np.where(np.isinf(values), 1e18, values)
            return [int(x) if float(x).is_integer() else float(x) for x in out]

        problem: dict[str, Any] = {
            "name": self.name,
            "nodes": {
                "intervals": self.intervals.tolist(),
                "costs": [
                    clean(self.node_costs[off[v] : off[v + 1]]) for v in range(self.num_nodes)
                ],
                "usages": [
                    clean(self.node_usages[off[v] : off[v + 1]]) for v in range(self.num_nodes)
                ],
            },
            "edges": {
                "nodes": self.edges.tolist(),
                "costs": [
                    clean(self.edge_costs[eoff[e] : eoff[e + 1]]) for e in range(self.num_edges)
                ],
            },
        }
        if self.usage_limit is not None:
            limit = self.usage_limit
            problem["usage_limit"] = int(limit) if float(limit).is_integer() else limit
        if len(self.aliases):
            problem["aliases"] = self.aliases.tolist()
        if self.node_names is not None:
            problem["node_names"] = list(self.node_names)
        if self.strategy_names is not None:
            problem["strategy_names"] = [list(row) for row in self.strategy_names]
        return {"problem": problem}

    @classmethod
    def from_iopddl_dict(cls, data: Any) -> ShardingProblem:
        """Parse the contest's JSON structure, naming the field of anything malformed."""
        problem = _field(data, "problem", "")
        nodes = _field(problem, "nodes", "problem.")
        edges = (
            _field(problem, "edges", "problem.")
            if "edges" in problem
            else {"nodes": [], "costs": []}
        )
        costs = _list_field(nodes, "costs", "problem.nodes.")
        usages = _list_field(nodes, "usages", "problem.nodes.")
        intervals = _list_field(nodes, "intervals", "problem.nodes.")
        for name, rows in (("costs", costs), ("usages", usages)):
            for v, row in enumerate(rows):
                if not isinstance(row, list) or not row:
                    raise SolverInputError(
                        f"problem.nodes.{name}[{v}]: expected a non-empty list of numbers, "
                        f"got {row!r}"
                    )
                _check_numbers(f"problem.nodes.{name}[{v}]", row)
        edge_costs = _list_field(edges, "costs", "problem.edges.")
        for e, row in enumerate(edge_costs):
            if not isinstance(row, list):
                raise SolverInputError(f"problem.edges.costs[{e}]: expected a list, got {row!r}")
            _check_numbers(f"problem.edges.costs[{e}]", row)
        limit = problem.get("usage_limit")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int | float)):
            raise SolverInputError(f"problem.usage_limit: expected a number, got {limit!r}")
        name = problem.get("name", "")
        try:
            return cls.from_lists(
                costs,
                usages,
                intervals,
                _list_field(edges, "nodes", "problem.edges."),
                edge_costs,
                limit,
                problem.get("aliases", []),
                str(name),
                problem.get("node_names"),
                problem.get("strategy_names"),
            )
        except SolverInputError as err:
            raise SolverInputError(f"problem.{err}") from None


def _field(obj: Any, key: str, prefix: str) -> Any:
    if not isinstance(obj, dict):
        raise SolverInputError(
            f"{prefix.rstrip('.') or 'file'}: expected an object, got {type(obj).__name__}"
        )
    if key not in obj:
        raise SolverInputError(f"{prefix}{key}: missing field")
    return obj[key]


def _list_field(obj: Any, key: str, prefix: str) -> list[Any]:
    value = _field(obj, key, prefix)
    if not isinstance(value, list):
        raise SolverInputError(f"{prefix}{key}: expected a list, got {type(value).__name__}")
    return value


def _check_numbers(where: str, row: list[Any]) -> None:
    for i, x in enumerate(row):
        if isinstance(x, bool) or not isinstance(x, int | float):
            raise SolverInputError(f"{where}[{i}]: expected a number, got {x!r}")


def _check_values(where: str, values: np.ndarray, offsets: np.ndarray, *, allow_inf: bool) -> None:
    """Reject NaN, negative (and, for usages, infinite) entries, naming the owner's index."""
    bad_mask = np.isnan(values) | (values < 0)
    if not allow_inf:
        bad_mask |= np.isinf(values)
    bad = np.flatnonzero(bad_mask)
    if bad.size:
        flat = int(bad[0])
        owner = int(np.searchsorted(offsets, flat, side="right") - 1)
        what = "finite numbers >= 0" if not allow_inf else "numbers >= 0 (inf forbids a choice)"
        raise SolverInputError(
            f"{where}[{owner}][{flat - int(offsets[owner])}]: {values[flat]!r} is invalid; "
            f"expected {what}"
        )


def load_iopddl(path: str | Path) -> ShardingProblem:
    """Load a contest problem file (``.json`` or ``.json.gz``)."""
    path = Path(path)
    gz = path.suffix == ".gz"
    opener = gzip.open if gz else open
    try:
        with opener(path, "rt") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as err:
        raise SolverInputError(f"{path}: not valid JSON ({err})") from None
    except (EOFError, zlib.error, gzip.BadGzipFile, UnicodeDecodeError) as err:
        what = "a complete gzip file" if gz else "UTF-8 text"
        raise SolverInputError(
            f"{path}: not {what} ({type(err).__name__}: {err}); the file is corrupt or truncated"
        ) from None
    try:
        return ShardingProblem.from_iopddl_dict(data)
    except SolverInputError as err:
        raise SolverInputError(f"{path}: {err}") from None


def save_iopddl(problem: ShardingProblem, path: str | Path) -> None:
    """Write a problem in the contest format (gzip when the name ends in ``.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt") as fh:
        json.dump(problem.to_iopddl_dict(), fh)


# --------------------------------------------------------------------- evaluation
@dataclass(frozen=True)
class Evaluation:
    """Cost and feasibility of one assignment, with the reasons it is infeasible if so."""

    cost: float
    node_cost: float
    edge_cost: float
    peak_usage: float
    peak_time: int
    feasible: bool
    forbidden_nodes: tuple[int, ...]
    forbidden_edges: tuple[int, ...]
    alias_violations: tuple[int, ...]
    over_limit: bool

    def explain(self) -> str:
        if self.feasible:
            return f"feasible, cost {self.cost:.6g}, peak usage {self.peak_usage:.6g}"
        reasons = []
        if self.forbidden_nodes:
            reasons.append(f"forbidden strategy at nodes {list(self.forbidden_nodes[:5])}")
        if self.forbidden_edges:
            reasons.append(f"forbidden pair on edges {list(self.forbidden_edges[:5])}")
        if self.alias_violations:
            reasons.append(f"alias pairs {list(self.alias_violations[:5])} differ")
        if self.over_limit:
            reasons.append(
                f"peak usage {self.peak_usage:.6g} at time {self.peak_time} over the limit"
            )
        return "infeasible: " + "; ".join(reasons)


def interval_peak(starts: np.ndarray, ends: np.ndarray, values: np.ndarray) -> tuple[float, int]:
    """Peak of Σ values over intervals [start, end) live at a time, and when it occurs."""
    live = starts < ends
    if not live.any():
        return 0.0, 0
    times = np.concatenate([starts[live], ends[live]])
    deltas = np.concatenate([values[live], -values[live]])
    order = np.argsort(times, kind="stable")
    grid, first = np.unique(times[order], return_index=True)
    # Memory at time t counts intervals with start <= t < end: all deltas with time <= t.
    running = np.cumsum(np.add.reduceat(deltas[order], first))
    at = int(np.argmax(running))
    return float(running[at]), int(grid[at])


def check_choice(
    name: str, choice: Sequence[int] | np.ndarray, num_strategies: np.ndarray, owner: str = "node"
) -> np.ndarray:
    """``choice`` as an int array, after checking one valid strategy index per ``owner``."""
    out = np.asarray(choice, dtype=np.int64)
    n = len(num_strategies)
    if out.shape != (n,):
        raise SolverInputError(
            f"{name}: expected {n} strategy indices (one per {owner}), got shape {out.shape}"
        )
    bad = np.flatnonzero((out < 0) | (out >= num_strategies))
    if bad.size:
        v = int(bad[0])
        raise SolverInputError(
            f"{name}[{v}]: strategy {out[v]} does not exist; {owner} {v} has "
            f"{num_strategies[v]} strategies"
        )
    return out


def evaluate(problem: ShardingProblem, choice: Sequence[int] | np.ndarray) -> Evaluation:
    """Cost, peak usage and feasibility of ``choice`` (one strategy index per node)."""
    choice = check_choice("choice", choice, problem.num_strategies)
    ncost = problem.node_costs[problem.node_offsets[:-1] + choice]
    usage = problem.node_usages[problem.node_offsets[:-1] + choice]
    if problem.num_edges:
        u, v = problem.edges[:, 0], problem.edges[:, 1]
        idx = problem.edge_offsets[:-1] + choice[u] * problem.num_strategies[v] + choice[v]
        ecost = problem.edge_costs[idx]
    else:
        ecost = np.zeros(0)
    forbidden_nodes = np.flatnonzero(ncost >= FORBIDDEN_COST)
    forbidden_edges = np.flatnonzero(ecost >= FORBIDDEN_COST)
    al = problem.aliases
    alias_bad = (
        np.flatnonzero(choice[al[:, 0]] != choice[al[:, 1]]) if len(al) else np.zeros(0, int)
    )
    peak, peak_time = interval_peak(problem.intervals[:, 0], problem.intervals[:, 1], usage)
    limit = problem.usage_limit
    # A relative tolerance keeps float rounding of large usages from flipping feasibility.
    over = limit is not None and peak > limit * (1 + 1e-9) + 1e-9
    feasible = not (forbidden_nodes.size or forbidden_edges.size or alias_bad.size or over)
    node_total = float(ncost.sum())
    edge_total = float(ecost.sum())
    cost = (
        node_total + edge_total if not (forbidden_nodes.size or forbidden_edges.size) else math.inf
    )
    return Evaluation(
        cost=cost,
        node_cost=node_total,
        edge_cost=edge_total,
        peak_usage=peak,
        peak_time=peak_time,
        feasible=feasible,
        forbidden_nodes=tuple(int(x) for x in forbidden_nodes),
        forbidden_edges=tuple(int(x) for x in forbidden_edges),
        alias_violations=tuple(int(x) for x in alias_bad),
        over_limit=over,
    )
