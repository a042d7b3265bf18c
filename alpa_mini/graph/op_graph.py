"""The operator graph the planner works on: tensors, the nodes that produce them, flops, bytes.

One node per jaxpr equation after inlining call-like sub-jaxprs (``jit``, custom_jvp/vjp,
``checkpoint``); a ``scan`` contributes its body's nodes once, weighted by the trip count,
plus small boundary nodes that move its operands in and results out; ``while`` and ``cond``
are single summarised nodes. ``tracing.trace`` builds it; nothing here imports JAX.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["OpGraph", "OpNode", "Tensor"]

#: Roles a graph input can play; intermediates have role "intermediate".
INPUT_ROLES = ("param", "state", "batch", "const")


@dataclass(frozen=True)
class Tensor:
    """One array value: shape, dtype, who makes it and who reads it."""

    id: int
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    producer: int | None  # node id; None for graph inputs and constants
    role: str  # "param" | "state" | "batch" | "const" | "intermediate"
    name: str = ""

    @functools.cached_property
    def size(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def nbytes(self) -> int:
        return self.size * self.itemsize


@dataclass(frozen=True, eq=False)
class OpNode:
    """One operation. ``inputs`` holds a tensor id per operand (None for a literal).

    ``multiplier`` scales its costs (a scan body runs ``length`` times); ``comm_scale`` scales
    only its own collectives (a parameter gradient's reduction, paid once per step for B
    micro-batches, costs 1/B per micro-batch); ``input_weights``
    scales the resharding cost of each operand separately (a scan carry's loop-back edge);
    ``eqn`` is the jaxpr equation, or None for boundary nodes made by the tracer, whose
    ``kind`` then says what they do.
    """

    id: int
    primitive: str
    inputs: tuple[int | None, ...]
    outputs: tuple[int, ...]
    flops: float
    bytes_accessed: float
    multiplier: float = 1.0
    comm_scale: float = 1.0
    input_weights: tuple[float, ...] | None = None
    eqn: Any = None
    params: dict[str, Any] = field(default_factory=dict)
    kind: str = "op"  # "op" | "identity" | "unstack" | "stack" | "opaque"
    path: tuple[int, ...] = ()
    source: str = ""

    def weight(self, operand: int) -> float:
        if self.input_weights is None:
            return self.multiplier
        return self.input_weights[operand]


@dataclass(frozen=True, eq=False)
class OpGraph:
    """Nodes in execution order, tensors by id, and the graph's inputs and outputs.

    ``outputs`` may repeat a tensor or name an input directly (a function that returns its
    argument). ``var_tensors`` maps (jaxpr path, id of a jaxpr variable) to a tensor id so
    the lowering can find the tensor behind each variable it re-evaluates.
    """

    nodes: tuple[OpNode, ...]
    tensors: tuple[Tensor, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    var_tensors: dict[tuple[tuple[int, ...], int], int]
    warnings: tuple[str, ...] = ()

    def consumers(self) -> dict[int, list[tuple[int, int]]]:
        """tensor id -> [(node id, operand index)], in node order."""
        out: dict[int, list[tuple[int, int]]] = {}
        for node in self.nodes:
            for k, t in enumerate(node.inputs):
                if t is not None:
                    out.setdefault(t, []).append((node.id, k))
        return out

    @property
    def total_flops(self) -> float:
        return sum(n.flops * n.multiplier for n in self.nodes)

    def primitive_counts(self) -> Counter[str]:
        return Counter(n.primitive for n in self.nodes)

    def summary(self) -> str:
        counts = self.primitive_counts().most_common(8)
        top = ", ".join(f"{p} x{c}" for p, c in counts)
        return (
            f"OpGraph: {len(self.nodes)} nodes, {len(self.tensors)} tensors, "
            f"{len(self.inputs)} inputs, {len(self.outputs)} outputs, "
            f"{self.total_flops:.3g} flops ({top})"
        )
