"""What one stage costs: the per-stage ILP of a slice's forward + backward on a (submesh,
logical mesh, layout), cached by structural hash and solved ahead on a thread pool.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr

from ..cluster.spec import ClusterSpec
from ..errors import ConfigError, MemoryBudgetError
from ..graph.grad_capture import GradCapture
from ..graph.jaxpr_walk import eval_eqns, without_dead_code
from ..graph.tracing import trace_jaxpr
from ..options.pipeshard import (
    PipeshardParallel,
)
from ..shard.accumulators import held_accumulators
from ..shard.cost_model import CostModel
from ..shard.plan import ShardingPlan
from ..shard.problem import cost_floor, plan_sharding
from ..shard.solve_pool import active_pool, session_pool, usable_cpus
from ..shard.spec import ShardingSpec
from ..shard.strategies import ELEMENTWISE
from ..solvers import FractionalRelaxation, solve_sharding
from ..solvers.sharding.tie import NotTied
from .grad_pricing import amortize_gradient_reductions, every_micro_batch, gradient_sync_seconds
from .layers import layer_hash
from .stage_configs import StageConfig
from .stage_slice import slice_stage
from .stage_trace import layer_calls

__all__ = ["PlanningCounters", "StageCost"]


AXIS_NAMES = ("x", "y", "z")


@dataclass(frozen=True, slots=True)
class StageCost:
    """ILP result for one (layer range, submesh, logical mesh): latency and memory."""

    latency: float
    peak_memory: float  # one micro-batch's forward + backward, parameters and gradients included
    residual_bytes: float  # per device, per micro-batch held between forward and backward
    state_bytes: float  # optimiser state per device
    plan: ShardingPlan | None = None
    in_specs: tuple[ShardingSpec | None, ...] = ()
    out_specs: tuple[ShardingSpec | None, ...] = ()
    # (equation, result, spec): layouts the ILP chose for values inside the stage (individual
    # mode: each layer's results that later layers of the stage read).
    inner_specs: tuple[tuple[int, int, ShardingSpec], ...] = ()
    # A lower bound, not a plan: the ILP's LP relaxation was fractional and branch-and-bound
    # was deferred (``_StageModel.defer_fractional``). ``latency`` is the relaxation's
    # optimum less the host load of its activations and cotangents (``_StageJob.handed``),
    # which a composition pays only at a stage's edges; with no layouts known,
    # ``peak_memory`` and ``held_bytes`` count parameters as sharded over every device.
    bound: bool = False
    # What the layer holds while others run (``compose._held_bytes``): for a plan, its
    # ``plan_held_bytes``; for a bound, a lower bound.
    held_bytes: float | None = None

    def memory(self, in_flight: int) -> float:
        return self.peak_memory + self.state_bytes + max(in_flight - 1, 0) * self.residual_bytes


@dataclass
class PlanningCounters:
    """What planning cost so far: ILPs really solved, stage costs needed (the DP table's cells
    for auto stages, one per stage otherwise), lookups the structural-hash cache answered,
    free stage MIPs that stopped unproven and how often a restricted plan then won, MIPs left
    at their LP bound and how many of those were later solved exactly, and seconds building
    op graphs, in ILPs (summed over threads) and in the stage DP."""

    ilps_solved: int = 0
    ilps_unproven: int = 0
    restricted_wins: int = 0
    ilps_deferred: int = 0
    ilps_settled: int = 0
    cost_entries: int = 0
    cache_hits: int = 0
    graph_seconds: float = 0.0
    ilp_seconds: float = 0.0
    dp_seconds: float = 0.0


#: Operators summed over a batch of ILPs from which solving them in child processes pays
#: (gpt-1.3b's layers on 4 GPUs: 18 ILPs, 6000 operators, 3.4 -> 2.5 s a count).
POOL_MIN_NODES = 2000

#: Seconds a whole-stage ILP of the default refinement may take (``refine.refine_stages``):
#: past them its best plan so far is used if it beats the composed one.
REFINE_TIME_LIMIT = 10.0


#: The cost models of the stage models made inside ``shared_cost_models``, by mesh.
_SHARED_COST_MODELS: contextvars.ContextVar[dict[Any, CostModel] | None] = contextvars.ContextVar(
    "alpa_mini_shared_cost_models", default=None
)


@contextlib.contextmanager
def shared_cost_models() -> Iterator[None]:
    """Stage models made inside start each mesh's cost model from the one the previous stage
    model used (``CostModel.carried``): the micro-batch search plans the same layers at every
    count, and their resharding steps do not depend on the micro-batch size."""
    token = _SHARED_COST_MODELS.set({})
    try:
        yield
    finally:
        _SHARED_COST_MODELS.reset(token)


class _StageModel:
    """Builds and solves the per-stage ILP for equation ranges of the forward."""

    def __init__(
        self,
        forward: ClosedJaxpr,
        capture: GradCapture,
        cluster: ClusterSpec,
        method: PipeshardParallel,
        state_bytes_total: float,
        param_bytes_total: float,
    ) -> None:
        self.forward, self.capture, self.cluster, self.method = forward, capture, cluster, method
        self.consts = dict(zip(forward.jaxpr.constvars, forward.consts, strict=True))
        self.loss_in = {v: j for j, v in enumerate(forward.jaxpr.invars)}
        self.state_ratio = state_bytes_total / param_bytes_total if param_bytes_total else 0.0
        self.cache: dict[Any, StageCost | None] = {}
        self._slices: dict[tuple[int, int], Any] = {}
        self._graphs: dict[Any, tuple[Any, float, float]] = {}
        self._calls: dict[str, Callable[..., Any]] = {}  # ``_layer_calls``, by layer hash
        self._cost_models: dict[Any, CostModel] = {}
        self._floors: dict[Any, tuple[float, float, float]] = {}
        self._latency_floors: dict[Any, float] = {}
        self._shared = _SHARED_COST_MODELS.get()  # read here: prefetch threads do not see it
        # DeepSpeed's ZeRO-2 gradients (``grad_pricing``), for a baseline; read here likewise.
        self.every_micro_batch = every_micro_batch()
        # Gradients tied to their parameters' layouts inside the ILP (gradient_sync="ilp").
        self.ties_gradients = method.gradient_sync == "ilp" and not self.every_micro_batch
        self._fresh: set[Any] = set()
        self._sites: dict[Any, tuple[int, int]] | None = None
        # Preset (pinned-layout) ILPs by (structure, submesh, logical mesh, layout, batch
        # axis): the memory-lean ZeRO-3 column and the free MIP's ZeRO-3 fallback are the same
        # ILP, and prefetch threads may ask for it at once; it is solved once.
        self._presets: dict[Any, Future] = {}
        # (start, end) of the layers stages are composed from (individual profiling): their
        # accumulators are priced after the solve (``shard.accumulators``).
        self.composed_layers: frozenset[tuple[int, int]] = frozenset()
        self._lock = threading.Lock()
        self.stats = PlanningCounters()
        # While set, an ILP whose LP relaxation is fractional is not branched on: its cost is
        # cached as the relaxation's bound (``StageCost.bound``) until ``settle`` solves it.
        # The stage DP sets it: a DP over bounds that picks only exact cells is optimal.
        self.defer_fractional = False
        # While set (``refine.refine_stages``), whole-stage ILPs are solved only with repeated
        # layers tied (else no plan), stop at ``REFINE_TIME_LIMIT`` and have no restricted
        # fallback: a composed plan stands by.
        self.refining = False

    def _io(self, start: int, end: int) -> tuple[Any, ...]:
        hit = self._slices.get((start, end))
        if hit is not None:
            return hit
        sl = slice_stage(self.forward.jaxpr, start, end, self.capture.diff)
        diff_in, nondiff_in = list(sl.diff_in), list(sl.nondiff_in)
        diff_out, nondiff_out = list(sl.diff_out), list(sl.nondiff_out)
        # Equal equations are not enough: whether each input is a parameter, a batch input or
        # an activation, and which values need cotangents, change the forward + backward.
        diff = set(diff_in) | set(diff_out)
        kinds = tuple("const" if v in self.consts else (v in diff, self.role(v)) for v in sl.invars)
        key = (
            layer_hash(sl.eqns, sl.invars, sl.outvars, positions=False),
            kinds,
            tuple(v in diff for v in sl.outvars),
        )
        out = self._slices[(start, end)] = (sl, diff_in, nondiff_in, diff_out, nondiff_out, key)
        return out

    def ilp_inputs(self, start: int, end: int) -> list[tuple[Any, bool]]:
        """The inputs of equations ``[start, end)``'s ILP, in order, as (variable, is the
        cotangent of that output): differentiable inputs, the others, then one cotangent per
        differentiable output."""
        return _ilp_inputs(self._io(start, end))

    def result_sites(self) -> dict[Any, tuple[int, int]]:
        """Each forward variable's (equation, result index)."""
        if self._sites is None:
            self._sites = {
                v: (e, o)
                for e, eqn in enumerate(self.forward.jaxpr.eqns)
                for o, v in enumerate(eqn.outvars)
            }
        return self._sites

    def role(self, v: Any) -> str:
        """The op-graph role of a stage input: activations arrive like a batch."""
        j = self.loss_in.get(v)
        if j is None:
            return "batch"
        if self.capture.diff[j]:
            return "param"
        return "batch" if self.capture.batch[j] else "state"

    def slice(self, start: int, end: int) -> Any:
        """The ``StageSlice`` of equations ``[start, end)`` (cached)."""
        return self._io(start, end)[0]

    def cost(
        self,
        start: int,
        end: int,
        submesh: tuple[int, int],
        logical: tuple[int, ...],
        layout: str = "auto",
    ) -> StageCost | None:
        io = self._io(start, end)
        key = (*io[5], submesh, logical, layout)
        if key in self.cache:
            if key in self._fresh:  # solved ahead by ``prefetch``: this is its first use
                self._fresh.discard(key)
            else:
                self.stats.cache_hits += 1
            return self.cache[key]
        result = self._solve(io, submesh, logical, layout)
        self.cache[key] = result
        return result

    def prefetch(self, requests: Sequence[tuple[int, int, tuple[int, int], StageConfig]]) -> None:
        """Solve the distinct ILPs behind ``requests`` (start, end, submesh, config) on a
        thread pool, so that later ``cost`` calls find them cached.

        Inside a ``solve_session`` the ILPs are solved in child processes while these threads
        build the next (Python that holds the GIL); otherwise only HiGHS, which releases the
        GIL, overlaps another thread's Python. The op graphs are traced first, here, since
        JAX tracing is left to the calling thread.
        """
        todo: dict[Any, tuple[Any, tuple[int, int], tuple[int, ...], str]] = {}
        for start, end, submesh, (logical, layout) in requests:
            io = self._io(start, end)
            key = (*io[5], submesh, logical, layout)
            if key not in self.cache:
                self._graph(io)
                todo.setdefault(key, (io, submesh, logical, layout))
        # Solver processes pay for their start (about 0.3 s each) only on enough work. With
        # them, two threads more than there are processes: while they solve, one builds the
        # next ILP (one at a time: shard.problem._BUILD_LOCK) and one reads a plan back or
        # holds a built ILP ready for the first process to finish.
        nodes = sum(len(self._graph(io)[0].nodes) for io, *_ in todo.values())
        pool = session_pool() if nodes >= POOL_MIN_NODES else active_pool()
        workers = min(len(todo), usable_cpus() if pool is None else pool.size + 2)
        if workers <= 1:
            return
        # Largest first (more mesh axes, more nodes), so that no big ILP starts last.
        keys = sorted(todo, key=lambda k: (-len(todo[k][2]), -len(todo[k][0][0].eqns)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(lambda k: self._solve(*todo[k]), keys))
        for key, result in zip(keys, results, strict=True):
            self.cache[key] = result
            self._fresh.add(key)

    def settle(self, requests: Sequence[tuple[int, int, tuple[int, int], StageConfig]]) -> None:
        """Solve exactly the ILPs behind ``requests`` whose cached cost is only a bound."""
        stale = []
        for start, end, submesh, (logical, layout) in requests:
            key = (*self._io(start, end)[5], submesh, logical, layout)
            hit = self.cache.get(key)
            if hit is not None and hit.bound:
                del self.cache[key]
                self._fresh.discard(key)
                stale.append((start, end, submesh, StageConfig(logical, layout)))
        deferring, self.defer_fractional = self.defer_fractional, False
        try:
            self.prefetch(stale)
            for start, end, submesh, (logical, layout) in stale:
                self.cost(start, end, submesh, logical, layout)
        finally:
            self.defer_fractional = deferring
        self.stats.ilps_settled += len(stale)

    def cost_model(self, submesh: tuple[int, int], logical: tuple[int, ...]) -> CostModel:
        """One cost model per mesh, so its resharding cache serves every layer planned there
        (and, inside ``shared_cost_models``, what of it the earlier counts worked out)."""
        key = (submesh, logical)
        with self._lock:
            if key not in self._cost_models:
                earlier = None if self._shared is None else self._shared.get(key)
                if earlier is not None and earlier.cluster is self.cluster:
                    model = earlier.carried()
                else:
                    model = CostModel(self.cluster, self.cluster.logical_mesh(logical, submesh))
                self._cost_models[key] = model
                if self._shared is not None:
                    self._shared[key] = model
            return self._cost_models[key]

    def _graph(self, io: tuple[Any, ...]) -> tuple[Any, float, float]:
        """The op graph of the slice's forward + backward for one micro-batch, its residual
        bytes and parameter bytes; traced once per structural hash (it does not depend on the
        mesh)."""
        hit = self._graphs.get(io[5])
        if hit is not None:
            return hit
        t0 = time.perf_counter()
        sl, diff_in, nondiff_in, diff_out, nondiff_out, _ = io
        consts = {v: c for v, c in self.consts.items() if v in set(sl.invars)}

        layers = self._layer_calls(sl)

        def f_of(nd: Sequence[Any]) -> Callable[..., Any]:
            def f(*dvals: Any) -> tuple[list[Any], list[Any]]:
                env: dict[Any, Any] = dict(consts)
                env.update(zip(diff_in, dvals, strict=True))
                env.update(zip(nondiff_in, nd, strict=True))
                if layers is None:
                    eval_eqns(sl.eqns, env)
                for call, ls in layers or ():
                    env.update(zip(ls.outvars, call(*[env[v] for v in ls.invars]), strict=True))
                return [env[v] for v in diff_out], [env[v] for v in nondiff_out]

            return f

        nd_n = len(diff_in)
        roles = [self.role(v) for v in (*diff_in, *nondiff_in)]
        # The residuals the forward keeps for the backward: the leaves of the vjp function,
        # read while tracing ``train`` (one trace, where a second ``eval_shape`` of the
        # forward alone would cost as much again). A leaf that is a parameter or state input
        # is that input itself, held once however many micro-batches are in flight (the
        # runtime passes it to the backward as an input, ``lower.compile``), so it is not a
        # residual; an activation input is, as the backward needs it per micro-batch.
        res_bytes: list[float] = []

        def train(*args: Any) -> list[Any]:
            d, nd, cts = (
                args[:nd_n],
                args[nd_n : nd_n + len(nondiff_in)],
                args[nd_n + len(nondiff_in) :],
            )
            outs_d, vjp_fn, outs_nd = jax.vjp(f_of(nd), *d, has_aux=True)
            held = {id(x) for x, r in zip((*d, *nd), roles, strict=True) if r != "batch"}
            leaves = [x for x in jax.tree.leaves(vjp_fn) if id(x) not in held]
            res_bytes.append(sum(_nbytes(jax.typeof(x)) for x in leaves))
            grads = vjp_fn(list(cts))
            return [*outs_d, *outs_nd, *grads]

        avals = [
            jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
            for v in (*diff_in, *nondiff_in, *diff_out)
        ]
        closed = without_dead_code(jax.make_jaxpr(train)(*avals))
        graph_roles = [*roles, *["batch"] * len(diff_out)]  # cotangents arrive like a batch
        names = [f"in{k}" for k in range(len(graph_roles))]
        graph = trace_jaxpr(closed, graph_roles, names)
        first_grad = len(diff_out) + len(nondiff_out)
        grads = [first_grad + k for k, r in enumerate(roles[:nd_n]) if r == "param"]
        per_step = 1.0 if self.every_micro_batch else 1.0 / self.method.num_micro_batches
        graph = amortize_gradient_reductions(graph, grads, per_step)
        param_bytes = sum(
            _nbytes(v.aval)
            for v in diff_in
            if v in self.loss_in and self.capture.diff[self.loss_in[v]]
        )
        out = self._graphs[io[5]] = (graph, res_bytes[0], param_bytes)
        with self._lock:
            self.stats.graph_seconds += time.perf_counter() - t0
        return out

    def _layer_calls(self, sl: Any) -> list[tuple[Callable[..., Any], Any]] | None:
        """``stage_trace.layer_calls`` of a slice over the composed layers."""
        return layer_calls(sl, self.composed_layers, self.slice, self._calls, self._lock)

    def _solve(
        self,
        io: tuple[Any, ...],
        submesh: tuple[int, int],
        logical: tuple[int, ...],
        layout: str = "auto",
    ) -> StageCost | None:
        """The stage's cost on (submesh, logical mesh, layout), or None when nothing fits."""
        job = self._job(io, submesh, logical, layout)
        try:
            preset = None if job.filters is None else job.opt
            plan = self._solve_once(job, job.filters, preset, self.defer_fractional)
        except ValueError:
            if layout == "auto":
                raise
            return None  # some input has no layout under this preset (e.g. batch 6 on 4)
        if isinstance(plan, FractionalRelaxation):
            return self._bound_cost(io, job, plan.lower_bound)
        unproven = plan == "time" or (
            isinstance(plan, ShardingPlan) and plan.solver.get("status") != "optimal"
        )
        if job.filters is None and unproven and not self.refining:
            free = plan
            plan = self._restricted(job, plan)
            with self._lock:
                self.stats.ilps_unproven += 1
                self.stats.restricted_wins += plan is not free
        if not isinstance(plan, ShardingPlan):
            return None  # this stage does not fit here; the DP sees an infinite cost
        return self._stage_cost(io, job, plan)

    def _job(
        self, io: tuple[Any, ...], submesh: tuple[int, int], logical: tuple[int, ...], layout: str
    ) -> _StageJob:
        """Everything the stage's ILPs on one (submesh, logical mesh, layout) share."""
        sl, diff_in, nondiff_in, diff_out, nondiff_out, key = io
        graph, res_total, param_bytes = self._graph(io)
        n_dev = submesh[0] * submesh[1]
        opt = self.method.default_auto_sharding_option
        if layout != "auto":  # a memory-lean configuration pins a preset's layouts
            opt = dataclasses.replace(opt, layout=layout, batch_axis=None, tensor_splits=None)
        budget = _budget(self.method, self.cluster)
        # Optimiser state is sharded over the stage's devices, except under plain data
        # parallelism, which keeps a whole copy on every device, and Megatron's layout, which
        # keeps it like each parameter (the runtime does the same:
        # PipeshardParallel.shards_optimizer_state, lower/apply_grad.state_sharding).
        roles = [self.role(v) for v in (*diff_in, *nondiff_in)] + ["batch"] * len(diff_out)
        if opt.layout == "megatron":
            state = self.state_ratio * sum(
                _nbytes(v.aval) / opt.state_devices(tuple(v.aval.shape), logical)
                for v, role in zip(diff_in, roles, strict=False)
                if role == "param"
            )
        else:
            state = self.state_ratio * param_bytes / (1 if opt.layout == "data" else n_dev)
        filters = None
        if opt.layout != "auto" or opt.batch_axis is not None:  # a preset pins input layouts
            filters = _pins(opt, graph, roles, logical)
        # Input k of a parameter has its gradient at output first_grad + k. With
        # gradient_sync="ilp" the two are tied, so the ILP prices (and avoids) the all-reduce
        # or gather that brings the gradient into the parameter's layout.
        first_grad = len(diff_out) + len(nondiff_out)
        params = [k for k in range(len(diff_in)) if roles[k] == "param"]
        tie = self.ties_gradients
        grad_filters = None
        if self.every_micro_batch:  # ZeRO-2 as DeepSpeed runs it (``grad_pricing``)
            grad_filters, held = self._partitions(graph, opt, logical, diff_in, params, first_grad)
            state += held
        return _StageJob(
            key=key,
            submesh=submesh,
            logical=logical,
            graph=graph,
            cost=self.cost_model(submesh, logical),
            opt=opt,
            roles=roles,
            filters=filters,
            params=params,
            first_grad=first_grad,
            tie=tie,
            aliases=[(k, first_grad + k) for k in params] if tie else [],
            # Activations and cotangents: priced as arriving from the host, though inside a
            # stage they are handed on (compose._layer_table credits that load back).
            handed=self._handed(io),
            memory=None if math.isinf(budget) else max(budget - state, 1.0),
            state=state,
            grad_filters=grad_filters,
            residual_bytes=res_total / n_dev,
            layer=(sl.start, sl.end) in self.composed_layers,
        )

    def _handed(self, io: tuple[Any, ...]) -> list[int]:
        """The ILP inputs a composition hands on inside a stage: activations, cotangents."""
        return [k for k, (v, cot) in enumerate(_ilp_inputs(io)) if cot or v not in self.loss_in]

    def _solve_once(
        self, job: _StageJob, filters: list[Any] | None, preset: Any, defer: bool = False
    ) -> Any:
        """The plan, or why there is none: "memory" or "time", or (``defer``) the LP bound
        that stood in for a fractional MIP. ``preset`` (the pinning method) names a
        restricted ILP, which is solved once per stage model."""
        if preset is None:
            return self._run(job, filters, defer)
        # With ``defer`` in the key, a bound never answers an exact request.
        key = (job.key, job.submesh, job.logical, preset.layout, preset.batch_axis, defer)
        with self._lock:
            future = self._presets.get(key)
            mine = future is None
            if mine:
                future = self._presets[key] = Future()
        if mine:
            try:
                future.set_result(self._run(job, filters, defer))
            except BaseException as err:  # ValueError: no such layout; waiters see it too
                future.set_exception(err)
        return future.result()

    def _run(
        self, job: _StageJob, filters: list[Any] | None, defer: bool
    ) -> ShardingPlan | str | FractionalRelaxation:
        with self._lock:
            self.stats.ilps_solved += 1
        t0 = time.perf_counter()
        several = self.method.num_micro_batches > 1
        try:
            pool = active_pool()
            return plan_sharding(
                job.graph,
                job.cost,
                AXIS_NAMES[: len(job.logical)],
                input_filters=filters,
                output_filters=job.grad_filters,
                aliases=job.aliases,
                memory_budget=job.memory,
                backend=job.opt.backend,
                time_limit=min(job.opt.time_limit, REFINE_TIME_LIMIT)
                if self.refining
                else job.opt.time_limit,
                tie_repeats="only" if self.refining else False,
                solve=solve_sharding if pool is None else pool.solve,
                defer_fractional=defer,
                # A deferred layer's bound leaves their load out, which a composed stage
                # only pays for values from outside it: the bound holds either way.
                free_inputs=job.handed if defer else (),
                # With several micro-batches every gradient accumulates all step long...
                accumulated=job.params if several and not self.every_micro_batch else (),
                accumulators_in_ilp=not job.layer,
                # ...with one, a whole stage holds each as its group's partial until the sync.
                gradient_partials=[(k, job.first_grad + k) for k in job.params]
                if not several and not self.every_micro_batch and not job.layer
                else (),
                alternatives=False,  # a stage's ILP plans are read for layouts and costs only
            )
        except MemoryBudgetError as err:
            return "time" if err.timed_out else "memory"
        except NotTied:
            return "untied"  # (refining: the composed stage stands)
        except FractionalRelaxation as err:
            with self._lock:
                self.stats.ilps_deferred += 1
            return err
        finally:
            with self._lock:
                self.stats.ilp_seconds += time.perf_counter() - t0

    def _restricted(self, job: _StageJob, plan: Any) -> Any:
        """The free MIP stopped unproven (or found nothing in time). Two restrictions of the
        free space make far easier MIPs: ZeRO-3's layouts (parameters and state fully
        sharded, the batch split), and Megatron's (the batch split on the mesh's first axis,
        everything else free). Keep whichever plan is fastest."""
        for pinned in (
            dataclasses.replace(job.opt, layout="zero3", batch_axis=None),
            dataclasses.replace(job.opt, layout="auto", batch_axis=0),
        ):
            pins = _pins(pinned, job.graph, job.roles, job.logical)
            if all(p is None for p in pins):
                continue  # nothing pinned (a mesh whose first axis is 1): the free MIP
            try:
                other = self._solve_once(job, pins, pinned)
            except ValueError:  # some input has no such layout (e.g. batch 6 on 4)
                continue
            if isinstance(other, ShardingPlan) and (
                not isinstance(plan, ShardingPlan) or other.predicted_time < plan.predicted_time
            ):
                plan = other
        return plan

    def _bound_cost(self, io: tuple[Any, ...], job: _StageJob, seconds: float) -> StageCost:
        """A lower bound on the stage's cost from its ILP's LP relaxation: no gradient sync
        or resharding priced (no layouts known); memory as if every parameter (and its
        gradient) were sharded over all the submesh's devices, which no layout beats."""
        sl, params = io[0], self._graph(io)[2] / (job.submesh[0] * job.submesh[1])
        return StageCost(
            latency=seconds + self._launches(job.cost, job.graph),
            # Parameters and gradients are all live when the backward ends; the residuals
            # when it starts.
            peak_memory=max(2 * params, job.residual_bytes),
            residual_bytes=job.residual_bytes,
            state_bytes=job.state,
            in_specs=(None,) * len(sl.invars),
            out_specs=(None,) * len(sl.outvars),
            bound=True,
            held_bytes=2 * params + job.residual_bytes,
        )

    def cost_pinned(
        self,
        start: int,
        end: int,
        submesh: tuple[int, int],
        logical: tuple[int, ...],
        layout: str,
        pins: dict[int, ShardingSpec],
    ) -> StageCost | None:
        """The cost of equations ``[start, end)`` with some ILP inputs (position -> layout)
        held in given layouts, solved exactly (cached): a layer that shares parameters with
        another re-planned to read them as that one does (``compose.shared_pins``)."""
        io = self._io(start, end)
        key = (*io[5], submesh, logical, layout, "pinned", tuple(sorted(pins.items())))
        if key not in self.cache:
            job = self._job(io, submesh, logical, layout)
            filters = list(job.filters or [None] * len(job.roles))
            for k, spec in pins.items():
                filters[k] = functools.partial(_pinned_to, spec, filters[k])
            try:
                plan = self._run(job, filters, False)
            except ValueError:  # no layout of the preset is the pinned one
                plan = None
            ok = isinstance(plan, ShardingPlan)
            self.cache[key] = self._stage_cost(io, job, plan) if ok else None
        return self.cache[key]

    def memory_floor(
        self, start: int, end: int, submesh: tuple[int, int], logical: tuple[int, ...], layout: str
    ) -> tuple[float, float, float]:
        """Bytes per device no plan of equations ``[start, end)`` on this mesh holds less of,
        without solving anything (``memory_screen``): (parameters, gradients and residuals
        split evenly over the submesh, residuals, optimiser state)."""
        io = self._io(start, end)
        key = (*io[5], submesh, logical, layout)
        hit = self._floors.get(key)
        if hit is None:
            floor = self._bound_cost(io, self._job(io, submesh, logical, layout), 0.0)
            hit = self._floors[key] = (
                floor.held_bytes, floor.residual_bytes, floor.state_bytes
            )  # fmt: skip
        return hit

    def latency_floor(
        self, start: int, end: int, submesh: tuple[int, int], logical: tuple[int, ...]
    ) -> float:
        """Seconds per micro-batch no plan of equations ``[start, end)`` on a submesh of this
        shape takes less than, as a composed layer (its handed values free, as
        ``_bound_cost`` leaves them), without building its ILP (``shard.problem.cost_floor``:
        the same for every logical mesh and layout of the submesh's devices)."""
        io = self._io(start, end)
        key = (io[5], submesh)
        hit = self._latency_floors.get(key)
        if hit is None:
            launches = self._launches(self.cost_model(submesh, logical), self._graph(io)[0])
            hit = self.work_floor(start, end, submesh, logical) + launches
            self._latency_floors[key] = hit
        return hit

    def work_floor(self, start: int, end: int, submesh: tuple[int, int], logical) -> float:
        """``latency_floor`` without the program launches."""
        io, model = self._io(start, end), self.cost_model(submesh, logical)
        return cost_floor(self._graph(io)[0], model, free_inputs=self._handed(io))

    def _launches(self, cost: CostModel, graph: Any) -> float:
        """Seconds the stage's kernels take to launch (0 on a cluster without a profile)."""
        if not self.cluster.profile:
            return 0.0
        return cost.program_overhead(_kernels(graph), 0)

    def _stage_cost(self, io: tuple[Any, ...], job: _StageJob, plan: ShardingPlan) -> StageCost:
        sl, diff_in, nondiff_in, diff_out, nondiff_out, _ = io
        in_spec_of = {
            v: plan.tensors[plan.inputs[k]].spec for k, v in enumerate((*diff_in, *nondiff_in))
        }
        out_spec_of = {v: plan.output_specs[k] for k, v in enumerate((*diff_out, *nondiff_out))}
        # Paid once per step, after the last micro-batch: 1/B of it per micro-batch.
        sync = (
            0.0
            if job.tie
            else gradient_sync_seconds(plan, job.cost, diff_in, job.params, job.first_grad)
            / self.method.num_micro_batches
        )
        return StageCost(
            latency=plan.predicted_time + sync + self._launches(job.cost, job.graph),
            peak_memory=plan.peak_memory,
            residual_bytes=job.residual_bytes,
            state_bytes=job.state,
            plan=plan,
            in_specs=tuple(in_spec_of.get(v) for v in sl.invars),
            out_specs=tuple(out_spec_of.get(v) for v in sl.outvars),
            held_bytes=plan_held_bytes(plan, job.residual_bytes, not self.every_micro_batch),
        )

    def _partitions(self, graph, opt, logical, diff_in, params: list[int], first_grad: int):
        """DeepSpeed's ZeRO-2: the output filters pinning each parameter's gradient to its
        optimiser state's layout (its partition), and the bytes per device those partitions
        hold all step."""
        if opt.layout not in ("zero2", "zero3"):
            raise ConfigError(
                f"layout: {opt.layout!r} has no ZeRO partitions for gradients reduced every "
                "micro-batch (grad_pricing.reduced_every_micro_batch); use 'zero2' or 'zero3'"
            )
        filters: list[Any] = [None] * len(graph.outputs)
        for k in params:
            shape = tuple(diff_in[k].aval.shape)
            filters[first_grad + k] = opt.input_filter("state", shape, logical)
        return filters, sum(_nbytes(diff_in[k].aval) for k in params) / math.prod(logical)


def plan_held_bytes(plan: ShardingPlan, residual_bytes: float, accumulators: bool = True) -> float:
    """Bytes per device a layer planned as ``plan`` holds while the other layers of its
    stage run: its parameters in the layouts its ILP chose, their gradients as the runtime
    keeps them (``shard.accumulators``: unreduced over the data-parallel axes, so a ZeRO
    layout's a whole copy per group, even with one micro-batch; not with ``accumulators``
    False, where ZeRO-2's partitions are counted with the optimiser state instead) and its
    residuals (worked out once per plan; every composed table reads it)."""
    params = sum(
        math.prod(t.shape)
        * np.dtype(t.dtype).itemsize
        / (t.spec.num_shards(plan.mesh_shape) if t.spec is not None else 1)
        for t in plan.tensors
        if t.role == "param"
    )
    return params + (held_accumulators(plan) if accumulators else 0.0) + residual_bytes


@dataclass(frozen=True)
class _StageJob:
    """What the ILPs of one stage on one (submesh, logical mesh, layout) share."""

    key: Any  # the slice's structural key
    submesh: tuple[int, int]
    logical: tuple[int, ...]
    graph: Any
    cost: CostModel
    opt: Any  # the ShardParallel whose layout/backend/time limit the ILPs use
    roles: list[str]
    filters: list[Any] | None
    params: list[int]  # input indices of parameters
    first_grad: int  # output index of the first parameter's gradient
    tie: bool  # gradient_sync="ilp": gradients tied to their parameters' layouts
    aliases: list[tuple[int, int]]
    handed: list[int]  # input indices of values handed on between layers, not from the host
    memory: float | None  # the ILP's budget: the stage's minus optimiser state
    state: float  # held all step: optimiser state (and ZeRO-2's gradient partitions)
    grad_filters: list[Any] | None  # output filters: ZeRO-2's gradient partitions, or none
    residual_bytes: float
    layer: bool = False  # one of the layers a stage is composed from


def _pinned_to(spec: ShardingSpec, also: Any, s: ShardingSpec) -> bool:
    """The input filter of a pinned layout (and of the preset's own filter, if any)."""
    return s == spec and (also is None or also(s))


def _pins(opt: Any, graph: Any, roles: list[str], logical: tuple[int, ...]) -> list[Any]:
    """The input filters a preset method pins on the stage's graph."""
    return [
        opt.input_filter(role, graph.tensors[t].shape, logical)
        for role, t in zip(roles, graph.inputs, strict=True)
    ]


#: Primitives XLA fuses into a neighbouring kernel (elementwise, layout-only): they add no
#: kernel of their own to a program's per-kernel overhead.
_FUSED = ELEMENTWISE | {
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
    "iota",
    "slice",
    "transpose",
}


def _kernels(graph) -> float:
    """Kernels a stage program runs, roughly: its operations that XLA does not fuse away."""
    return sum(n.multiplier for n in graph.nodes if n.kind == "op" and n.primitive not in _FUSED)


def _nbytes(aval: Any) -> float:
    return float(math.prod(aval.shape) * aval.dtype.itemsize)


def _budget(method: PipeshardParallel, cluster: ClusterSpec) -> float:
    """Bytes per device a stage may use (``PipeshardParallel.memory_budget``, the one place
    it is set; None: the device's memory)."""
    return method.memory_budget or cluster.device.memory_bytes


def _ilp_inputs(io: tuple[Any, ...]) -> list[tuple[Any, bool]]:
    """``_StageModel.ilp_inputs`` of a slice's ``_io`` record."""
    _, diff_in, nondiff_in, diff_out, _, _ = io
    return [(v, False) for v in (*diff_in, *nondiff_in)] + [(v, True) for v in diff_out]


def _with_launches(model, sc: StageCost, sub: tuple[int, int], logical) -> StageCost:
    """``sc`` with the start cost of its two programs per micro-batch (forward, backward):
    once per stage, so it is added to whole stages and compositions, never to the per-layer
    costs a composition sums."""
    extra = stage_launches(model, sub, logical)
    return sc if extra == 0 else dataclasses.replace(sc, latency=sc.latency + extra)


def stage_launches(model, sub: tuple[int, int], logical) -> float:
    """Seconds a stage on (``sub``, ``logical``) spends starting its forward and backward
    programs, per micro-batch (``_with_launches``)."""
    return model.cost_model(sub, logical).program_overhead(0.0, launches=2)
