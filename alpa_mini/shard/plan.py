"""``ShardingPlan``: what the intra-operator planner decided for one program on one mesh.

It is plain data (JSON round-trip, no pickle): the layout of every tensor, the strategy of
every operator, the collectives the plan expects, and predicted compute, communication,
resharding time and peak memory with the ILP's status. Lowering reads it; users inspect it:
``explain`` says why the ILP chose an operator's strategy or an input's layout (its cost terms
against the best alternatives), and ``to_records`` / ``to_dataframe`` export it as tables.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from .._validate import format_bytes
from ..graph.planning_stats import PlanningStats
from .spec import ShardingSpec

if TYPE_CHECKING:
    import pandas

    from .explain import Explanation

__all__ = [
    "Alternative", "MeshTrial", "NodePlan", "PlannedCollective", "ShardingPlan", "TensorPlan",
]  # fmt: skip


@dataclass(frozen=True)
class Alternative:
    """One strategy of one ILP choice (an operator's strategy or an input's layout), priced.

    ``reshard`` is the resharding time on every ILP edge touching the choice (to its operands'
    producers and to its results' readers) with all neighbours held at their chosen strategies,
    so ``alt.total - chosen.total`` is exactly the change of the ILP objective if only this one
    choice moved. ``memory`` is the strategy's own bytes per device (the ILP's usage term).
    ``fits`` is an estimate: False when the plan's peak minus the chosen strategy's memory plus
    this one's exceeds the memory budget (always True without a budget). The estimate is
    conservative: a move it says fits never exceeds the budget, but one it rejects might not.
    """

    strategy: str
    compute: float
    comm: float
    reshard: float
    memory: float
    fits: bool = True

    @property
    def total(self) -> float:
        """Seconds this choice adds to the ILP objective: compute + comm + reshard."""
        return self.compute + self.comm + self.reshard


#: The order of an ``Alternative``'s fields in a plan's JSON rows.
ALTERNATIVE_FIELDS = ("strategy", "compute", "comm", "reshard", "memory", "fits")


@dataclass(frozen=True)
class TensorPlan:
    """One tensor's layout; ``role`` is param/state/batch/const/intermediate.

    ``producer`` is the operator that computes it (None for graph inputs and constants);
    ``alternatives`` prices a graph input's layout choice (see ``Alternative``), else empty.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    spec: ShardingSpec | None  # None for constants (replicated, never constrained)
    producer: int | None = None
    alternatives: tuple[Alternative, ...] = ()
    #: A parameter's dimensions a contraction pairs with the rows' values (an expert
    #: dimension; ``accumulators.paired_dims``), which decide how its gradient accumulates.
    paired_dims: tuple[int, ...] = ()


@dataclass(frozen=True)
class NodePlan:
    """One operator's chosen strategy, the layouts it reads, and its own predicted costs.

    ``alternatives``, sorted by total: the chosen strategy, the cheapest others and the fully
    replicated one (see ``Alternative``); empty in plans saved before they were recorded.
    """

    primitive: str
    strategy: str
    in_specs: tuple[ShardingSpec | None, ...]
    compute: float
    comm: float
    source: str = ""
    num_strategies: int = 1
    alternatives: tuple[Alternative, ...] = ()


@dataclass(frozen=True)
class PlannedCollective:
    """A collective the plan expects XLA to emit: from an operator or a resharding edge."""

    kind: str
    axes: tuple[int, ...]
    nbytes: float
    seconds: float
    origin: str  # "op" (partial sums) or "reshard"
    node: int  # the operator that performs or needs it
    tensor: int | None = None  # the resharded tensor, for "reshard"


@dataclass(frozen=True)
class MeshTrial:
    """One logical mesh the ShardParallel search planned: what came of it and how long it
    took. ``predicted_time`` is None when nothing fit there (``detail`` says why)."""

    shape: tuple[int, ...]
    predicted_time: float | None
    seconds: float = 0.0
    outcome: str = "optimal"  # the ILP's status, or the error's class name
    peak_memory: float | None = None
    core_nodes: int | None = None  # ILP nodes left after simplification
    detail: str = ""

    def label(self) -> str:
        what = "infeasible" if self.predicted_time is None else _seconds(self.predicted_time)
        return f"{self.shape}: {what}"

    @classmethod
    def from_json(cls, item: Any) -> MeshTrial:
        """A saved trial; plans saved before trials had timings stored ``[shape, time]``."""
        if isinstance(item, list | tuple):
            shape, t = item
            return cls(tuple(shape), None if t is None else float(t))
        return cls(**{**item, "shape": tuple(item["shape"])})


@dataclass(frozen=True)
class ShardingPlan:
    """Per-tensor layouts, per-node strategies and predictions for one program on one mesh."""

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    tensors: tuple[TensorPlan, ...]
    nodes: tuple[NodePlan, ...]
    inputs: tuple[int, ...]  # tensor ids of the flat program inputs
    outputs: tuple[int, ...]
    output_specs: tuple[ShardingSpec, ...]
    collectives: tuple[PlannedCollective, ...]
    compute_time: float
    comm_time: float
    reshard_time: float
    peak_memory: float
    memory_budget: float | None
    solver: dict[str, Any] = field(default_factory=dict)
    #: Every mesh the search planned (provenance: ``==`` ignores it, as timings differ).
    mesh_search: tuple[MeshTrial, ...] = field(default=(), compare=False)
    #: Where planning spent its time; not part of the plan's identity (``==`` ignores it).
    planning: PlanningStats | None = field(default=None, compare=False)

    # ----------------------------------------------------------------- derived views
    @property
    def predicted_time(self) -> float:
        return self.compute_time + self.comm_time + self.reshard_time

    @property
    def input_specs(self) -> tuple[ShardingSpec, ...]:
        return tuple(self.tensors[t].spec or ShardingSpec.replicated(0) for t in self.inputs)

    def partition_spec(self, tensor: int | str) -> Any:
        """The ``PartitionSpec`` of a tensor given by id or name."""
        plan = self.tensor(tensor)
        spec = plan.spec or ShardingSpec.replicated(len(plan.shape))
        return spec.to_partition_spec(self.axis_names)

    def tensor(self, tensor: int | str) -> TensorPlan:
        if isinstance(tensor, int):
            if not 0 <= tensor < len(self.tensors):
                raise KeyError(f"tensor: {tensor} is not a tensor id (0..{len(self.tensors) - 1})")
            return self.tensors[tensor]
        for t in self.tensors:
            if t.name == tensor:
                return t
        inputs = [self.tensors[i].name for i in self.inputs][:8]
        raise KeyError(f"tensor: no tensor named {tensor!r}; inputs are named like {inputs}")

    def collective_counts(self) -> dict[str, dict[str, float]]:
        """Predicted collectives per kind: count and bytes (the HLO parser's convention)."""
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "bytes": 0.0})
        for c in self.collectives:
            out[c.kind]["count"] += 1
            out[c.kind]["bytes"] += c.nbytes
        return dict(out)

    def summary(self, *, max_rows: int = 40) -> Any:
        """A rich renderable: inputs' layouts, the costliest operators, predictions, solver."""
        from rich.console import Group
        from rich.table import Table

        head = Table(title=f"ShardingPlan on mesh {self.mesh_shape} ({', '.join(self.axis_names)})")
        for col in ("prediction", "value"):
            head.add_column(col)
        head.add_row("compute", _seconds(self.compute_time))
        head.add_row("communication", _seconds(self.comm_time))
        head.add_row("resharding", _seconds(self.reshard_time))
        head.add_row("step time", _seconds(self.predicted_time))
        budget = "none" if self.memory_budget is None else format_bytes(self.memory_budget)
        head.add_row("peak memory / device", f"{format_bytes(self.peak_memory)} (budget {budget})")
        s = self.solver
        head.add_row(
            "ILP",
            f"{s.get('status')} gap={s.get('gap')} in {s.get('solve_time', 0.0):.2f}s "
            f"({s.get('backend')}, {s.get('nodes')} nodes -> {s.get('core_nodes')} after simplify)",
        )
        if self.mesh_search:
            tried = ", ".join(t.label() for t in self.mesh_search)
            head.add_row("mesh search", tried)
        counts = self.collective_counts()
        head.add_row(
            "collectives",
            ", ".join(
                f"{k} x{int(v['count'])} ({format_bytes(v['bytes'])})" for k, v in counts.items()
            )
            or "none",
        )
        inputs = Table(title="Inputs")
        for col in ("name", "shape", "role", "layout"):
            inputs.add_column(col)
        for t in self.inputs[:max_rows]:
            tp = self.tensors[t]
            layout = tp.spec.label(self.axis_names) if tp.spec else "R"
            inputs.add_row(tp.name, str(tp.shape), tp.role, layout)
        ops = Table(title="Costliest operators")
        for col in ("op", "strategy", "compute", "comm", "source"):
            ops.add_column(col)
        ranked = sorted(
            range(len(self.nodes)), key=lambda i: -(self.nodes[i].compute + self.nodes[i].comm)
        )
        for i in ranked[: max_rows // 2]:
            n = self.nodes[i]
            ops.add_row(
                f"{i}:{n.primitive}", n.strategy, _seconds(n.compute), _seconds(n.comm), n.source
            )
        return Group(head, inputs, ops)

    # ----------------------------------------------------------------- explanations, tables
    def explain(self, tensor_or_op: int | str) -> Explanation:
        """Why the ILP chose an operator's strategy (by id or label like ``"12:dot_general"``)
        or a tensor's layout (by name: an input's own choice, else its producer's strategy)."""
        from .explain import explain

        return explain(self, tensor_or_op)

    def to_records(self, table: str = "nodes") -> list[dict[str, Any]]:
        """One flat dict per row of ``table`` ("nodes", "tensors" or "collectives"), with
        layouts as readable strings, for notebooks, CSV or a DataFrame."""
        from .explain import plan_records

        return plan_records(self, table)

    def to_dataframe(self, table: str = "nodes") -> pandas.DataFrame:
        """``to_records(table)`` as a pandas DataFrame (pandas is an optional dependency)."""
        from .explain import records_frame

        return records_frame(self.to_records(table))

    # ----------------------------------------------------------------- JSON
    def to_json(self) -> str:
        def enc(obj: Any) -> Any:
            if isinstance(obj, ShardingSpec):
                return {"spec": obj.to_list()}
            if isinstance(obj, dict):
                return {k: enc(v) for k, v in obj.items()}
            if isinstance(obj, list | tuple):
                return [enc(v) for v in obj]
            if isinstance(obj, float) and not math.isfinite(obj):
                return str(obj)
            return obj

        def shallow(obj: Any) -> dict[str, Any]:
            return {f.name: getattr(obj, f.name) for f in fields(obj)}

        def alts(rows: tuple[Alternative, ...]) -> list[list[Any]]:
            # Compact rows in ALTERNATIVE_FIELDS order: plans of big graphs keep ~10^5 of them.
            return [[getattr(a, f) for f in ALTERNATIVE_FIELDS] for a in rows]

        data = shallow(self)
        data["tensors"] = [
            {
                **shallow(t),
                "spec": None if t.spec is None else t.spec.to_list(),
                "alternatives": alts(t.alternatives),
            }
            for t in self.tensors
        ]
        data["nodes"] = [
            {
                **shallow(n),
                "in_specs": [None if s is None else s.to_list() for s in n.in_specs],
                "alternatives": alts(n.alternatives),
            }
            for n in self.nodes
        ]
        data["collectives"] = [asdict(c) for c in self.collectives]
        data["output_specs"] = [s.to_list() for s in self.output_specs]
        data["mesh_search"] = [asdict(t) for t in self.mesh_search]
        data["planning"] = None if self.planning is None else self.planning.to_dict()
        return json.dumps(enc(data))

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        d = json.loads(text)

        def spec(v: Any) -> ShardingSpec | None:
            return None if v is None else ShardingSpec.from_list(v)

        def alts(rows: Any) -> tuple[Alternative, ...]:
            # Rows in ALTERNATIVE_FIELDS order; plans saved before alternatives were recorded
            # have none (explain says so).
            return tuple(
                Alternative(str(name), float(cp), float(cm), float(rs), float(mem), bool(fits))
                for name, cp, cm, rs, mem, fits in rows or ()
            )

        return cls(
            mesh_shape=tuple(d["mesh_shape"]),
            axis_names=tuple(d["axis_names"]),
            tensors=tuple(
                TensorPlan(
                    t["name"],
                    tuple(t["shape"]),
                    t["dtype"],
                    t["role"],
                    spec(t["spec"]),
                    t.get("producer"),
                    alts(t.get("alternatives")),
                    tuple(t.get("paired_dims", ())),
                )
                for t in d["tensors"]
            ),
            nodes=tuple(
                NodePlan(
                    n["primitive"],
                    n["strategy"],
                    tuple(spec(s) for s in n["in_specs"]),
                    n["compute"],
                    n["comm"],
                    n["source"],
                    n["num_strategies"],
                    alts(n.get("alternatives")),
                )
                for n in d["nodes"]
            ),
            inputs=tuple(d["inputs"]),
            outputs=tuple(d["outputs"]),
            output_specs=tuple(ShardingSpec.from_list(s) for s in d["output_specs"]),
            collectives=tuple(
                PlannedCollective(
                    c["kind"],
                    tuple(c["axes"]),
                    c["nbytes"],
                    c["seconds"],
                    c["origin"],
                    c["node"],
                    c["tensor"],
                )
                for c in d["collectives"]
            ),
            compute_time=d["compute_time"],
            comm_time=d["comm_time"],
            reshard_time=d["reshard_time"],
            peak_memory=d["peak_memory"],
            memory_budget=d["memory_budget"],
            solver=d["solver"],
            mesh_search=tuple(MeshTrial.from_json(t) for t in d["mesh_search"]),
            planning=PlanningStats.from_dict(d.get("planning")),
        )


def _seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.3f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3f} ms"
    return f"{t * 1e6:.1f} us"
