"""``Executable``: a planned, lowered step for one argument signature, and its inspection.

``plan`` is the ILP's decision; ``get_hlo_text()`` is what XLA compiled from it;
``collectives()`` sets the collectives parsed from that HLO beside the ones the plan
predicted, kind by kind.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from ..graph.op_graph import OpGraph
from ..inspect.hlo_collectives import KINDS, CollectiveSummary, parse_collectives, summarize
from .lower import named_sharding
from .plan import ShardingPlan

__all__ = ["CollectiveReport", "Executable"]


@dataclass(frozen=True)
class CollectiveReport:
    """Per collective kind: the plan's predicted (count, bytes) and the HLO's."""

    predicted: dict[str, tuple[int, float]]
    hlo: dict[str, CollectiveSummary]

    def counts(self) -> dict[str, tuple[int, int]]:
        """kind -> (predicted count, HLO tensor count), for kinds either side has."""
        return {
            k: (self.predicted.get(k, (0, 0.0))[0], self.hlo[k].count if k in self.hlo else 0)
            for k in KINDS
            if self.predicted.get(k, (0, 0.0))[0] or (k in self.hlo and self.hlo[k].count)
        }

    def byte_ratio(self) -> float | None:
        """Predicted / HLO-parsed communication bytes (None when the HLO has none)."""
        hlo = sum(s.bytes for s in self.hlo.values())
        pred = sum(b for _, b in self.predicted.values())
        return None if hlo == 0 else pred / hlo

    def __str__(self) -> str:
        lines = [
            f"{'kind':<20}{'plan count':>11}{'HLO count':>11}{'plan bytes':>14}{'HLO bytes':>14}"
        ]
        for k in KINDS:
            pc, pb = self.predicted.get(k, (0, 0.0))
            h = self.hlo.get(k)
            hc, hb = (h.count, h.bytes) if h else (0, 0)
            if pc or hc:
                lines.append(f"{k:<20}{pc:>11}{hc:>11}{pb:>14.0f}{hb:>14.0f}")
        return "\n".join(lines)


@dataclass(eq=False)
class Executable:
    """A step compiled for one argument signature; call it with arguments of that signature."""

    fun_name: str
    plan: ShardingPlan
    graph: OpGraph
    mesh: Mesh
    jitted: Any
    in_tree: Any
    out_tree: Any
    static_argnums: tuple[int, ...]
    avals: tuple[jax.ShapeDtypeStruct, ...]
    planning_time: float
    trace_time: float
    donated: tuple[int, ...] = ()
    _compiled: Any = field(default=None, repr=False)
    _warned_donation: bool = field(default=False, repr=False)

    # ------------------------------------------------------------------ running
    @property
    def input_shardings(self) -> tuple[NamedSharding, ...]:
        return tuple(
            named_sharding(self.mesh, self.plan.tensors[t].spec, len(self.plan.tensors[t].shape))
            for t in self.plan.inputs
        )

    def __call__(self, *args: Any) -> Any:
        flat = dynamic_leaves(args, self.static_argnums, self.in_tree, self.fun_name)
        placed, moved = [], []
        donated, seen = set(self.donated), set()
        for k, (x, sharding) in enumerate(zip(flat, self.input_shardings, strict=True)):
            original = id(x)
            current = getattr(x, "sharding", None)
            if current is None or not current.is_equivalent_to(sharding, getattr(x, "ndim", 0)):
                x = jax.device_put(x, sharding)  # may share the original's buffer on a device
                if k in donated and current is not None:
                    moved.append(k)
            if k in donated:
                # One array passed as two donated leaves would be donated twice (jaxlib
                # crashes on that with sharded arrays): donate a fresh copy the second time.
                if original in seen:
                    x = x.copy()
                seen.add(original)
            placed.append(x)
        if moved and not self._warned_donation:
            self._warned_donation = True
            warnings.warn(
                f"{self.fun_name}: donated argument leaves {moved[:8]}"
                f"{' ...' if len(moved) > 8 else ''} are not in their planned layouts; each is "
                "copied into its layout and the copy donated, so the caller's array survives "
                "(pass the previous step's outputs to donate without a copy)",
                stacklevel=2,
            )
        out = self.jitted(*placed)
        return jax.tree.unflatten(self.out_tree, out)

    # ------------------------------------------------------------------ inspection
    def compiled(self) -> Any:
        if self._compiled is None:
            args = [
                jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                for a, s in zip(self.avals, self.input_shardings, strict=True)
            ]
            self._compiled = self.jitted.lower(*args).compile()
        return self._compiled

    def get_hlo_text(self) -> str:
        """The optimised, SPMD-partitioned HLO module XLA compiled for this step."""
        return self.compiled().as_text()

    def collectives(self) -> CollectiveReport:
        """Collectives in the compiled HLO beside the plan's prediction."""
        hlo = summarize(parse_collectives(self.get_hlo_text()))
        predicted: dict[str, tuple[int, float]] = {}
        for kind, v in self.plan.collective_counts().items():
            predicted[kind] = (int(v["count"]), float(v["bytes"]))
        return CollectiveReport(predicted, hlo)

    def __repr__(self) -> str:
        return (
            f"Executable({self.fun_name}, mesh={self.plan.mesh_shape}, "
            f"predicted={self.plan.predicted_time:.3g}s, planned in {self.planning_time:.2f}s)"
        )


def dynamic_leaves(
    args: tuple[Any, ...], static_argnums: tuple[int, ...], in_tree: Any, fun_name: str
) -> list[Any]:
    """The array leaves of a call's non-static arguments, checked against the structure the
    executable was planned for."""
    static = set(static_argnums)
    flat, tree = jax.tree.flatten(tuple(a for i, a in enumerate(args) if i not in static))
    if tree != in_tree:
        raise TypeError(
            f"{fun_name}: arguments have structure {tree}, but this executable was planned "
            f"for {in_tree}"
        )
    return flat
