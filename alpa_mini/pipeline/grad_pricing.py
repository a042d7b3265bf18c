"""How a stage prices its parameters' gradients: reduced once per step, as this runtime does
(the default), or reduced into each device's ZeRO partition after every micro-batch, as
DeepSpeed's ZeRO-2 does (only for pricing that baseline: ``reduced_every_micro_batch``).

This runtime adds each data-parallel group's partial gradients over the micro-batches and
reduces once per step (``lower/partials.py``), so a reduction priced per micro-batch costs
1/B of itself and every device holds the unreduced accumulators all step. DeepSpeed's ZeRO-2
keeps only its partition of each gradient, so it must reduce after every backward pass (its
maintainers: deepspeedai/DeepSpeed#2252) and holds just that partition.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import Any

from ..graph.op_graph import OpGraph

__all__ = [
    "amortize_gradient_reductions",
    "every_micro_batch",
    "gradient_sync_seconds",
    "reduced_every_micro_batch",
]

_EVERY_MICRO_BATCH: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "alpa_mini_reduce_every_micro_batch", default=False
)


@contextlib.contextmanager
def reduced_every_micro_batch() -> Iterator[None]:
    """Stages planned inside price DeepSpeed's ZeRO-2: each gradient reduce-scattered into
    its partition (the optimiser state's layout) after every micro-batch, only that partition
    held all step, the updated parameters gathered once per step. For baselines: this
    runtime does not run plans priced so (it reduces once per step)."""
    token = _EVERY_MICRO_BATCH.set(True)
    try:
        yield
    finally:
        _EVERY_MICRO_BATCH.reset(token)


def every_micro_batch() -> bool:
    """Whether ``reduced_every_micro_batch`` is in force (read where a stage model is made:
    the planner's worker threads do not see the context)."""
    return _EVERY_MICRO_BATCH.get()


#: Operations a gradient passes through on its way out: layout, dtype, sums of contributions.
_GRADIENT_PASS = frozenset(
    {"add_any", "add", "transpose", "reshape", "convert_element_type", "copy", "squeeze"}
)


def amortize_gradient_reductions(graph: OpGraph, grad_outputs: list[int], scale: float) -> OpGraph:
    """``graph`` with the operations that produce the given gradient outputs (and the sums and
    layout changes on the way) charged ``scale`` of their collectives: a reduction this
    runtime makes once per step costs 1/B of itself per micro-batch."""
    if scale == 1.0:
        return graph
    producer = {t: n for n in graph.nodes for t in n.outputs}
    marked: set[int] = set()
    stack = [graph.outputs[k] for k in grad_outputs]
    seen: set[int] = set()
    while stack:
        t = stack.pop()
        node = producer.get(t)
        if t in seen or node is None:
            continue
        seen.add(t)
        marked.add(node.id)
        if node.primitive in _GRADIENT_PASS:
            stack.extend(i for i in node.inputs if i is not None)
    nodes = tuple(
        dataclasses.replace(n, comm_scale=scale) if n.id in marked else n for n in graph.nodes
    )
    return dataclasses.replace(graph, nodes=nodes)


def gradient_sync_seconds(plan, cost, diff_in, params: list[int], first_grad: int) -> float:
    """Seconds to bring each parameter's gradient into the parameter's layout, where the
    optimiser sums and applies it (an all-gather of a sharded gradient, a slice of a
    replicated one), priced after the solve (``gradient_sync="after"``, and ZeRO-2's gather
    of its updated parameters; under the default "ilp" the stage's ILP prices it through its
    aliases instead)."""
    seconds = 0.0
    for k in params:
        grad, param = plan.output_specs[first_grad + k], plan.tensors[plan.inputs[k]].spec
        if grad is None or param is None or grad == param:
            continue
        aval: Any = diff_in[k].aval
        seconds += cost.reshard(tuple(aval.shape), aval.dtype.itemsize, grad, param)
    return seconds
