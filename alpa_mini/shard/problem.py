"""OpGraph + mesh + cost model -> ShardingProblem -> solver -> ShardingPlan.

ILP nodes are, in order: one per graph input (its layout), one per operator (its strategy),
and one sink per graph output (the layout it is returned in). Edges price resharding from a
producer's result layout to each consumer's operand layout; aliases tie an updated state
output to its input so a step can be called again without moving anything. Memory: each
node's results live from the node to their last reader; inputs the caller keeps live
throughout (donated ones until their last reader).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from .._validate import format_bytes
from ..errors import MemoryBudgetError
from ..graph.op_graph import OpGraph
from ..solvers import (
    FractionalRelaxation,
    InfeasibleError,
    ShardingProblem,
    ShardingSolution,
    SolverTimeLimitError,
    solve_sharding,
)
from ..solvers.sharding.problem import FORBIDDEN_COST, evaluate
from ..solvers.sharding.tie import NotTied, repeated_groups, tie_nodes, untie_choice
from .accumulators import (
    accumulator_bytes,
    extra_bytes,
    fit_accumulators,
    paired_dims,
    partial_excess,
)
from .cost_model import CostModel
from .plan import ShardingPlan
from .read_back import read_plan
from .spec import ShardingSpec
from .strategies import (
    Strategy,
    input_strategies,
    loop_nest,
    node_strategies,
    node_work,
    symmetric_axis_pairs,
)

__all__ = [
    "ShardingInstance",
    "build_activity",
    "build_sharding_problem",
    "cost_floor",
    "plan_sharding",
]

log = logging.getLogger("alpa_mini.shard.problem")
_warned: set[str] = set()
#: Primitives that run replicated by design, without a warning: PRNG keys are whole on every
#: device (``api``: never split), and so are the draws made from them; debug prints and
#: callbacks read their values whole.
QUIET_REPLICATED = frozenset(
    ("random_seed", "random_bits", "random_split", "random_fold_in", "random_wrap",
     "random_unwrap", "threefry2x32", "debug_print", "debug_callback")
)  # fmt: skip

SpecFilter = Callable[[ShardingSpec], bool]

#: Cores with at least this many strategies get a local-search incumbent before the MIP.
HEURISTIC_MIN_CORE_STRATEGIES = 8000
#: The whole MIP is tried below this many columns (solvers' default is tuned for IOPDDL).
FULL_MIP_MAX_COLUMNS = 3_000_000
#: Refinement rounds that decide which ILP nodes are alike (``solvers.sharding.tie``): on
#: unrolled GPT-2 1.3B, 4 rounds tie nodes of different roles and the tied MIP gets hard; 6
#: keep the layers' positions apart and solve it in seconds (12 barely tie anything).
TIE_ROUNDS = 6
#: Building an ILP is Python that holds the GIL, so threads building several at once only
#: finish them all later: one at a time, each goes to its solver process sooner (the
#: planner's threads build while child processes solve, ``solve_pool``).
_BUILD_LOCK = threading.Lock()
_builds_started = 0  # ILPs whose build has begun, in this process (``build_activity``)


@dataclass(frozen=True, eq=False)
class ShardingInstance:
    """A built problem and the strategy behind each of its choices."""

    problem: ShardingProblem
    strategies: tuple[tuple[Strategy, ...], ...]  # per ILP node
    num_inputs: int
    num_ops: int
    edge_info: tuple[tuple[int, int, int, int, float], ...]  # (u, v, operand, tensor, weight)
    sinks: tuple[int, ...]  # per graph output: the ILP node whose layout it is returned in


def build_sharding_problem(
    graph: OpGraph,
    cost: CostModel,
    *,
    input_filters: Sequence[SpecFilter | None] | None = None,
    output_filters: Sequence[SpecFilter | None] | None = None,
    aliases: Sequence[tuple[int, int]] = (),
    donated: Sequence[int] = (),
    memory_budget: float | None = None,
    accumulated: Sequence[int] = (),
    dp_axes: tuple[int, ...] | None = None,
) -> ShardingInstance:
    """The ILP instance of ``graph`` on ``cost.mesh``; see the module docstring.

    ``accumulated``: inputs (parameters) whose gradient accumulator stays live all along, as
    with several micro-batches (``accumulators``): counted in the parameter's layout, or
    exactly where the rows' data-parallel axes are known (``dp_axes``, the rows pinned)."""
    n_in, n_ops, n_out = len(graph.inputs), len(graph.nodes), len(graph.outputs)
    alias_of_output = {o: i for i, o in aliases}
    twins = symmetric_axis_pairs(cost)
    strategies = _input_strategies(graph, cost, list(input_filters or [None] * n_in), twins)
    strategies += [_op_strategies(node, graph, cost, cost.op_strategies) for node in graph.nodes]
    filters = list(output_filters or [None] * n_out)
    strategies += _output_strategies(graph, cost, filters, alias_of_output, twins)
    edges, edge_info = _edges(graph, cost, strategies, alias_of_output)
    names = [graph.tensors[t].name for t in graph.inputs]
    names += [f"{n.id}:{n.primitive}" for n in graph.nodes]
    names += [f"out{k}" for k in range(n_out)]
    usages = [[s.memory for s in strats] for strats in strategies]
    paired = paired_dims(graph) if accumulated else {}
    for i in accumulated:  # with no axes known: in the parameter's own layout
        nbytes, axes, dims = graph.tensors[graph.inputs[i]].nbytes, dp_axes or (), paired.get(i)
        usages[i] = [
            u + accumulator_bytes(nbytes, s.out_specs[0], cost.mesh.shape, axes, dims or ())
            for u, s in zip(usages[i], strategies[i], strict=True)
        ]
    problem = ShardingProblem.from_lists(
        costs=[[s.compute + s.comm for s in strats] for strats in strategies],
        usages=usages,
        intervals=_intervals(graph, set(donated)),
        edges=list(edges.keys()),
        edge_costs=[m.ravel() for m in edges.values()],
        usage_limit=memory_budget,
        name="alpa_mini",
        node_names=names,
        strategy_names=[[s.name for s in strats] for strats in strategies],
    )
    sinks = tuple(alias_of_output.get(k, n_in + n_ops + k) for k in range(n_out))
    return ShardingInstance(problem, tuple(strategies), n_in, n_ops, tuple(edge_info), sinks)


def cost_floor(graph: OpGraph, cost: CostModel, *, free_inputs: Sequence[int] = ()) -> float:
    """A lower bound on the objective of ``graph``'s ILP on ``cost.mesh`` (and on its LP
    relaxation), read from the graph alone: every operator's work split over all the mesh's
    devices (a strategy's compute is its work split over its ``parallel`` devices, at most
    all of them) and no collective or resharding (never negative); every batch input split
    as far and loaded (``free_inputs`` not at all, as in ``plan_sharding``'s deferred
    bound). It holds under any input filters, and costs one pass over the nodes."""
    n = cost.mesh.num_devices
    total = sum(cost.compute(*node_work(node, graph), n, node.primitive) for node in graph.nodes)
    load = _batch_load(cost)
    free = set(free_inputs)
    for i, t in enumerate(graph.inputs):
        if i not in free and graph.tensors[t].role == "batch":
            total += graph.tensors[t].nbytes / n * load
    return total


def _input_strategies(
    graph: OpGraph, cost: CostModel, filters: list[SpecFilter | None], twins: Any
) -> list[tuple[Strategy, ...]]:
    """The layouts each program input may take (a batch pays its host-to-device load)."""
    mesh_shape = cost.mesh.shape
    load = _batch_load(cost)
    out = []
    for i, t in enumerate(graph.inputs):
        tensor = graph.tensors[t]
        layouts = input_strategies(tensor.shape, tensor.nbytes, mesh_shape, filters[i], twins)
        if tensor.role == "batch":
            layouts = [dataclasses.replace(s, compute=s.memory * load) for s in layouts]
        if not layouts:
            rule = {
                "batch": "the batch's leading dim split over every mesh axis",
                "param": "parameters split over every mesh axis",
                "state": "state split over every mesh axis",
            }.get(tensor.role, "its role's layout")
            raise ValueError(
                f"input {tensor.name} ({tensor.role}): shape {tensor.shape} has no layout on "
                f"mesh {mesh_shape} that satisfies the method ({rule}); split dims must divide "
                "evenly by the mesh axes they use"
            )
        out.append(tuple(layouts))
    return out


def _batch_load(cost: CostModel) -> float:
    """Seconds per byte a batch input costs to arrive: it comes from the host every step,
    each device receiving its own part, priced at the intra-host link (the host-to-device
    path). State stays on the devices across steps."""
    return 1.0 / cost.cluster.intra_host.bandwidth


def _op_strategies(
    node: Any, graph: OpGraph, cost: CostModel, seen: dict[Any, tuple[Strategy, ...]]
) -> tuple[Strategy, ...]:
    """An operator's strategies (warning once per primitive that has no sharding rule).
    ``seen`` holds those of operators alike in everything strategies depend on: the loop
    nest, shapes, dtypes, work and scales (the same operator in each repeated layer)."""
    nest = loop_nest(node, graph) if node.kind != "opaque" else None
    quiet = node.primitive in _warned or node.primitive in QUIET_REPLICATED
    if node.kind == "op" and nest is None and not quiet:
        _warned.add(node.primitive)
        log.warning(
            "alpa_mini has no sharding rule for primitive %r; it runs replicated", node.primitive
        )
    if nest is None:  # replicated: cheap, and priced from the node itself
        return tuple(node_strategies(node, graph, cost))
    outs = tuple((graph.tensors[t].shape, graph.tensors[t].dtype, graph.tensors[t].itemsize)
                 for t in node.outputs)  # fmt: skip
    ins = tuple(None if t is None else graph.tensors[t].shape for t in node.inputs)
    key = (node.primitive, node.kind, nest, ins, outs, node.flops, node.bytes_accessed,
           node.multiplier, node.comm_scale)  # fmt: skip
    found = seen.get(key)
    if found is None:
        found = seen[key] = tuple(node_strategies(node, graph, cost))
    return found


def _output_strategies(
    graph: OpGraph,
    cost: CostModel,
    filters: list[SpecFilter | None],
    alias_of_output: dict[int, int],
    twins: Any,
) -> list[tuple[Strategy, ...]]:
    """One sink per program output: the layouts it may be returned in."""
    mesh_shape = cost.mesh.shape
    out = []
    for k, t in enumerate(graph.outputs):
        tensor = graph.tensors[t]
        if k in alias_of_output:
            # An updated state output is returned in its input's layout: its edge goes to the
            # input's node (see _edges), and this sink is a placeholder with one choice. (A
            # separate sink tied by an alias constraint is equivalent but makes a long cycle
            # that weakens the LP relaxation; HiGHS was 5-10x slower with it.)
            spec = ShardingSpec.replicated(len(tensor.shape))
            out.append((Strategy("alias", (), (spec,), 0.0, 0.0, 0.0),))
            continue
        outs = input_strategies(tensor.shape, 0, mesh_shape, filters[k], twins)
        out.append(tuple(outs) or (input_strategies(tensor.shape, 0, mesh_shape)[0],))
    return out


def _producers(graph: OpGraph) -> dict[int, tuple[int, int]]:
    """Tensor -> (ILP node, result index) that defines it."""
    n_in = len(graph.inputs)
    producer: dict[int, tuple[int, int]] = {}
    for i, t in enumerate(graph.inputs):
        producer.setdefault(t, (i, 0))
    for node in graph.nodes:
        for k, t in enumerate(node.outputs):
            producer[t] = (n_in + node.id, k)
    return producer


def _intervals(graph: OpGraph, donated: set[int]) -> list[tuple[int, int]]:
    """Each ILP node's live interval: inputs from the start (donated ones until their last
    use), an operator's results from its step to their last use, sinks at the end."""
    end_time = len(graph.nodes) + 2
    last_use: dict[int, int] = {}
    for node in graph.nodes:
        for t in node.inputs:
            if t is not None:
                last_use[t] = max(last_use.get(t, 0), node.id + 1)
    for t in graph.outputs:
        last_use[t] = end_time
    intervals = []
    for i, t in enumerate(graph.inputs):
        end = last_use.get(t, 1) + 1 if i in donated else end_time
        intervals.append((0, end))
    for node in graph.nodes:
        start = node.id + 1
        end = max([last_use.get(t, start) + 1 for t in node.outputs] + [start + 1])
        intervals.append((start, end))
    return intervals + [(end_time, end_time)] * len(graph.outputs)


def _edges(
    graph: OpGraph,
    cost: CostModel,
    strategies: list[tuple[Strategy, ...]],
    alias_of_output: dict[int, int],
) -> tuple[dict[tuple[int, int], np.ndarray], list[tuple[int, int, int, int, float]]]:
    """Resharding cost matrices between producers and readers (parallel edges summed), and
    (producer, reader, operand, tensor, weight) of every read."""
    n_in, n_ops = len(graph.inputs), len(graph.nodes)
    producer = _producers(graph)
    edges: dict[tuple[int, int], np.ndarray] = {}
    edge_info = []
    # Alike operators of repeated layers share one strategy tuple (``_op_strategies``), so
    # their edges' matrices are equal: priced once per (strategy tuples, operand, tensor
    # shape, weight). The matrices are only read (``_add_edge`` adds into new arrays).
    seen: dict[tuple[Any, ...], np.ndarray] = {}

    def add(v: int, k: int, t: int, side: str, w: float) -> None:
        tu, idx = producer[t]
        tensor = graph.tensors[t]
        su, sv = strategies[tu], strategies[v]
        key = (id(su), idx, id(sv), side, k, tensor.shape, tensor.dtype, w)
        matrix = seen.get(key)
        if matrix is None:
            # Between two operators, the matrix is the same in every graph planned on this
            # mesh whose operators share those strategy tuples (the free and the pinned ILP
            # of a layer, a settled one); the tuples are kept with it, so ids are not reused.
            between_ops = n_in <= tu < n_in + n_ops and n_in <= v < n_in + n_ops
            shared = cost.edge_matrices.get(key) if between_ops else None
            if shared is not None and shared[0] is su and shared[1] is sv:
                matrix = seen[key] = shared[2]
            else:
                src = [s.out_specs[idx] for s in su]
                specs = (s.in_specs[k] if side == "in" else s.out_specs[0] for s in sv)
                matrix = seen[key] = _reshard_matrix(graph, cost, t, src, list(specs), w)
                if between_ops:
                    cost.edge_matrices[key] = (su, sv, matrix)
        _add_edge(edges, tu, v, matrix)
        edge_info.append((tu, v, k, t, w))

    for node in graph.nodes:
        v = n_in + node.id
        for k, t in enumerate(node.inputs):
            if t is None or t not in producer or graph.tensors[t].role == "const":
                continue
            add(v, k, t, "in", node.weight(k))
    for k, t in enumerate(graph.outputs):
        if graph.tensors[t].role == "const" or t not in producer:
            continue
        v = alias_of_output.get(k, n_in + n_ops + k)
        add(v, 0, t, "out", _output_weight(graph, producer[t][0]))
    return edges, edge_info


def _output_weight(graph: OpGraph, vertex: int) -> float:
    """How often an output moves into its returned (or aliased) layout per run of the graph:
    once, unless its producer's collectives run less often. A pipeshard stage graph is one
    micro-batch, and a gradient it reduces once per step (``comm_scale`` 1/B) is brought into
    its parameter's layout once per step too, as ``gradient_sync_seconds`` prices it. A producer
    inside an inlined loop (``multiplier`` L, deferred: ``comm_scale`` 1/L) still hands its
    output over once."""
    n_in = len(graph.inputs)
    if vertex < n_in:
        return 1.0
    node = graph.nodes[vertex - n_in]
    return min(1.0, node.multiplier * node.comm_scale) if node.multiplier else 1.0


def _add_edge(edges: dict[tuple[int, int], np.ndarray], u: int, v: int, matrix: np.ndarray) -> None:
    """Add ``matrix`` to the edge u-v (stored once per unordered pair)."""
    if u == v or not np.any(matrix):
        if u != v:
            edges.setdefault((u, v), np.zeros_like(matrix))
        return
    if (u, v) in edges:
        edges[(u, v)] = edges[(u, v)] + matrix
    elif (v, u) in edges:
        edges[(v, u)] = edges[(v, u)] + matrix.T
    else:
        edges[(u, v)] = matrix


def _reshard_matrix(
    graph: OpGraph,
    cost: CostModel,
    t: int,
    src: Sequence[ShardingSpec],
    dst: Sequence[ShardingSpec | None],
    weight: float,
) -> np.ndarray:
    """Seconds to move tensor ``t`` from each source layout to each destination (None: the
    reader takes any layout, free), priced once per distinct pair."""
    tensor = graph.tensors[t]
    src_u = list(dict.fromkeys(src))
    dst_u = list(dict.fromkeys(d for d in dst if d is not None))
    table = np.zeros((len(src_u), len(dst_u) + 1))
    if dst_u:
        table[:, :-1] = cost.reshard_table(tensor.shape, tensor.itemsize, src_u, dst_u)
    src_at = {spec: i for i, spec in enumerate(src_u)}
    dst_at = {spec: i for i, spec in enumerate(dst_u)}
    si = np.array([src_at[s] for s in src])
    di = np.array([len(dst_u) if d is None else dst_at[d] for d in dst])
    if weight != 1.0:
        table *= weight  # on the distinct pairs, before they are spread over every pair
    return table[np.ix_(si, di)]


def plan_sharding(
    graph: OpGraph,
    cost: CostModel,
    axis_names: Sequence[str],
    *,
    input_filters: Sequence[SpecFilter | None] | None = None,
    output_filters: Sequence[SpecFilter | None] | None = None,
    aliases: Sequence[tuple[int, int]] = (),
    donated: Sequence[int] = (),
    memory_budget: float | None = None,
    backend: str = "auto",
    time_limit: float | None = 60.0,
    tie_repeats: bool | Literal["only"] = False,
    solve: Callable[..., ShardingSolution] = solve_sharding,
    defer_fractional: bool = False,
    free_inputs: Sequence[int] = (),
    accumulated: Sequence[int] = (),
    accumulators_in_ilp: bool = True,
    gradient_partials: Sequence[tuple[int, int]] = (),
    alternatives: bool = True,
) -> ShardingPlan:
    """Build, solve and read back the plan; raises ``MemoryBudgetError`` when nothing fits.

    ``tie_repeats``: where repeated layers make at least half the ILP's nodes alike
    (``solvers.sharding.tie``), solve with each group of alike nodes tied to one choice, as a
    scanned stack is planned; the full ILP is solved instead when the tied one has no plan
    (``"only"``: ``NotTied`` is raised instead, for callers with a plan to fall back on).
    ``solve``: ``solve_sharding`` or a stand-in with its signature (``SolvePool.solve``).
    ``defer_fractional``: raise the solver's ``FractionalRelaxation`` (its ``lower_bound`` in
    seconds) where the LP relaxation does not settle the ILP, instead of branching;
    ``free_inputs``: its bound then leaves out what these inputs' layouts cost (values the
    caller prices itself, such as activations handed on inside a pipeline stage).
    ``accumulated``: parameters whose gradient accumulators stay live all along (several
    micro-batches), priced as ``accumulators`` explains; ``accumulators_in_ilp=False``: only
    added to the plan's peak after the solve (which may then exceed the budget).
    ``gradient_partials``: (parameter input, gradient output) pairs of a step of one
    micro-batch, whose gradients the runtime holds as unreduced partials: the plan's peak
    gains their excess over the gradients' own layouts after the solve (``partial_excess``;
    it may then exceed the budget). ``alternatives=False``: the plan's choices carry no
    priced alternatives (``read_plan``), for callers that never ``explain`` it.
    """
    once = functools.partial(
        _plan_once,
        graph,
        cost,
        axis_names,
        output_filters=output_filters,
        aliases=aliases,
        donated=donated,
        memory_budget=memory_budget,
        backend=backend,
        time_limit=time_limit,
        tie_repeats=tie_repeats,
        solve=solve,
        defer_fractional=defer_fractional,
        free_inputs=free_inputs,
        accumulated=accumulated if accumulators_in_ilp else (),
        alternatives=alternatives,
    )
    filters = list(input_filters or [None] * len(graph.inputs))
    plan, inst = once(input_filters=filters, dp_axes=None)
    if gradient_partials:
        excess = partial_excess(plan, gradient_partials, cost.mesh.shape)
        plan = dataclasses.replace(plan, peak_memory=plan.peak_memory + excess)
    specs = [plan.tensors[t].spec for t in plan.inputs]
    mesh = cost.mesh.shape
    extra = extra_bytes(plan, specs, accumulated, mesh, accumulators_in_ilp) if accumulated else 0
    if extra <= 0.0:
        return plan
    plan = dataclasses.replace(plan, peak_memory=plan.peak_memory + extra)
    if not accumulators_in_ilp or memory_budget is None or plan.peak_memory <= memory_budget:
        return plan
    if defer_fractional:  # the relaxed optimum bounds every exact plan
        bound = plan.solver["objective"]
        if free_inputs or plan.solver["status"] != "optimal":
            bound = _bound_without(inst.problem, free_inputs, backend, time_limit, solve)
        raise FractionalRelaxation("the accumulators do not fit the relaxed plan", bound)
    layouts = [[s.out_specs[0] for s in strats] for strats in inst.strategies[: inst.num_inputs]]
    return fit_accumulators(graph, cost.mesh.shape, layouts, filters, memory_budget, once)


def _plan_once(
    graph: OpGraph,
    cost: CostModel,
    axis_names: Sequence[str],
    *,
    input_filters: Sequence[SpecFilter | None],
    output_filters: Sequence[SpecFilter | None] | None,
    aliases: Sequence[tuple[int, int]],
    donated: Sequence[int],
    memory_budget: float | None,
    backend: str,
    time_limit: float | None,
    tie_repeats: bool | Literal["only"],
    solve: Callable[..., ShardingSolution],
    defer_fractional: bool,
    free_inputs: Sequence[int],
    accumulated: Sequence[int],
    dp_axes: tuple[int, ...] | None,
    alternatives: bool = True,
) -> tuple[ShardingPlan, ShardingInstance]:
    """One build, solve and read-back (``plan_sharding``)."""
    global _builds_started
    with _BUILD_LOCK:
        _builds_started += 1
        t0 = time.perf_counter()
        inst = build_sharding_problem(
            graph,
            cost,
            input_filters=input_filters,
            output_filters=output_filters,
            aliases=aliases,
            donated=donated,
            memory_budget=memory_budget,
            accumulated=accumulated,
            dp_axes=dp_axes,
        )
        build_time = time.perf_counter() - t0
    try:
        sol = _solve_tied(inst.problem, backend, time_limit, solve) if tie_repeats else None
        if sol is None and tie_repeats == "only":
            raise NotTied(f"{inst.problem.num_nodes} nodes: too few alike, or no tied plan")
        sol = sol or _solve(inst.problem, backend, time_limit, solve=solve, defer=defer_fractional)
    except FractionalRelaxation as err:
        if not free_inputs:
            raise
        bound = _bound_without(inst.problem, free_inputs, backend, time_limit, solve)
        raise FractionalRelaxation(
            f"{err} (bound without inputs {list(free_inputs)})", bound
        ) from None
    except SolverTimeLimitError as err:
        raise MemoryBudgetError(
            f"time_limit: the ILP found no feasible plan on mesh {cost.mesh.shape} within "
            f"{time_limit} s ({err}); raise ShardParallel(time_limit=...) or pick a smaller mesh",
            None,
            timed_out=True,
        ) from None
    except InfeasibleError as err:
        min_peak = err.details.get("min_peak")
        need = "unknown" if min_peak is None else format_bytes(min_peak, 2)
        raise MemoryBudgetError(
            f"memory_budget: {format_bytes(memory_budget, 2)} per device is too small for this "
            f"program on mesh {cost.mesh.shape}; the smallest peak found is {need} per device "
            "(raise the budget, use more devices, or a larger mesh)",
            min_peak,
        ) from None
    plan = read_plan(graph, cost, axis_names, inst, sol, memory_budget, build_time, alternatives)
    return plan, inst


def build_activity() -> tuple[int, bool]:
    """(ILP builds begun so far, whether one is running now): lets a caller that would take
    the GIL for long (JAX tracing) wait until the ILPs just asked for are built and with
    their solver processes."""
    return _builds_started, _BUILD_LOCK.locked()


def _bound_without(problem: ShardingProblem, nodes: Sequence[int], backend, time_limit, solve):
    """A lower bound on ``problem``'s optimum less what ``nodes`` cost: the optimum (or LP
    bound) of the same choices with those nodes' allowed strategies made free."""
    costs = problem.node_costs.copy()
    offsets = problem.node_offsets
    for v in nodes:
        seg = costs[offsets[v] : offsets[v + 1]]
        seg[np.isfinite(seg) & (seg < FORBIDDEN_COST)] = 0.0
    free = dataclasses.replace(problem, node_costs=costs)
    try:
        return _solve(free, backend, time_limit, solve=solve, defer=True).objective
    except FractionalRelaxation as err:
        return err.lower_bound


def _solve(
    problem: ShardingProblem,
    backend: str,
    time_limit: float | None,
    heuristic: bool = True,
    solve: Callable[..., ShardingSolution] = solve_sharding,
    defer: bool = False,
) -> ShardingSolution:
    # Most planner graphs simplify to a few hundred nodes that HiGHS solves directly; a short
    # local-search incumbent only pays on big cores (3-D meshes), where HiGHS can otherwise
    # run out of time before its first feasible point.
    return solve(
        problem,
        backend=backend,
        time_limit=time_limit,
        heuristic_time=min(2.0, 0.1 * time_limit) if time_limit else 2.0,
        heuristic_min_strategies=HEURISTIC_MIN_CORE_STRATEGIES if heuristic else 2**62,
        # Planner MIPs are sparse chains; HiGHS proves them whole in seconds well past the
        # contest-tuned column cap, where region-by-region search runs to the limit.
        full_mip_max_columns=FULL_MIP_MAX_COLUMNS,
        # Planner MIPs nearly always have integral LP relaxations: settle them by LP.
        lp_first=True,
        defer_fractional=defer,
    )


def _solve_tied(
    problem: ShardingProblem,
    backend: str,
    time_limit: float | None,
    solve: Callable[..., ShardingSolution] = solve_sharding,
) -> ShardingSolution | None:
    """The solution with alike nodes tied (see ``plan_sharding``), read back as a solution of
    ``problem``; None when tying would not halve the problem or the tied one has no plan."""
    groups = repeated_groups(problem, rounds=TIE_ROUNDS)
    num_groups = int(groups.max()) + 1 if len(groups) else 0
    if num_groups > problem.num_nodes // 2:
        return None
    t0 = time.perf_counter()
    tied_problem = tie_nodes(problem, groups)
    # First without the memory limit: a tied group's usage is a conservative hull, and its
    # constraint rows are dense, which makes the MIP much harder. When the best tied plan
    # without the limit fits untied, it is also the best tied plan with it.
    for limit in (None, tied_problem.usage_limit):
        try:
            # Without the limit the LP relaxation settles it: no local-search incumbent.
            tied = _solve(
                tied_problem.with_usage_limit(limit), backend, time_limit, limit is not None, solve
            )
        except (InfeasibleError, SolverTimeLimitError):
            return None
        choice = untie_choice(groups, tied.choice)
        ev = evaluate(problem, choice)
        if ev.feasible or limit is not None:
            break
    if not ev.feasible:
        return None
    reduction = {**tied.reduction, "tied": (problem.num_nodes, num_groups)}
    return dataclasses.replace(
        tied,
        choice=tuple(int(c) for c in choice),
        objective=ev.cost,
        node_cost=ev.node_cost,
        edge_cost=ev.edge_cost,
        peak_usage=ev.peak_usage,
        lower_bound=None,  # a bound of the tied problem, not of this one
        solve_time=time.perf_counter() - t0,
        reduction=reduction,
    )
