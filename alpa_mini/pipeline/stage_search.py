"""Inter-operator planning: layers, the stage cost table, the stage DP, device placement.

For each candidate stage (layer range, submesh, logical mesh) the per-stage ILP plans the
stage's forward + backward for one micro-batch; its predicted time is the stage latency and
its peak memory plus the residuals of the micro-batches held in flight decide how many later
stages it can tolerate under 1F1B (``max_succ``). Identical layers (same structural hash) are
solved once. ``solvers.stage_dp`` then picks the slicing.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr

from ..cluster.spec import ClusterSpec
from ..errors import ConfigError, MemoryBudgetError
from ..graph.grad_capture import GradCapture
from ..graph.tracing import trace_jaxpr
from ..options.pipeshard import (
    AutoLayerOption,
    AutoStageOption,
    ManualStageOption,
    PipeshardParallel,
    UniformStageOption,
)
from ..shard.cost_model import CostModel
from ..shard.plan import ShardingPlan
from ..shard.problem import plan_sharding
from ..shard.spec import ShardingSpec
from ..shard.strategies import ELEMENTWISE
from ..solvers.errors import InfeasibleError
from ..solvers.stages import StageProblem, StageSolution, solve_stages, submesh_shapes
from .layers import (
    cluster_layer_starts,
    eval_eqns,
    layer_hash,
    marker_layer_starts,
)
from .stage_slice import is_float, slice_stage

__all__ = ["StageCost", "StageDecision", "assign_devices", "layer_starts", "plan_pipeline"]

AXIS_NAMES = ("x", "y", "z")


@dataclass(frozen=True)
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

    def memory(self, in_flight: int) -> float:
        return self.peak_memory + self.state_bytes + max(in_flight - 1, 0) * self.residual_bytes


@dataclass(frozen=True)
class StageDecision:
    """One stage of the chosen plan."""

    layer_start: int
    layer_end: int  # inclusive
    eqn_start: int
    eqn_end: int
    submesh: tuple[int, int]
    devices: tuple[int, ...]
    logical_shape: tuple[int, ...]
    cost: StageCost


@dataclass
class PlanningCounters:
    """What planning cost so far: ILPs really solved, stage costs needed (the DP table's cells
    for auto stages, one per stage otherwise), lookups the structural-hash cache answered,
    and seconds building op graphs, in ILPs (summed over threads) and in the stage DP."""

    ilps_solved: int = 0
    cost_entries: int = 0
    cache_hits: int = 0
    graph_seconds: float = 0.0
    ilp_seconds: float = 0.0
    dp_seconds: float = 0.0


def layer_starts(forward: ClosedJaxpr, option: Any) -> tuple[int, ...]:
    """Equation index where each layer starts."""
    if isinstance(option, AutoLayerOption):
        return cluster_layer_starts(forward.jaxpr, option.layer_num, option.eps)
    return marker_layer_starts(forward.jaxpr)


def logical_shapes(submesh: tuple[int, int], mode: str) -> list[tuple[int, ...]]:
    """Logical meshes tried on a submesh: 1-D over all devices, then ("auto") one 2-D mesh
    or ("model_parallel_in_host") every (n / k, k) with 1 < k < n and k dividing a host's
    devices, so the second axis stays inside a host."""
    h, d = submesh
    n = h * d
    shapes: list[tuple[int, ...]] = [(n,)]
    if mode == "auto" and n >= 4:
        shapes.append((h, d) if h > 1 else (2, n // 2))
    elif mode == "model_parallel_in_host":
        shapes += [(n // k, k) for k in range(2, d + 1) if d % k == 0 and k < n]
    return shapes


class StageConfig(NamedTuple):
    """One column of the stage DP's table on a submesh: a logical mesh, and "auto" (the ILP
    picks every layout) or a preset whose input layouts are pinned ("zero3": parameters and
    optimiser state fully sharded, the memory-lean choice)."""

    shape: tuple[int, ...]
    layout: str = "auto"


def stage_configs(submesh: tuple[int, int], option: AutoStageOption) -> list[StageConfig]:
    """The logical meshes of ``option.logical_shapes`` with free layouts, then, with
    ``option.memory_lean``, the 1-D mesh with ZeRO-3's layouts: composed from per-layer ILPs
    that each chose layouts for speed alone, a stage can need far more memory than one whose
    layers all keep their weights sharded."""
    out = [StageConfig(shape) for shape in logical_shapes(submesh, option.logical_shapes)]
    if option.memory_lean and submesh[0] * submesh[1] > 1:
        out.append(StageConfig((submesh[0] * submesh[1],), "zero3"))
    return out


def _config_names(configs: Sequence[Sequence[StageConfig]]) -> tuple[str, ...]:
    """Names of the DP's config columns (column ci is the ci-th config of every submesh)."""
    C = max(len(c) for c in configs)
    names = []
    for ci in range(C):
        kinds = {
            ("1d" if len(c[ci].shape) == 1 else "2d")
            + ("" if c[ci].layout == "auto" else "-" + c[ci].layout)
            for c in configs
            if ci < len(c)
        }
        names.append("/".join(sorted(kinds)))
    return tuple(names)


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
        self._cost_models: dict[Any, CostModel] = {}
        self._fresh: set[Any] = set()
        self._sites: dict[Any, tuple[int, int]] | None = None
        # Preset (pinned-layout) ILPs by (structure, submesh, logical mesh, layout, batch
        # axis): the memory-lean ZeRO-3 column and the free MIP's ZeRO-3 fallback are the same
        # ILP, and prefetch threads may ask for it at once; it is solved once.
        self._presets: dict[Any, Future] = {}
        self._lock = threading.Lock()
        self.stats = PlanningCounters()

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
        kinds = tuple(
            "const" if v in self.consts else (v in diff, self._role(v)) for v in sl.invars
        )
        key = (
            layer_hash(sl.eqns, sl.invars, sl.outvars),
            kinds,
            tuple(v in diff for v in sl.outvars),
        )
        out = self._slices[(start, end)] = (sl, diff_in, nondiff_in, diff_out, nondiff_out, key)
        return out

    def result_sites(self) -> dict[Any, tuple[int, int]]:
        """Each forward variable's (equation, result index)."""
        if self._sites is None:
            self._sites = {
                v: (e, o)
                for e, eqn in enumerate(self.forward.jaxpr.eqns)
                for o, v in enumerate(eqn.outvars)
            }
        return self._sites

    def _role(self, v: Any) -> str:
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

        HiGHS releases the GIL while it solves, so one thread's LP overlaps another's Python
        model building: about 1.7x on two cores. The op graphs are traced first, here, since
        JAX tracing is left to the calling thread.
        """
        todo: dict[Any, tuple[Any, tuple[int, int], tuple[int, ...], str]] = {}
        for start, end, submesh, (logical, layout) in requests:
            io = self._io(start, end)
            key = (*io[5], submesh, logical, layout)
            if key not in self.cache:
                self._graph(io)
                todo.setdefault(key, (io, submesh, logical, layout))
        workers = min(len(todo), _cpu_count())
        if workers <= 1:
            return
        # Largest first (more mesh axes, more nodes), so that no big ILP starts last.
        keys = sorted(todo, key=lambda k: (-len(todo[k][2]), -len(todo[k][0][0].eqns)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(lambda k: self._solve(*todo[k]), keys))
        for key, result in zip(keys, results, strict=True):
            self.cache[key] = result
            self._fresh.add(key)

    def cost_model(self, submesh: tuple[int, int], logical: tuple[int, ...]) -> CostModel:
        """One cost model per mesh, so its resharding cache serves every layer planned there."""
        key = (submesh, logical)
        with self._lock:
            if key not in self._cost_models:
                mesh = self.cluster.logical_mesh(logical, submesh)
                self._cost_models[key] = CostModel(self.cluster, mesh)
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

        def f_of(nd: Sequence[Any]) -> Callable[..., Any]:
            def f(*dvals: Any) -> tuple[list[Any], list[Any]]:
                env: dict[Any, Any] = dict(consts)
                env.update(zip(diff_in, dvals, strict=True))
                env.update(zip(nondiff_in, nd, strict=True))
                eval_eqns(sl.eqns, env)
                return [env[v] for v in diff_out], [env[v] for v in nondiff_out]

            return f

        nd_n = len(diff_in)

        def train(*args: Any) -> list[Any]:
            d, nd, cts = (
                args[:nd_n],
                args[nd_n : nd_n + len(nondiff_in)],
                args[nd_n + len(nondiff_in) :],
            )
            outs_d, vjp_fn, outs_nd = jax.vjp(f_of(nd), *d, has_aux=True)
            grads = vjp_fn(list(cts))
            return [*outs_d, *outs_nd, *grads]

        def residuals(*args: Any) -> Any:
            d, nd = args[:nd_n], args[nd_n:]
            return jax.vjp(f_of(nd), *d, has_aux=True)[1]

        avals = [
            jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
            for v in (*diff_in, *nondiff_in, *diff_out)
        ]
        closed = jax.make_jaxpr(train)(*avals)
        roles = [self._role(v) for v in (*diff_in, *nondiff_in)]
        roles += ["batch"] * len(diff_out)
        names = [f"in{k}" for k in range(len(roles))]
        graph = trace_jaxpr(closed, roles, names)
        param_bytes = sum(
            _nbytes(v.aval)
            for v in diff_in
            if v in self.loss_in and self.capture.diff[self.loss_in[v]]
        )
        res_tree = jax.eval_shape(residuals, *avals[: nd_n + len(nondiff_in)])
        res_bytes = sum(_nbytes(x) for x in jax.tree.leaves(res_tree))
        out = self._graphs[io[5]] = (graph, res_bytes, param_bytes)
        with self._lock:
            self.stats.graph_seconds += time.perf_counter() - t0
        return out

    def _solve(
        self,
        io: tuple[Any, ...],
        submesh: tuple[int, int],
        logical: tuple[int, ...],
        layout: str = "auto",
    ) -> StageCost | None:
        sl, diff_in, nondiff_in, diff_out, nondiff_out, _ = io
        graph, res_total, param_bytes = self._graph(io)
        n_dev = submesh[0] * submesh[1]
        cost = self.cost_model(submesh, logical)
        opt = self.method.default_auto_sharding_option
        if layout != "auto":  # a memory-lean configuration pins a preset's layouts
            opt = dataclasses.replace(opt, layout=layout, batch_axis=None)
        budget = _budget(self.method, self.cluster)
        # Optimiser state is sharded over the stage's devices, except under plain data
        # parallelism, which keeps a whole copy on every device.
        state = self.state_ratio * param_bytes / (1 if opt.layout == "data" else n_dev)
        roles = [self._role(v) for v in (*diff_in, *nondiff_in)] + ["batch"] * len(diff_out)
        filters = None
        if opt.layout != "auto" or opt.batch_axis is not None:  # a preset pins input layouts
            filters = [
                opt.input_filter(role, graph.tensors[t].shape, logical)
                for role, t in zip(roles, graph.inputs, strict=True)
            ]
        # Input k of a parameter has its gradient at output first_grad + k. With
        # gradient_sync="ilp" the two are tied, so the ILP prices (and avoids) the all-reduce
        # or gather that brings the gradient into the parameter's layout.
        first_grad = len(diff_out) + len(nondiff_out)
        params = [k for k in range(len(diff_in)) if roles[k] == "param"]
        tie = self.method.gradient_sync == "ilp"
        aliases = [(k, first_grad + k) for k in params] if tie else []

        def solve(filters: list[Any] | None, preset: Any = None) -> ShardingPlan | str:
            """The plan, or why there is none: "memory" or "time". ``preset`` (the pinning
            method) names a restricted ILP, which is solved once per stage model."""
            if preset is None:
                return run(filters)
            key = (io[5], submesh, logical, preset.layout, preset.batch_axis)
            with self._lock:
                future = self._presets.get(key)
                mine = future is None
                if mine:
                    future = self._presets[key] = Future()
            if mine:
                try:
                    future.set_result(run(filters))
                except BaseException as err:  # ValueError: no such layout; waiters see it too
                    future.set_exception(err)
            return future.result()

        def run(filters: list[Any] | None) -> ShardingPlan | str:
            with self._lock:
                self.stats.ilps_solved += 1
            t0 = time.perf_counter()
            try:
                return plan_sharding(
                    graph,
                    cost,
                    AXIS_NAMES[: len(logical)],
                    input_filters=filters,
                    aliases=aliases,
                    memory_budget=None if math.isinf(budget) else max(budget - state, 1.0),
                    backend=opt.backend,
                    time_limit=opt.time_limit,
                )
            except MemoryBudgetError as err:
                return "time" if err.timed_out else "memory"
            finally:
                with self._lock:
                    self.stats.ilp_seconds += time.perf_counter() - t0

        try:
            plan = solve(filters, None if filters is None else opt)
        except ValueError:
            if layout == "auto":
                raise
            return None  # some input has no layout under this preset (e.g. batch 6 on 4)
        unproven = plan == "time" or (
            isinstance(plan, ShardingPlan) and plan.solver.get("status") != "optimal"
        )
        if filters is None and unproven:
            # The free MIP stopped unproven (or found nothing in time). Two restrictions of
            # the free space make far easier MIPs: ZeRO-3's layouts (parameters and state
            # fully sharded, the batch split), and Megatron's (the batch split on the mesh's
            # first axis, everything else free). Keep whichever plan is fastest.
            for pinned in (
                dataclasses.replace(opt, layout="zero3", batch_axis=None),
                dataclasses.replace(opt, layout="auto", batch_axis=0),
            ):
                pins = [
                    pinned.input_filter(role, graph.tensors[t].shape, logical)
                    for role, t in zip(roles, graph.inputs, strict=True)
                ]
                if all(p is None for p in pins):
                    continue  # nothing pinned (a mesh whose first axis is 1): the free MIP
                try:
                    other = solve(pins, pinned)
                except ValueError:  # some input has no such layout (e.g. batch 6 on 4)
                    continue
                if isinstance(other, ShardingPlan) and (
                    not isinstance(plan, ShardingPlan) or other.predicted_time < plan.predicted_time
                ):
                    plan = other
        if not isinstance(plan, ShardingPlan):
            return None  # this stage does not fit here; the DP sees an infinite cost
        in_spec_of = {
            v: plan.tensors[plan.inputs[k]].spec for k, v in enumerate((*diff_in, *nondiff_in))
        }
        out_spec_of = {v: plan.output_specs[k] for k, v in enumerate((*diff_out, *nondiff_out))}
        return StageCost(
            latency=plan.predicted_time
            + (0.0 if tie else _gradient_sync(plan, cost, diff_in, params, first_grad))
            + (cost.program_overhead(_kernels(graph), 0) if self.cluster.profile else 0.0),
            peak_memory=plan.peak_memory,
            residual_bytes=res_total / n_dev,
            state_bytes=state,
            plan=plan,
            in_specs=tuple(in_spec_of.get(v) for v in sl.invars),
            out_specs=tuple(out_spec_of.get(v) for v in sl.outvars),
        )


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


def _gradient_sync(plan, cost, diff_in, params: list[int], first_grad: int) -> float:
    """Seconds to bring each parameter's gradient into the parameter's layout, where the
    optimiser sums and applies it (an all-gather of a sharded gradient, a slice of a
    replicated one), priced after the solve (``gradient_sync="after"``: tying it inside the
    ILP made GPT-39B's planning 9.6 s -> 88 s)."""
    seconds = 0.0
    for k in params:
        grad, param = plan.output_specs[first_grad + k], plan.tensors[plan.inputs[k]].spec
        if grad is None or param is None or grad == param:
            continue
        aval = diff_in[k].aval
        seconds += cost.reshard(tuple(aval.shape), np.dtype(aval.dtype).itemsize, grad, param)
    return seconds


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1



def _nbytes(aval: Any) -> float:
    return float(math.prod(aval.shape) * np.dtype(aval.dtype).itemsize)


def _budget(method: PipeshardParallel, cluster: ClusterSpec) -> float:
    so = method.stage_option
    if isinstance(so, AutoStageOption) and so.memory_budget is not None:
        return so.memory_budget
    return method.default_auto_sharding_option.memory_budget or cluster.device.memory_bytes


def assign_devices(
    submeshes: Sequence[tuple[int, int]], cluster: ClusterSpec
) -> list[tuple[int, ...]]:
    """Flat device indices of each stage's submesh: whole hosts for (h, M) submeshes, a
    contiguous run inside one host otherwise; larger submeshes are placed first."""
    per = cluster.devices_per_host
    free = [per] * cluster.num_hosts  # free devices at the end of each host
    out: list[tuple[int, ...] | None] = [None] * len(submeshes)
    for s in sorted(range(len(submeshes)), key=lambda s: -submeshes[s][0] * submeshes[s][1]):
        h, d = submeshes[s]
        if h > 1 or d == per:
            hosts = [i for i in range(cluster.num_hosts) if free[i] == per][:h]
            if len(hosts) < h or d != per:
                raise ConfigError(
                    f"stage {s}: submesh {submeshes[s]} does not fit the cluster's free hosts"
                )
            out[s] = tuple(i * per + k for i in hosts for k in range(per))
            for i in hosts:
                free[i] = 0
        else:
            host = next((i for i in range(cluster.num_hosts) if free[i] >= d), None)
            if host is None:
                raise ConfigError(f"stage {s}: submesh {submeshes[s]} does not fit any host")
            first = host * per + (per - free[host])
            out[s] = tuple(range(first, first + d))
            free[host] -= d
    return [o for o in out if o is not None]


def plan_pipeline(
    forward: ClosedJaxpr,
    capture: GradCapture,
    cluster: ClusterSpec,
    method: PipeshardParallel,
    *,
    state_bytes_total: float,
    param_bytes_total: float,
    progress: Callable[[str], None] | None = None,
) -> tuple[
    list[StageDecision],
    tuple[int, ...],
    StageProblem | None,
    StageSolution | None,
    PlanningCounters,
]:
    """Layers, then stages (auto: cost table + DP; uniform; manual), each with its ILP plan."""
    starts = layer_starts(forward, method.layer_option)
    n_eqns = len(forward.jaxpr.eqns)
    ends = (*starts[1:], n_eqns)
    L = len(starts)
    model = _StageModel(forward, capture, cluster, method, state_bytes_total, param_bytes_total)
    so = method.stage_option
    B = method.num_micro_batches
    problem = solution = None
    composed: list[StageCost | None] | None = None
    if isinstance(so, AutoStageOption):
        shapes = submesh_shapes(cluster.num_hosts, cluster.devices_per_host)
        configs = [stage_configs(s, so) for s in shapes]
        C = max(len(c) for c in configs)
        budget = _budget(method, cluster)
        entries, tables = _cost_entries(model, starts, ends, shapes, configs, so, progress)
        names = _config_names(configs)
        problem = _stage_problem(entries, L, len(shapes), C, budget, cluster, B, names)
        try:
            t_dp = time.perf_counter()
            solution = solve_stages(problem)
            model.stats.dp_seconds = time.perf_counter() - t_dp
        except InfeasibleError as err:
            need = _least_pipeline_memory(
                forward,
                capture,
                cluster,
                method,
                state_bytes_total,
                param_bytes_total,
                starts,
                ends,
                shapes,
                configs,
                names,
            )
            raise MemoryBudgetError(
                f"memory_budget: no pipeline plan fits {budget / 2**20:.3f} MiB per device "
                f"({err}); the smallest per-device memory with a feasible plan is about "
                f"{need / 2**20:.3f} MiB",
                need,
            ) from None
        ranges = [(st.layer_start, st.layer_end) for st in solution.stages]
        subs = [st.submesh_shape for st in solution.stages]
        logicals = [configs[st.submesh_index][st.config_index].shape for st in solution.stages]
        devices = assign_devices(subs, cluster)
        if so.profiling == "individual":  # compose the chosen stages too: no new ILPs
            composed = [
                _composed_stage(
                    model,
                    tables[(st.submesh_index, st.config_index)],
                    starts,
                    ends,
                    st.layer_start,
                    st.layer_end,
                )
                for st in solution.stages
            ]
    elif isinstance(so, UniformStageOption):
        S = so.num_stages
        if S > L:
            raise ConfigError(
                f"UniformStageOption.num_stages: {S} stages but the step has only {L} layers"
            )
        bounds = [round(k * L / S) for k in range(S + 1)]
        ranges = [(bounds[k], bounds[k + 1] - 1) for k in range(S)]
        subs = [so.submesh_shape] * S
        logicals = [so.logical_shape or (so.submesh_shape[0] * so.submesh_shape[1],)] * S
        _check_devices(subs, cluster)
        devices = assign_devices(subs, cluster)
        if so.profiling == "individual":
            table = _layer_table(model, starts, ends, subs[0], logicals[0])
            composed = [_composed_stage(model, table, starts, ends, i, j) for i, j in ranges]
            budget = _budget(method, cluster)
            # A composed stage over the budget (held bytes plus its largest transient; see
            # _composed_row) has no plan here.
            composed = [c if c is None or c.peak_memory <= budget else None for c in composed]
    else:
        assert isinstance(so, ManualStageOption)
        ids = so.forward_stage_layer_ids
        if ids[-1][-1] != L - 1:
            raise ConfigError(
                f"ManualStageOption.forward_stage_layer_ids: covers layers 0..{ids[-1][-1]} but "
                f"the step has {L} layers"
            )
        ranges = [(s[0], s[-1]) for s in ids]
        subs = list(so.submesh_physical_shapes)
        logicals = list(so.submesh_logical_shapes or [(h * d,) for h, d in subs])
        if so.submesh_devices is not None:
            devices = list(so.submesh_devices)
        else:
            _check_devices(subs, cluster)
            devices = assign_devices(subs, cluster)
    refine = composed is not None and getattr(so, "refine", False)
    if refine:  # the whole-stage ILPs of every chosen stage, on the thread pool up front
        assert solution is not None and composed is not None
        to_refine = [
            _refine_configs(model, tables, starts, ends, st, configs, so.refine_within)
            for st in solution.stages
        ]
        model.prefetch(
            [
                (starts[i], ends[j], sub, cfg)
                for (i, j), sub, sc, cfgs in zip(ranges, subs, composed, to_refine, strict=True)
                if sc is not None
                for cfg in cfgs
            ]
        )
    decisions = []
    for s, ((i, j), sub, logical, devs) in enumerate(
        zip(ranges, subs, logicals, devices, strict=True)
    ):
        if composed is not None:
            sc = composed[s]
            # Composed (individual profiling); only auto stages have ``refine``.
            if refine and sc is not None:
                # Every config of the chosen submesh (logical mesh and layout; with
                # memory_lean the ZeRO-3 column too), solved whole: the composition ranks
                # them by an estimate, the whole ILP by the stage's own cost.
                for cfg in to_refine[s]:
                    whole = model.cost(starts[i], ends[j], sub, cfg.shape, cfg.layout)
                    if whole is not None and whole.latency < sc.latency:
                        sc, logical = whole, cfg.shape
        else:
            model.stats.cost_entries += not isinstance(so, AutoStageOption)
            sc = model.cost(starts[i], ends[j], sub, logical)
        if sc is None:
            raise MemoryBudgetError(
                f"memory_budget: stage of layers {i}..{j} on submesh {sub} does not fit "
                f"{_budget(method, cluster) / 2**20:.1f} MiB per device",
                None,
            )
        sc = _with_launches(model, sc, sub, logical)
        decisions.append(StageDecision(i, j, starts[i], ends[j], sub, devs, logical, sc))
    return decisions, starts, problem, solution, model.stats


def _with_launches(model, sc: StageCost, sub: tuple[int, int], logical) -> StageCost:
    """``sc`` with the start cost of its two programs per micro-batch (forward, backward):
    once per stage, so it is added to whole stages and compositions, never to the per-layer
    costs a composition sums."""
    extra = model.cost_model(sub, logical).program_overhead(0.0, launches=2)
    return sc if extra == 0 else dataclasses.replace(sc, latency=sc.latency + extra)


def _check_devices(subs: Sequence[tuple[int, int]], cluster: ClusterSpec) -> None:
    used = sum(h * d for h, d in subs)
    if used > cluster.num_devices:
        raise ConfigError(
            f"stage_option: the stages need {used} devices but cluster {cluster.name} has "
            f"{cluster.num_devices}"
        )


@dataclass
class _LayerTable:
    """Per-layer ILP results on one (submesh, logical mesh), and the resharding time between
    the layout a layer hands a value on in and the layout a later layer reads it in."""

    costs: list[StageCost | None]
    reshard_into: list[list[tuple[int, float]]]  # layer b -> [(producer layer a, seconds)]


def _layer_table(model, starts, ends, sub, logical, layout: str = "auto") -> _LayerTable:
    L = len(starts)
    costs = [model.cost(starts[k], ends[k], sub, logical, layout) for k in range(L)]
    cm = model.cost_model(sub, logical)
    producer: dict[Any, tuple[int, int]] = {}
    for a in range(L):
        for o, v in enumerate(model.slice(starts[a], ends[a]).outvars):
            producer[v] = (a, o)
    into: list[list[tuple[int, float]]] = [[] for _ in range(L)]
    for b in range(L):
        cb = costs[b]
        if cb is None:
            continue
        for k, v in enumerate(model.slice(starts[b], ends[b]).invars):
            a, o = producer.get(v, (None, 0))
            ca = None if a is None else costs[a]
            if ca is None or ca.out_specs[o] is None or cb.in_specs[k] is None:
                continue
            src, dst = ca.out_specs[o], cb.in_specs[k]
            shape, size = tuple(v.aval.shape), np.dtype(v.aval.dtype).itemsize
            t = cm.reshard(shape, size, src, dst)
            if is_float(v.aval):  # its cotangent travels back the other way
                t += cm.reshard(shape, size, dst, src)
            if t > 0:
                into[b].append((a, t))
    return _LayerTable(costs, into)


def _composed_row(table: _LayerTable, i: int) -> list[StageCost | None]:
    """Individual-mode costs of layers ``i..j`` for every ``j >= i``, by running sums:
    per-layer latencies plus the resharding between layers inside the range.

    Memory: while layer k runs inside the stage, every other layer j holds at most H_j (its
    parameters, their gradients and its residuals; ``_held_bytes``), and layer k itself at
    most its own peak. So the stage peaks at sum(H) + max_k(peak_k - H_k): the transients
    count once, not once per layer as a plain sum of per-layer peaks would."""
    out: list[StageCost | None] = []
    lat = held = res = state = 0.0
    transient = -math.inf
    for j in range(i, len(table.costs)):
        p = table.costs[j]
        if p is None:
            out.extend([None] * (len(table.costs) - j))
            break
        lat += p.latency + sum(t for a, t in table.reshard_into[j] if a >= i)
        h = _held_bytes(p)
        held, transient = held + h, max(transient, p.peak_memory - h)
        res, state = res + p.residual_bytes, state + p.state_bytes
        out.append(StageCost(lat, held + transient, res, state))
    return out


def _held_bytes(sc: StageCost) -> float:
    """Bytes per device one layer holds while the other layers of its stage run: its
    parameters and their gradients in the layouts its ILP chose, and its residuals. Without
    its plan, its whole peak (the plain sum, as before)."""
    plan = sc.plan
    if plan is None:
        return sc.peak_memory
    params = sum(
        math.prod(t.shape)
        * np.dtype(t.dtype).itemsize
        / (t.spec.num_shards(plan.mesh_shape) if t.spec is not None else 1)
        for t in plan.tensors
        if t.role == "param"
    )
    return 2 * params + sc.residual_bytes  # a gradient has its parameter's size


def _refine_configs(model, tables, starts, ends, stage, configs, within: float | None):
    """The configs of a chosen stage's submesh that ``refine`` re-plans whole: all of them,
    or (``within``) those whose composed estimate is within that fraction of the chosen
    config's, the chosen one first."""
    cfgs = configs[stage.submesh_index]
    if within is None:
        return list(cfgs)
    i, j = stage.layer_start, stage.layer_end

    def estimate(ci: int) -> float:
        table = tables.get((stage.submesh_index, ci))
        est = None if table is None else _composed_stage(model, table, starts, ends, i, j)
        return math.inf if est is None else est.latency

    limit = estimate(stage.config_index) * (1.0 + within)
    others = [c for ci, c in enumerate(cfgs) if ci != stage.config_index and estimate(ci) <= limit]
    return [cfgs[stage.config_index], *others]


def _composed_stage(model, table: _LayerTable, starts, ends, i: int, j: int) -> StageCost | None:
    """The composed cost of layers ``i..j`` plus the layouts at the stage's edges: each value
    the stage reads takes the layout of the first layer that reads it; each value it hands on,
    its producer's."""
    sc = _composed_row(table, i)[j - i]
    if sc is None:
        return None
    stage = model.slice(starts[i], ends[j])
    read_as: dict[Any, ShardingSpec | None] = {}
    made_as: dict[Any, ShardingSpec | None] = {}
    read_later: set[Any] = set()
    for k in range(i, j + 1):
        sl, layer = model.slice(starts[k], ends[k]), table.costs[k]
        for v, spec in zip(sl.invars, layer.in_specs, strict=True):
            read_as.setdefault(v, spec)
            if k > i:
                read_later.add(v)
        made_as.update(zip(sl.outvars, layer.out_specs, strict=True))
    # Values handed from one layer to a later one inside the stage keep their producer's
    # layout, as the composed cost assumed (the consumer's reshard is priced from it).
    site = model.result_sites()
    inner = tuple(
        sorted(
            (*site[v], spec)
            for v, spec in made_as.items()
            if spec is not None and v in read_later and v in site
        )
    )
    return dataclasses.replace(
        sc,
        in_specs=tuple(read_as.get(v) for v in stage.invars),
        out_specs=tuple(made_as.get(v) for v in stage.outvars),
        inner_specs=inner,
    )


def _allowed_submeshes(shapes, space: str) -> list[bool]:
    """Which submesh shapes the search uses: all, those with a power-of-two host count, or
    those inside one host."""
    if space == "one_host":
        return [h == 1 for h, _ in shapes]
    return [space == "all" or (h & (h - 1)) == 0 for h, _ in shapes]


def _cost_entries(model, starts, ends, shapes, configs, option, progress):
    """StageCost of every (first layer, last layer, submesh, config) that has a plan, and the
    per-layer tables individual mode composed them from."""
    L = len(starts)
    entries: dict[tuple[int, int, int, int], StageCost] = {}
    tables: dict[tuple[int, int], _LayerTable] = {}
    allowed = _allowed_submeshes(shapes, option.submesh_space)
    n_cfg = sum(len(configs[si]) for si in range(len(shapes)) if allowed[si])
    individual = option.profiling == "individual"
    total = L * n_cfg if individual else L * (L + 1) // 2 * n_cfg
    requests = [
        (starts[i], ends[j], sub, cfg)
        for si, sub in enumerate(shapes)
        if allowed[si]
        for cfg in configs[si]
        for i in range(L)
        for j in ([i] if individual else range(i, L))
    ]
    if progress:
        progress(f"stage costs: {len(requests)} (layer range, mesh) pairs")
    model.prefetch(requests)
    done = 0
    for si, sub in enumerate(shapes):
        if not allowed[si]:
            continue
        for ci, (logical, layout) in enumerate(configs[si]):
            if individual:
                table = tables[(si, ci)] = _layer_table(model, starts, ends, sub, logical, layout)
                done += L
                if progress:
                    progress(f"stage costs {done}/{total}")
                for i in range(L):
                    for j, sc in enumerate(_composed_row(table, i), start=i):
                        if sc is not None:
                            entries[(i, j, si, ci)] = _with_launches(model, sc, sub, logical)
                continue
            for i in range(L):
                for j in range(i, L):
                    sc = model.cost(starts[i], ends[j], sub, logical, layout)
                    done += 1
                    if progress:
                        progress(f"stage costs {done}/{total}")
                    if sc is not None:
                        entries[(i, j, si, ci)] = _with_launches(model, sc, sub, logical)
    model.stats.cost_entries += L * (L + 1) // 2 * n_cfg
    return entries, tables


def _stage_problem(entries, L, S, C, budget, cluster, B, names) -> StageProblem:
    """The DP's table: latency where the stage fits ``budget`` with one micro-batch in
    flight, and how many later stages' worth of in-flight micro-batches it can hold."""
    cost = np.full((L, L, S, C), np.inf)
    max_succ = np.zeros((L, L, S, C), dtype=np.int64)
    for (i, j, si, ci), sc in entries.items():
        if sc.memory(1) > budget:
            continue
        cost[i, j, si, ci] = sc.latency
        k = 1
        while k < L and sc.memory(k + 1) <= budget:
            k += 1
        max_succ[i, j, si, ci] = k - 1
    return StageProblem(cluster.num_hosts, cluster.devices_per_host, cost, max_succ, B, names)


def _least_pipeline_memory(
    forward,
    capture,
    cluster,
    method,
    state_total,
    param_total,
    starts,
    ends,
    shapes,
    configs,
    names,
) -> float:
    """Smallest budget at which the DP finds a slicing, from stage plans made without a budget
    (each such plan stays feasible at any budget above its memory, so this budget fits)."""
    free_option = dataclasses.replace(method.stage_option, memory_budget=math.inf)
    unlimited = dataclasses.replace(method, stage_option=free_option)
    free_model = _StageModel(forward, capture, cluster, unlimited, state_total, param_total)
    entries, _ = _cost_entries(free_model, starts, ends, shapes, configs, free_option, None)
    L, C = len(starts), max(len(c) for c in configs)
    candidates = sorted({sc.memory(k) for sc in entries.values() for k in range(1, L + 1)})

    def feasible(m: float) -> bool:
        prob = _stage_problem(
            entries, L, len(shapes), C, m, cluster, method.num_micro_batches, names
        )
        try:
            solve_stages(prob)
        except InfeasibleError:
            return False
        return True

    lo, hi = 0, len(candidates) - 1
    if not candidates or not feasible(candidates[hi]):
        return math.inf
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]
