"""Why a ``ShardingPlan`` chose what it chose, and the plan as flat tables.

``ShardingPlan.explain`` returns an ``Explanation``: one ILP choice (an operator's strategy or
a graph input's layout) with its cost terms, the collectives it brings, and the alternatives
``read_plan`` priced with every other choice held fixed. ``ShardingPlan.to_records`` and
``to_dataframe`` flatten the plan's nodes, tensors or collectives into rows.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from numbers import Integral
from typing import TYPE_CHECKING, Any

from .._validate import format_bytes
from .plan import Alternative, PlannedCollective, ShardingPlan, _seconds

if TYPE_CHECKING:
    import pandas

__all__ = ["Explanation"]

TABLES = ("nodes", "tensors", "collectives")


@dataclass(frozen=True)
class Explanation:
    """One ILP choice, priced against its alternatives (see ``Alternative`` for the terms).

    ``kind`` is "op" (an operator's strategy) or "input" (a graph input's layout). For an
    operator, ``collectives`` are the plan's collectives it performs or needs (its own partial
    sums and the reshards into it); for an input, the reshards of that input. The chosen
    strategy's ``reshard`` also counts edges out of the choice (to its readers), which the
    plan's collectives list under the readers.
    """

    subject: str
    kind: str
    primitive: str
    chosen: Alternative
    alternatives: tuple[Alternative, ...]  # sorted by total, the chosen one included
    best_alternative: Alternative | None  # the cheapest other strategy
    replicated: Alternative | None  # the fully replicated strategy, when it exists
    collectives: tuple[PlannedCollective, ...]
    axis_names: tuple[str, ...] = ()
    layout: str = ""  # operand -> result layouts (op) or the layout (input)
    source: str = ""
    num_strategies: int = 0  # 0: unknown (inputs)

    @property
    def margin(self) -> float:
        """Seconds the ILP objective would grow by switching to the best alternative (inf if
        there is none); single moves from an optimal plan never make it negative."""
        if self.best_alternative is None:
            return math.inf
        return self.best_alternative.total - self.chosen.total

    def to_records(self) -> list[dict[str, Any]]:
        """The alternatives as flat rows, cheapest first, with each one's delta to the chosen."""
        return [
            {
                "strategy": a.strategy,
                "total": a.total,
                "delta": a.total - self.chosen.total,
                "compute": a.compute,
                "comm": a.comm,
                "reshard": a.reshard,
                "memory": a.memory,
                "fits": a.fits,
                "chosen": a == self.chosen,
                "replicated": a == self.replicated,
            }
            for a in self.alternatives
        ]

    def __str__(self) -> str:
        c = self.chosen
        what = "operator" if self.kind == "op" else "input layout"
        lines = [f"{what} {self.subject}" + (f"  ({self.source})" if self.source else "")]
        if self.layout:
            lines.append(f"  layout:  {self.layout}")
        lines.append(
            f"  chosen:  {c.strategy}  total {_seconds(c.total)} = compute {_seconds(c.compute)}"
            f" + comm {_seconds(c.comm)} + reshard {_seconds(c.reshard)};"
            f" {format_bytes(c.memory)} per device"
        )
        if self.collectives:
            lines.append("  collectives:")
            for k in self.collectives:
                axes = ",".join(_axis(self.axis_names, a) for a in k.axes)
                lines.append(
                    f"    {k.kind} over ({axes}) of {format_bytes(k.nbytes)}: {_seconds(k.seconds)}"
                    f" [{k.origin}]"
                )
        else:
            lines.append("  collectives: none")
        shown = f"{len(self.alternatives)} of {self.num_strategies}" if self.num_strategies else ""
        lines.append(
            f"  alternatives ({shown + ' strategies, ' if shown else ''}sorted by total; delta ="
            " the objective's change if only this choice moved):"
        )
        width = max(len(a.strategy) for a in self.alternatives)
        for a in self.alternatives:
            mark = "*" if a == c else " "
            notes = []
            if a == self.replicated:
                notes.append("replicated")
            if not a.fits:
                notes.append("does not fit the memory budget")
            delta = "chosen" if a == c else _signed(a.total - c.total)
            lines.append(
                f"   {mark} {a.strategy:<{width}}  {_seconds(a.total):>10}  {delta:>11}"
                f"  (compute {_seconds(a.compute)}, comm {_seconds(a.comm)},"
                f" reshard {_seconds(a.reshard)}, {format_bytes(a.memory)})"
                + (f"  [{'; '.join(notes)}]" if notes else "")
            )
        best = self.best_alternative
        if best is not None:
            line = f"  margin: {_signed(self.margin)} to the best alternative ({best.strategy})"
            if not best.fits:
                line += ", which does not fit the memory budget"
                fitting = next((a for a in self.alternatives if a.fits and a is not c), None)
                if fitting is not None:
                    line += (
                        f"; {_signed(fitting.total - c.total)} to the best that fits "
                        f"({fitting.strategy})"
                    )
            lines.append(line)
        return "\n".join(lines)


def explain(plan: ShardingPlan, tensor_or_op: int | str) -> Explanation:
    """``ShardingPlan.explain``: resolve the argument, then assemble the explanation."""
    if isinstance(tensor_or_op, Integral) and not isinstance(tensor_or_op, bool):
        op = int(tensor_or_op)
        if not 0 <= op < len(plan.nodes):
            raise KeyError(f"tensor_or_op: {op} is not an operator id (0..{len(plan.nodes) - 1})")
        return _explain_op(plan, op)
    if not isinstance(tensor_or_op, str):
        raise TypeError(
            f"tensor_or_op: expected an operator id (int) or a tensor name or operator label "
            f"(str), got {type(tensor_or_op).__name__} {tensor_or_op!r}"
        )
    tid = next((i for i, t in enumerate(plan.tensors) if t.name == tensor_or_op), None)
    if tid is not None:
        tensor = plan.tensors[tid]
        if tid in plan.inputs:
            return _explain_input(plan, tid)
        if tensor.producer is not None:
            return _explain_op(plan, tensor.producer)
        if tensor.role == "const":
            raise ValueError(
                f"tensor_or_op: {tensor_or_op!r} is a constant; constants are replicated and "
                "were never a choice of the ILP"
            )
        raise ValueError(
            f"tensor_or_op: this plan does not record which operator produces {tensor_or_op!r} "
            "(it was saved by an older alpa_mini); re-plan to explain it, or pass the operator id"
        )
    m = re.fullmatch(r"(\d+):(\S+)", tensor_or_op)
    if m is not None:
        op = int(m.group(1))
        if op < len(plan.nodes) and plan.nodes[op].primitive == m.group(2):
            return _explain_op(plan, op)
    inputs = [plan.tensors[i].name for i in plan.inputs][:6]
    labels = [f"{i}:{n.primitive}" for i, n in enumerate(plan.nodes[:3])]
    raise KeyError(
        f"tensor_or_op: {tensor_or_op!r} is neither a tensor name (inputs are named like "
        f"{inputs}) nor an operator label (like {labels}, ids 0..{len(plan.nodes) - 1})"
    )


def _explain_op(plan: ShardingPlan, op: int) -> Explanation:
    node = plan.nodes[op]
    subject = f"{op}:{node.primitive}"
    names = plan.axis_names
    reads = ", ".join("-" if s is None else s.label(names) for s in node.in_specs)
    outs = [t for t in plan.tensors if t.producer == op]
    writes = ", ".join(_layout(t.spec, t.shape, names) for t in outs)
    layout = f"reads {reads or '-'}" + (f" -> writes {writes}" if outs else "")
    return _assemble(
        plan,
        subject,
        "op",
        node.primitive,
        node.strategy,
        node.alternatives,
        tuple(c for c in plan.collectives if c.node == op),
        layout,
        node.source,
        node.num_strategies,
    )


def _explain_input(plan: ShardingPlan, tid: int) -> Explanation:
    tensor = plan.tensors[tid]
    layout = _layout(tensor.spec, tensor.shape, plan.axis_names)
    return _assemble(
        plan,
        tensor.name,
        "input",
        "",
        tensor.spec.label(plan.axis_names) if tensor.spec is not None else "",
        tensor.alternatives,
        tuple(c for c in plan.collectives if c.origin == "reshard" and c.tensor == tid),
        f"{layout} ({tensor.role}, shape {tensor.shape})",
        "",
        0,
    )


def _assemble(
    plan: ShardingPlan,
    subject: str,
    kind: str,
    primitive: str,
    strategy: str,
    alternatives: tuple[Alternative, ...],
    collectives: tuple[PlannedCollective, ...],
    layout: str,
    source: str,
    num_strategies: int,
) -> Explanation:
    if not alternatives:
        raise ValueError(
            f"tensor_or_op: the plan has no alternatives stored for {subject!r} (it was saved "
            "before alpa_mini recorded them); re-plan to explain its choices"
        )
    # The chosen strategy is stored by name; strategy names are unique within one choice.
    chosen = next((a for a in alternatives if a.strategy == strategy), None)
    if chosen is None:
        raise ValueError(
            f"tensor_or_op: the stored alternatives of {subject!r} do not include its chosen "
            f"strategy {strategy!r}; the plan is inconsistent"
        )
    others = [a for a in alternatives if a is not chosen]
    replicated = next((a for a in alternatives if _is_replicated(a.strategy)), None)
    return Explanation(
        subject=subject,
        kind=kind,
        primitive=primitive,
        chosen=chosen,
        alternatives=alternatives,
        best_alternative=others[0] if others else None,
        replicated=replicated,
        collectives=collectives,
        axis_names=plan.axis_names,
        layout=layout,
        source=source,
        num_strategies=num_strategies,
    )


def _is_replicated(name: str) -> bool:
    """Operators name their unsplit strategy "replicated"; input layouts are spec labels, all
    "R" when replicated ("scalar" for 0-d tensors)."""
    return name in ("replicated", "scalar") or (name != "" and set(name) == {"R"})


# --------------------------------------------------------------------------- tables
def plan_records(plan: ShardingPlan, table: str) -> list[dict[str, Any]]:
    """``ShardingPlan.to_records``."""
    if table not in TABLES:
        raise ValueError(f"table: {table!r} is not a plan table; valid tables are {TABLES}")
    names = plan.axis_names
    if table == "nodes":
        return [_node_row(plan, i) for i in range(len(plan.nodes))]
    if table == "tensors":
        inputs, outputs = set(plan.inputs), set(plan.outputs)
        return [
            {
                "id": i,
                "name": t.name,
                "shape": str(t.shape),
                "dtype": t.dtype,
                "role": t.role,
                "layout": _layout(t.spec, t.shape, names),
                "partition_spec": str(plan.partition_spec(i)),
                "is_input": i in inputs,
                "is_output": i in outputs,
                "producer": t.producer,
            }
            for i, t in enumerate(plan.tensors)
        ]
    return [
        {
            "kind": c.kind,
            "axes": ",".join(_axis(names, a) for a in c.axes),
            "nbytes": c.nbytes,
            "seconds": c.seconds,
            "origin": c.origin,
            "node": c.node,
            "op": f"{c.node}:{plan.nodes[c.node].primitive}" if c.node >= 0 else "output",
            "tensor": c.tensor,
            "tensor_name": None if c.tensor is None else plan.tensors[c.tensor].name,
        }
        for c in plan.collectives
    ]


def _node_row(plan: ShardingPlan, i: int) -> dict[str, Any]:
    n = plan.nodes[i]
    names = plan.axis_names
    chosen = next((a for a in n.alternatives if a.strategy == n.strategy), None)
    others = [a for a in n.alternatives if a is not chosen]
    best = others[0] if others and chosen is not None else None
    return {
        "id": i,
        "op": f"{i}:{n.primitive}",
        "primitive": n.primitive,
        "strategy": n.strategy,
        "operands": ", ".join("-" if s is None else s.label(names) for s in n.in_specs),
        "compute": n.compute,
        "comm": n.comm,
        "reshard": None if chosen is None else chosen.reshard,
        "total": None if chosen is None else chosen.total,
        "best_alternative": None if best is None else best.strategy,
        "margin": None if best is None or chosen is None else best.total - chosen.total,
        "num_strategies": n.num_strategies,
        "source": n.source,
    }


def records_frame(records: list[dict[str, Any]]) -> pandas.DataFrame:
    """Rows as a DataFrame; pandas is imported only here (an optional dependency)."""
    try:
        import pandas
    except ImportError:
        raise ImportError(
            "to_dataframe needs pandas, which alpa_mini does not install: pip install pandas"
        ) from None
    return pandas.DataFrame.from_records(records)


def _layout(spec: Any, shape: tuple[int, ...], names: tuple[str, ...]) -> str:
    if spec is None:  # constants: replicated, never constrained
        return "R" * len(shape) if shape else "scalar"
    return spec.label(names)


def _axis(names: tuple[str, ...], a: int) -> str:
    return names[a] if 0 <= a < len(names) else str(a)


def _signed(t: float) -> str:
    return ("-" if t < 0 else "+") + _seconds(abs(t))
