"""Reading a solved sharding ILP back: the ``ShardingPlan`` of a solver's choice, with the
collectives it brings and, per choice, its priced alternatives (what ``explain`` shows)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..graph.op_graph import OpGraph
from ..solvers import ShardingSolution
from ..solvers.sharding.problem import FORBIDDEN_COST
from .accumulators import paired_dims
from .cost_model import CostModel
from .plan import Alternative, NodePlan, PlannedCollective, ShardingPlan, TensorPlan
from .spec import ShardingSpec
from .strategies import Strategy

if TYPE_CHECKING:
    from .problem import ShardingInstance

__all__ = ["MAX_ALTERNATIVES", "read_plan"]

#: Alternatives a plan keeps per choice besides the chosen and the replicated strategy: enough
#: to explain a choice while a plan of an unrolled 11k-node graph stays small.
MAX_ALTERNATIVES = 6


def read_plan(
    graph: OpGraph,
    cost: CostModel,
    axis_names: Sequence[str],
    inst: ShardingInstance,
    sol: ShardingSolution,
    memory_budget: float | None,
    build_time: float,
    alternatives: bool = True,
) -> ShardingPlan:
    """Turn a solver choice into a ``ShardingPlan``; without ``alternatives`` its choices
    carry none (for plans only read for their layouts and costs, not ``explain``ed)."""
    chosen = [inst.strategies[v][c] for v, c in enumerate(sol.choice)]
    alts = (
        _alternatives(inst, sol, memory_budget, axis_names)
        if alternatives
        else [()] * (inst.num_inputs + inst.num_ops)
    )
    op_collectives = [
        PlannedCollective(
            c.kind, c.axes, c.nbytes, c.seconds * node.multiplier * node.comm_scale, "op", node.id
        )
        for node in graph.nodes
        for c in chosen[inst.num_inputs + node.id].collectives
    ]
    reshards, reshard_time = _reshard_collectives(graph, cost, inst, chosen)
    core = (sol.reduction.get("nodes") or (None, None))[1]
    solver = {
        "status": sol.status, "gap": sol.gap, "objective": sol.objective,
        "solve_time": sol.solve_time, "build_time": build_time, "backend": sol.backend,
        "nodes": inst.problem.num_nodes, "edges": inst.problem.num_edges,
        "core_nodes": core,
        "tied": sol.reduction.get("tied"),  # (ILP nodes, groups solved) when tied
    }  # fmt: skip
    return ShardingPlan(
        mesh_shape=tuple(cost.mesh.shape),
        axis_names=tuple(axis_names),
        tensors=_tensor_plans(graph, inst, chosen, alts),
        nodes=_node_plans(graph, inst, chosen, alts),
        inputs=tuple(graph.inputs),
        outputs=tuple(graph.outputs),
        output_specs=tuple(chosen[v].out_specs[0] for v in inst.sinks),
        collectives=tuple(op_collectives + reshards),
        compute_time=sum(s.compute for s in chosen),
        comm_time=sum(s.comm for s in chosen),
        reshard_time=reshard_time,
        peak_memory=sol.peak_usage,
        memory_budget=memory_budget,
        solver=solver,
    )


def _tensor_plans(graph: OpGraph, inst: ShardingInstance, chosen, alternatives) -> tuple:
    """Every tensor's chosen layout (inputs: with their priced alternatives)."""
    n_in = inst.num_inputs
    specs: list[ShardingSpec | None] = [None] * len(graph.tensors)
    for i, t in enumerate(graph.inputs):
        specs[t] = chosen[i].out_specs[0]
    for node in graph.nodes:
        for k, t in enumerate(node.outputs):
            specs[t] = chosen[n_in + node.id].out_specs[k]
    producer: dict[int, int] = {t: n.id for n in graph.nodes for t in n.outputs}
    input_alts: dict[int, tuple[Alternative, ...]] = {}
    for i, t in enumerate(graph.inputs):
        input_alts.setdefault(t, alternatives[i])
    paired = {graph.inputs[i]: dims for i, dims in paired_dims(graph).items()}
    return tuple(
        TensorPlan(
            t.name,
            t.shape,
            t.dtype,
            t.role,
            None if t.role == "const" else specs[t.id],
            producer.get(t.id),
            input_alts.get(t.id, ()),
            paired.get(t.id, ()),
        )
        for t in graph.tensors
    )


def _node_plans(graph: OpGraph, inst: ShardingInstance, chosen, alternatives) -> tuple:
    """Every operator's chosen strategy, its layouts, costs and priced alternatives."""
    n_in = inst.num_inputs
    return tuple(
        NodePlan(
            n.primitive,
            chosen[n_in + n.id].name,
            chosen[n_in + n.id].in_specs,
            chosen[n_in + n.id].compute,
            chosen[n_in + n.id].comm,
            n.source,
            len(inst.strategies[n_in + n.id]),
            alternatives[n_in + n.id],
        )
        for n in graph.nodes
    )


def _reshard_collectives(
    graph: OpGraph, cost: CostModel, inst: ShardingInstance, chosen
) -> tuple[list[PlannedCollective], float]:
    """The collectives that move tensors between a producer's and a reader's layouts, and
    their total time (each weighted by how often its edge runs)."""
    n_in, n_ops = inst.num_inputs, inst.num_ops
    collectives: list[PlannedCollective] = []
    reshard_time = 0.0
    seen: set[tuple[int, ShardingSpec, ShardingSpec]] = set()
    for u, v, k, t, w in inst.edge_info:
        src = chosen[u].out_specs[_result_index(graph, inst, u, t)]
        dst = chosen[v].in_specs[k] if n_in <= v < n_in + n_ops else chosen[v].out_specs[0]
        if dst is None or (t, src, dst) in seen:
            continue  # XLA computes one resharded copy per (tensor, layout) for all readers
        seen.add((t, src, dst))
        tensor = graph.tensors[t]
        for kind, axes, nbytes, seconds in cost.reshard_steps(
            tensor.shape, tensor.itemsize, src, dst
        ):
            node_id = v - n_in if n_in <= v < n_in + n_ops else -1
            collectives.append(
                PlannedCollective(kind, axes, nbytes, seconds * w, "reshard", node_id, t)
            )
            reshard_time += seconds * w
    return collectives, reshard_time


def _alternatives(
    inst: ShardingInstance,
    sol: ShardingSolution,
    memory_budget: float | None,
    axis_names: Sequence[str],
) -> list[tuple[Alternative, ...]]:
    """Per input and operator ILP node: its chosen strategy, the ``MAX_ALTERNATIVES`` cheapest
    others and the replicated one, priced with every other node at its chosen strategy.
    Input layouts are named by their spec with mesh axis names (``S(x)R``), as plans show them.

    Vectorised over edges: edge (u, v) with matrix M adds M[:, c_v] to u's strategies and
    M[c_u, :] to v's, so each strategy's ``reshard`` is its edges' cost against the chosen
    neighbours. Only the kept strategies become Python objects.
    """
    prob = inst.problem
    k, off = prob.num_strategies, prob.node_offsets
    choice = np.asarray(sol.choice, dtype=np.int64)
    size = int(off[-1])
    reshard = np.zeros(size)
    if prob.num_edges:
        eu, ev = prob.edges[:, 0], prob.edges[:, 1]
        start = prob.edge_offsets[:-1]
        ku, kv = k[eu], k[ev]
        # u's side: entries start + i * k_v + c_v for i < k_u, added to u's strategy i.
        e, i = _expand(ku)
        flat = start[e] + i * kv[e] + choice[ev[e]]
        reshard += np.bincount(off[eu[e]] + i, weights=prob.edge_costs[flat], minlength=size)
        # v's side: entries start + c_u * k_v + j for j < k_v, added to v's strategy j.
        e, j = _expand(kv)
        flat = start[e] + choice[eu[e]] * kv[e] + j
        reshard += np.bincount(off[ev[e]] + j, weights=prob.edge_costs[flat], minlength=size)
    totals = prob.node_costs + reshard
    allowed = (prob.node_costs < FORBIDDEN_COST) & np.isfinite(totals)
    owner = np.repeat(np.arange(len(k)), k)
    others = np.ones(size, dtype=np.int8)
    others[off[:-1] + choice] = 0
    # By node, then by total; among equal totals the chosen one first, then strategy index.
    order = np.lexsort((others, totals, owner))
    rank = np.empty(size, dtype=np.int64)
    rank[order] = np.arange(size) - off[owner[order]]
    out: list[tuple[Alternative, ...]] = []
    # Alike operators of repeated layers share a strategy tuple (``_op_strategies``) and,
    # among alike neighbours, their resharding: their alternatives are one tuple, made once.
    made: dict[tuple[Any, ...], tuple[Alternative, ...]] = {}
    for v in range(inst.num_inputs + inst.num_ops):
        strats, base, c = inst.strategies[v], int(off[v]), int(choice[v])
        span = slice(base, int(off[v + 1]))
        key = (id(strats), c, reshard[span].tobytes(), allowed[span].tobytes())
        alts = made.get(key)
        if alts is None:
            named = v < inst.num_inputs
            alts = made[key] = _choice_alternatives(
                strats, c, order[span] - base, allowed[span], reshard[span], rank[span],
                sol.peak_usage, memory_budget, axis_names if named else None,
            )  # fmt: skip
        out.append(alts)
    return out


def _choice_alternatives(
    strats, c: int, order, allowed, reshard, rank, peak, memory_budget, axis_names
) -> tuple[Alternative, ...]:
    """One choice's ``_alternatives`` from its segments of the problem-wide arrays (inputs,
    with ``axis_names``, are named by their layout)."""
    # The cheapest allowed strategies come first in ``order``; one more than kept covers the
    # chosen one being among them.
    seg = order[: min(len(strats), MAX_ALTERNATIVES + 1)]
    keep = [int(i) for i in seg if allowed[i] and i != c][:MAX_ALTERNATIVES]
    keep.append(c)
    r = _replicated_index(strats)
    if r is not None and r not in keep and allowed[r]:
        keep.append(r)
    keep.sort(key=lambda i: rank[i])
    chosen_memory = strats[c].memory
    alts = []
    for i in keep:
        s = strats[i]
        fits = memory_budget is None or peak - chosen_memory + s.memory <= memory_budget
        name = s.name if axis_names is None else s.out_specs[0].label(axis_names)
        alts.append(Alternative(name, s.compute, s.comm, float(reshard[i]), s.memory, fits))
    return tuple(alts)


def _expand(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each position of the concatenated ``arange(sizes[e])``: (e, index within it)."""
    owner = np.repeat(np.arange(len(sizes)), sizes)
    starts = np.cumsum(sizes) - sizes
    return owner, np.arange(int(sizes.sum())) - starts[owner]


def _replicated_index(strats: Sequence[Strategy]) -> int | None:
    """The strategy that splits nothing (operators enumerate it first), or None."""

    def unsplit(s: Strategy) -> bool:
        specs = (*s.in_specs, *s.out_specs)
        return all(spec is None or not spec.used_axes for spec in specs)

    if strats and unsplit(strats[0]):
        return 0
    return next((i for i, s in enumerate(strats) if unsplit(s)), None)


def _result_index(graph: OpGraph, inst: ShardingInstance, u: int, t: int) -> int:
    if u < inst.num_inputs:
        return 0
    return graph.nodes[u - inst.num_inputs].outputs.index(t)
