"""``@parallelize``: trace a step, plan it with the ILP, lower it, run it; one executable per
argument signature. ``plan``: the plan alone, from concrete or abstract arguments.

    @alpa_mini.parallelize(method=alpa_mini.ShardParallel())
    def train_step(params, opt_state, batch): ...

``train_step.get_executable(*args)`` returns the ``Executable`` (plan, HLO, collectives);
``alpa_mini.plan(train_step_fn, *abstract_args, method=..., cluster="dgx-a100")`` plans for
any cluster without devices.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh

from .cluster.spec import ClusterSpec
from .errors import ConfigError
from .graph.grad_capture import trace_with_grads
from .graph.jaxpr_walk import without_dead_code
from .graph.planning_stats import PlanningStats
from .graph.tracing import is_prng_key, trace_jaxpr
from .options.pipeshard import PipeshardParallel
from .options.shard import ShardParallel
from .session import local as device_setup
from .shard.executable import Executable
from .shard.lower import build_sharded_function
from .shard.plan import MeshTrial, ShardingPlan
from .shard.search import other_structure, plan_shard, resized_plan

if TYPE_CHECKING:
    from .pipeline.plan import PipeshardPlan

__all__ = ["ParallelizedFunction", "parallelize", "plan"]


def parallelize(
    fun: Callable[..., Any] | None = None,
    *,
    method: ShardParallel | None = None,
    batch_argnums: Sequence[int] | None = None,
    donate_argnums: Sequence[int] | str = (),
    static_argnums: Sequence[int] = (),
) -> Any:
    """Decorate a JAX step function so it runs auto-sharded on the current cluster.

    ``batch_argnums`` (default: the last positional argument that is not only PRNG keys)
    name the batch; the first argument holds the parameters. PRNG keys are never split: every
    micro-batch reads the whole key. ``donate_argnums`` donates buffers like ``jax.jit``
    (``"auto"``: every non-batch argument). Arguments must be arrays or Python/NumPy numbers,
    except ``static_argnums``.
    """

    def wrap(f: Callable[..., Any]) -> ParallelizedFunction:
        return ParallelizedFunction(
            f,
            method or ShardParallel(),
            None if batch_argnums is None else tuple(batch_argnums),
            donate_argnums if isinstance(donate_argnums, str) else tuple(donate_argnums),
            tuple(static_argnums),
        )

    if isinstance(method, type):
        raise TypeError(
            f"method: got the class {method.__name__}; pass an instance, e.g. {method.__name__}()"
        )
    if method is not None and not isinstance(method, ShardParallel | PipeshardParallel):
        raise TypeError(
            f"method: {method!r} is not a parallel method; use ShardParallel(), DataParallel(), "
            "Zero2Parallel() or Zero3Parallel()"
        )
    if isinstance(donate_argnums, str) and donate_argnums != "auto":
        raise ValueError(f"donate_argnums: {donate_argnums!r} is not 'auto' or a tuple of ints")
    return wrap if fun is None else wrap(fun)


def plan(
    fun: Callable[..., Any],
    *args: Any,
    method: ShardParallel | PipeshardParallel | None = None,
    cluster: ClusterSpec | str | os.PathLike[str] | None = None,
    batch_argnums: Sequence[int] | None = None,
    donate_argnums: Sequence[int] | str = (),
    static_argnums: Sequence[int] = (),
    progress: Callable[[str], None] | None = None,
) -> ShardingPlan | PipeshardPlan:
    """Plan ``fun(*args)`` without compiling or allocating: a ``ShardingPlan`` for
    ShardParallel methods, a ``PipeshardPlan`` for ``PipeshardParallel``.

    ``args`` may be arrays or ``jax.ShapeDtypeStruct`` pytrees. ``cluster``: a
    ``ClusterSpec``, a bundled cluster name or a cluster YAML path; None plans for the
    cluster of ``alpa_mini.init``. Planning needs no devices, so any cluster can be planned.
    The other arguments mean what they mean for ``parallelize``; ``progress`` receives a line
    per planning step (per mesh tried, for ShardParallel). For ``PipeshardParallel``, a step
    whose grad call reads only its own inputs is traced as far as that call: the plan reads
    its loss, and what the step does after the call (its optimiser update) is traced and
    checked when the plan is compiled (``parallelize(..., method=PipeshardParallel(plan=p))``).
    """
    step = parallelize(
        fun,
        method=method,
        batch_argnums=batch_argnums,
        donate_argnums=donate_argnums,
        static_argnums=static_argnums,
    )
    return step.get_plan(*args, cluster=cluster, progress=progress)


@dataclass(frozen=True)
class _Call:
    """One call's arguments: dynamic ones (flattened, abstract) and static ones by position."""

    dynamic: tuple[Any, ...]
    static: tuple[tuple[int, Any], ...]
    in_tree: Any
    paths: list[str]
    avals: list[jax.ShapeDtypeStruct]
    roles: list[str]  # per leaf: param, state or batch
    owner: list[int]  # per leaf: its argument's index among the dynamic ones


@dataclass(frozen=True)
class _Traced:
    """A ShardParallel step traced: its jaxpr, output structure and ``OpGraph``."""

    closed: Any
    out_shape: Any
    out_tree: Any
    graph: Any
    trace_seconds: float
    graph_seconds: float


class ParallelizedFunction:
    """The decorated step: call it like the original function."""

    def __init__(
        self,
        fun: Callable[..., Any],
        method: ShardParallel,
        batch_argnums: tuple[int, ...] | None,
        donate_argnums: tuple[int, ...] | str,
        static_argnums: tuple[int, ...],
    ) -> None:
        self.fun = fun
        self.method = method
        self.batch_argnums = batch_argnums
        self.donate_argnums = donate_argnums
        self.static_argnums = static_argnums
        self._cache: dict[Any, Executable] = {}
        self._warned_replan = False
        functools.update_wrapper(self, fun)

    def __call__(self, *args: Any) -> Any:
        return self.get_executable(*args)(*args)

    # ------------------------------------------------------------------ planning
    def get_executable(self, *args: Any) -> Executable:
        """Plan (or fetch the cached plan) for arguments shaped like ``args``."""
        cluster = device_setup.current_cluster()
        session = device_setup.ray_session()
        if session is not None and not isinstance(self.method, PipeshardParallel):
            name = getattr(self.fun, "__name__", "step")
            raise RuntimeError(
                f"{name}: on init(cluster='ray') the workers run PipeshardParallel steps; "
                f"{type(self.method).__name__} runs locally: use "
                "PipeshardParallel(stage_option=UniformStageOption(1, ...)) for one sharded "
                "stage, or alpa_mini.init(cluster='local', num_cpu_devices=...)"
            )
        call = self._prepare(args)
        key = (call.in_tree, tuple((a.shape, a.dtype) for a in call.avals), call.static)
        key += (cluster.name,)
        if key not in self._cache:
            self._cache[key] = self._resized(call, key, cluster) or self._compile(call, cluster)
        return self._cache[key]

    def input_layouts(self, *args: Any) -> Any:
        """The layouts the plan for arguments like ``args`` reads each array argument in, as
        ``jax.ShapeDtypeStruct``s shaped like the array arguments (static ones left out): a
        ``restore_checkpoint`` target that puts values where the step reads them. On Ray the
        leaves are ``RemoteSlot``s: the workers whose stages read a value read it."""
        ex = self.get_executable(*args)
        call = self._prepare(args)
        if hasattr(ex, "remote_slots"):  # on Ray: read on the workers, in their layouts
            return jax.tree.unflatten(call.in_tree, ex.remote_slots(call.avals))
        if isinstance(ex, Executable):
            shardings: list[Any] = list(ex.input_shardings)
        else:
            shardings = ex.input_layouts(call.avals)
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        leaves = [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh or default, weak_type=a.weak_type)
            for a, sh in zip(call.avals, shardings, strict=True)
        ]
        return jax.tree.unflatten(call.in_tree, leaves)

    # ------------------------------------------------------------ batch-size changes
    def _resized(self, call: _Call, key: tuple, cluster: ClusterSpec) -> Executable | None:
        """A cached plan reused for a new batch size: same step and cluster, only the batch
        leaves' leading dimension changed, and the plan's layouts still divide the new shapes.
        Otherwise None (the caller plans again; a warning says why, once)."""
        similar = (
            ex for k, ex in self._cache.items() if _only_batch_rows_differ(k, key, call.roles)
        )
        earlier = next(similar, None)
        if earlier is None:
            return None
        if isinstance(earlier, Executable):
            t0 = time.perf_counter()
            traced = self._trace(call)
            reason, plan = resized_plan(earlier.plan, traced.graph)
            if plan is not None:
                donated = self._donated(call.dynamic, call.owner, call.roles)
                fn = build_sharded_function(
                    traced.closed, traced.graph, plan, earlier.mesh, donate_argnums=donated
                )
                return dataclasses.replace(
                    earlier,
                    plan=plan,
                    graph=traced.graph,
                    jitted=fn,
                    out_tree=traced.out_tree,
                    avals=tuple(call.avals),
                    planning_time=time.perf_counter() - t0,
                    trace_time=traced.trace_seconds,
                    donated=tuple(donated),
                    _compiled=None,
                )
        else:
            reason = _pipeshard_rows_reason(earlier.plan, call)
            if reason is None:
                method = dataclasses.replace(self.method, plan=earlier.plan)
                return self._compile(call, cluster, method)
        if not self._warned_replan:
            self._warned_replan = True
            warnings.warn(
                f"{getattr(self.fun, '__name__', 'step')}: planning again for the new batch "
                f"size: {reason}",
                stacklevel=4,
            )
        return None

    def get_plan(
        self,
        *args: Any,
        cluster: ClusterSpec | str | os.PathLike[str] | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> ShardingPlan | PipeshardPlan:
        """Plan for arguments shaped like ``args`` (arrays or ``jax.ShapeDtypeStruct``s) on
        ``cluster`` without compiling; see ``alpa_mini.plan``."""
        t0 = time.perf_counter()
        spec = _resolve_cluster(cluster)
        call = self._prepare(args)
        if isinstance(self.method, PipeshardParallel):
            from .pipeline.executable import StepFun, plan_pipeshard

            step_fun = StepFun(self.fun, call.static, call.in_tree)
            return plan_pipeshard(step_fun, call.avals, call.roles, self.method, spec, progress)
        return self._plan_shard(call, self._trace(call), spec, t0, progress)

    def _prepare(self, args: tuple[Any, ...]) -> _Call:
        """One call's arguments: static ones split off, the rest flattened and made abstract,
        each leaf's role (param/state/batch) and owning argument."""
        dynamic, static = self._split_static(args)
        flat, in_tree = jax.tree.flatten(dynamic)
        paths = [
            jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(dynamic)[0]
        ]
        avals = [_abstract(x, name) for x, name in zip(flat, paths, strict=True)]
        roles, owner = self._roles(dynamic)
        return _Call(dynamic, static, in_tree, paths, avals, roles, owner)

    def _split_static(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        for i in self.static_argnums:
            if not -len(args) <= i < len(args):
                raise ValueError(f"static_argnums: {i} is out of range for {len(args)} arguments")
        static_idx = {i % len(args) for i in self.static_argnums}
        dynamic = tuple(a for i, a in enumerate(args) if i not in static_idx)
        static = tuple((i, args[i]) for i in sorted(static_idx))
        try:
            hash(static)
        except TypeError:
            raise TypeError("static_argnums: static arguments must be hashable") from None
        return dynamic, static

    def _call_with(self, static: tuple[tuple[int, Any], ...], dynamic: Sequence[Any]) -> Any:
        args: list[Any] = list(dynamic)
        for i, value in static:
            args.insert(i, value)
        return self.fun(*args)

    def _roles(self, dynamic: tuple[Any, ...]) -> tuple[list[str], list[int]]:
        """Each leaf's role (param, state or batch) and its argument's index. PRNG keys are
        never batch leaves: every micro-batch and every device reads the whole key, as they
        read the parameters; and by default the batch is the last argument that is not only
        keys (``step(state, batch, key)``)."""
        n = len(dynamic)
        batch = (_default_batch(dynamic),) if self.batch_argnums is None else self.batch_argnums
        for i in batch:
            if not -n <= i < n:
                raise ValueError(f"batch_argnums: {i} is out of range for {n} array arguments")
        batch = tuple(i % n for i in batch)
        roles, owner = [], []
        for i, arg in enumerate(dynamic):
            role = "batch" if i in batch else "param" if i == 0 else "state"
            for leaf in jax.tree.leaves(arg):
                roles.append("state" if role == "batch" and is_prng_key(leaf) else role)
                owner.append(i)
        return roles, owner

    def _compile(self, call: _Call, cluster: ClusterSpec, method: Any = None) -> Executable:
        t0 = time.perf_counter()
        method = self.method if method is None else method
        session = device_setup.ray_session()
        if isinstance(method, PipeshardParallel) and session is not None:
            from .pipeline.ray_driver import compile_pipeshard_ray

            return compile_pipeshard_ray(
                self.fun, call.avals, call.roles, call.in_tree, call.static, method, cluster,
                session, self._donated(call.dynamic, call.owner, call.roles),
            )  # fmt: skip
        if isinstance(method, PipeshardParallel):
            from .pipeline.executable import StepFun, compile_pipeshard

            step_fun = StepFun(self.fun, call.static, call.in_tree)
            return compile_pipeshard(
                self.fun, step_fun, call.avals, call.roles, call.in_tree, call.static, method,
                cluster, self._donated(call.dynamic, call.owner, call.roles),
            )  # fmt: skip
        traced = self._trace(call)
        plan = self._plan_shard(call, traced, cluster, t0)
        devices = jax.devices()[: cluster.num_devices]
        mesh = Mesh(np.array(devices).reshape(plan.mesh_shape), plan.axis_names)
        donated = self._donated(call.dynamic, call.owner, call.roles)
        fn = build_sharded_function(traced.closed, traced.graph, plan, mesh, donate_argnums=donated)
        return Executable(
            fun_name=getattr(self.fun, "__name__", "step"),
            plan=plan,
            graph=traced.graph,
            mesh=mesh,
            jitted=fn,
            in_tree=call.in_tree,
            out_tree=traced.out_tree,
            static_argnums=tuple(i for i, _ in call.static),
            avals=tuple(call.avals),
            planning_time=time.perf_counter() - t0,
            trace_time=traced.trace_seconds,
            donated=tuple(donated),
        )

    def _trace(self, call: _Call) -> _Traced:
        """The step's jaxpr (micro-batched as the method asks) and its ``OpGraph``."""
        t0 = time.perf_counter()
        method = self.method

        def flat_fun(*leaves: Any) -> list[Any]:
            return self._call_with(call.static, jax.tree.unflatten(call.in_tree, leaves))

        try:
            if method.num_micro_batches > 1:
                B = method.num_micro_batches
                traced = trace_with_grads(
                    flat_fun, call.avals, call.roles, B, "accumulate", call.paths
                )
                closed, out_shape = traced.closed, traced.out_shape
            else:  # plain jax.value_and_grad: nothing to split
                closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*call.avals)
        except TypeError as err:
            if "is not a valid JAX type" in str(err):
                raise TypeError(
                    f"{self.fun.__name__} returned a value that is not an array or a pytree of "
                    f"arrays ({err}); parallelized functions must return arrays"
                ) from None
            raise
        t1 = time.perf_counter()
        closed, graph = self._without_dead_code(closed, call)
        out_tree = jax.tree.structure(out_shape)
        return _Traced(closed, out_shape, out_tree, graph, t1 - t0, time.perf_counter() - t1)

    def _without_dead_code(self, closed: Any, call: _Call) -> tuple[Any, Any]:
        """The step's jaxpr less the code no output reads, which XLA drops too (a
        value_and_grad step of a 2-block GPT: 28 of 1094 equations), and its ``OpGraph``.
        A saved plan made before such code was dropped is replayed on the whole jaxpr."""
        lean = without_dead_code(closed)
        graph = trace_jaxpr(lean, call.roles, call.paths)
        saved = getattr(self.method, "plan", None)
        if isinstance(saved, ShardingPlan) and other_structure(saved, graph) is not None:
            whole = trace_jaxpr(closed, call.roles, call.paths)
            if other_structure(saved, whole) is None:
                return closed, whole
        return lean, graph

    def _plan_shard(
        self,
        call: _Call,
        traced: _Traced,
        cluster: ClusterSpec,
        t0: float,
        progress: Callable[[str], None] | None = None,
    ) -> ShardingPlan:
        """The mesh search's plan, with where planning spent its time."""
        t1 = time.perf_counter()

        def tell(trial: MeshTrial) -> None:
            if progress is not None:
                progress(f"mesh {trial.label()} ({trial.outcome}, {trial.seconds:.1f} s)")

        plan = plan_shard(
            traced.graph,
            cluster,
            self.method,
            call.roles,
            aliases=_aliases(call.dynamic, traced.out_shape, call.roles, call.owner),
            donated=self._donated(call.dynamic, call.owner, call.roles),
            on_trial=tell,
        )
        now = time.perf_counter()
        stats = PlanningStats(
            trace_seconds=traced.trace_seconds,
            graph_seconds=traced.graph_seconds,
            ilp_seconds=now - t1,
            total_seconds=now - t0,
            ilps_solved=len(plan.mesh_search),
        )
        return dataclasses.replace(plan, planning=stats)

    def _donated(self, dynamic, owner: list[int], roles: list[str]) -> list[int]:
        if self.donate_argnums == "auto":
            return [k for k, r in enumerate(roles) if r != "batch"]
        n = len(dynamic)
        for i in self.donate_argnums:
            if not -n <= i < n:
                raise ValueError(f"donate_argnums: {i} is out of range for {n} array arguments")
        chosen = {i % n for i in self.donate_argnums}
        return [k for k, o in enumerate(owner) if o in chosen]


def _only_batch_rows_differ(old: tuple, new: tuple, roles: Sequence[str]) -> bool:
    """Whether two cache keys differ only in the leading dimension of batch leaves."""
    (tree_a, avals_a, static_a, cluster_a), (tree_b, avals_b, static_b, cluster_b) = old, new
    if (tree_a, static_a, cluster_a) != (tree_b, static_b, cluster_b) or avals_a == avals_b:
        return False
    for (sa, da), (sb, db), role in zip(avals_a, avals_b, roles, strict=True):
        if da != db or len(sa) != len(sb) or sa[1:] != sb[1:]:
            return False
        if sa != sb and role != "batch":
            return False
    return True


def _pipeshard_rows_reason(plan: PipeshardPlan, call: _Call) -> str | None:
    """Why a pipeshard plan cannot take the new batch (None when it can): each micro-batch's
    rows must still divide over every stage's devices."""
    rows = {
        a.shape[0] for a, r in zip(call.avals, call.roles, strict=True) if r == "batch" and a.shape
    }
    B = plan.num_micro_batches
    for n in sorted(rows):
        if n % B:
            return f"{B} micro-batches do not divide a batch of {n} rows"
        for k, stage in enumerate(plan.stages):
            devices = math.prod(stage.logical_shape)
            if (n // B) % devices:
                return (
                    f"a micro-batch of {n // B} rows does not divide over stage {k}'s "
                    f"{devices} devices"
                )
    return None


def _resolve_cluster(cluster: ClusterSpec | str | os.PathLike[str] | None) -> ClusterSpec:
    """The cluster ``plan`` plans for: given, or the one ``alpa_mini.init`` set up."""
    if isinstance(cluster, ClusterSpec):
        return cluster
    if cluster is None:
        if not device_setup.is_initialized():
            raise ConfigError(
                "cluster: None plans for the cluster of alpa_mini.init(), which was not "
                "called; pass a ClusterSpec, a bundled cluster name or a cluster YAML path"
            )
        return device_setup.current_cluster()
    if isinstance(cluster, str | os.PathLike):
        return ClusterSpec.load(cluster)
    raise ConfigError(
        f"cluster: {cluster!r} is not a ClusterSpec, a bundled cluster name or a YAML path"
    )


def _abstract(x: Any, name: str) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if _is_remote(x):  # a Ray step's output: shape known, data on a worker
        return jax.ShapeDtypeStruct(x.shape, jax.dtypes.canonicalize_dtype(x.dtype, True))
    if isinstance(x, jax.Array | np.ndarray | np.generic | bool | int | float | complex):
        arr = x if hasattr(x, "dtype") else np.asarray(x)
        dtype = jax.dtypes.canonicalize_dtype(arr.dtype, allow_extended_dtype=True)
        # Weak types survive (a Python number, flax's TrainState.step): the step's outputs
        # keep them, so the next call sees the same types and is not retraced.
        weak = getattr(x, "weak_type", False) or type(x) in (int, float, complex)
        return jax.ShapeDtypeStruct(np.shape(arr), dtype, weak_type=bool(weak))
    raise TypeError(
        f"argument {name or '(top level)'}: {type(x).__name__} is not an array; parallelized "
        "functions take arrays and Python/NumPy numbers (mark other arguments static_argnums)"
    )


def _default_batch(dynamic: tuple[Any, ...]) -> int:
    """The last argument with a leaf that is not a PRNG key (the last one where none has)."""
    for i in range(len(dynamic) - 1, 0, -1):
        leaves = jax.tree.leaves(dynamic[i])
        if leaves and not all(is_prng_key(x) for x in leaves):
            return i
    return len(dynamic) - 1


def _is_remote(x: Any) -> bool:
    """Whether ``x`` is a ``ray_exec.RemoteArray`` (imported only once Ray is in use)."""
    module = sys.modules.get("alpa_mini.pipeline.ray_driver")
    return module is not None and isinstance(x, module.RemoteArray)


def _aliases(dynamic, out_shape, roles: list[str], owner: list[int]) -> list[tuple[int, int]]:
    """(input leaf, output leaf) pairs of state returned in the same structure as it came in.

    An output element whose structure, shapes and dtypes equal a non-batch argument's is
    taken to be that argument's updated value (``params, opt_state = step(params, ...)``).
    """
    outs = out_shape if isinstance(out_shape, tuple | list) else (out_shape,)
    first_leaf = {}
    k = 0
    for i, arg in enumerate(dynamic):
        first_leaf[i] = k
        k += len(jax.tree.leaves(arg))
    used: set[int] = set()
    pairs: list[tuple[int, int]] = []
    out_offset = 0
    for element in outs:
        leaves, tree = jax.tree.flatten(element)
        for i, arg in enumerate(dynamic):
            if i in used or not jax.tree.leaves(arg) or roles[first_leaf[i]] == "batch":
                continue
            in_leaves, in_tree = jax.tree.flatten(arg)
            if in_tree != tree or any(
                (x := _abstract(a, "")).shape != b.shape or x.dtype != b.dtype
                for a, b in zip(in_leaves, leaves, strict=True)
            ):
                continue
            used.add(i)
            pairs += [(first_leaf[i] + j, out_offset + j) for j in range(len(leaves))]
            break
        out_offset += len(leaves)
    return pairs
