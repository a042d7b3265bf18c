"""``@parallelize``: trace a step, plan it with the ILP, lower it, run it; one executable per
argument signature.

    @alpa_mini.parallelize(method=alpa_mini.ShardParallel())
    def train_step(params, opt_state, batch): ...

``train_step.get_executable(*args)`` returns the ``Executable`` (plan, HLO, collectives).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from .errors import ConfigError, MemoryBudgetError
from .graph.tracing import trace_jaxpr
from .options.pipeshard import PipeshardParallel
from .options.shard import ShardParallel
from .session import local as device_setup
from .shard.cost_model import CostModel
from .shard.executable import Executable
from .shard.lower import build_sharded_function
from .shard.problem import plan_sharding

__all__ = ["ParallelizedFunction", "parallelize"]

AXIS_NAMES = ("x", "y", "z")


def parallelize(
    fun: Callable[..., Any] | None = None,
    *,
    method: ShardParallel | None = None,
    batch_argnums: Sequence[int] | None = None,
    donate_argnums: Sequence[int] | str = (),
    static_argnums: Sequence[int] = (),
) -> Any:
    """Decorate a JAX step function so it runs auto-sharded on the current cluster.

    ``batch_argnums`` (default: the last positional argument) name the batch; the first
    argument holds the parameters. ``donate_argnums`` donates buffers like ``jax.jit``
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
        dynamic, static = self._split_static(args)
        flat, in_tree = jax.tree.flatten(dynamic)
        paths = [
            jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(dynamic)[0]
        ]
        avals = [_abstract(x, name) for x, name in zip(flat, paths, strict=True)]
        key = (in_tree, tuple((a.shape, a.dtype) for a in avals), static, cluster.name)
        if key not in self._cache:
            self._cache[key] = self._compile(
                args, dynamic, static, flat, in_tree, paths, avals, cluster
            )
        return self._cache[key]

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
        n = len(dynamic)
        batch = (n - 1,) if self.batch_argnums is None else self.batch_argnums
        for i in batch:
            if not -n <= i < n:
                raise ValueError(f"batch_argnums: {i} is out of range for {n} array arguments")
        batch = tuple(i % n for i in batch)
        roles, owner = [], []
        for i, arg in enumerate(dynamic):
            role = "batch" if i in batch else "param" if i == 0 else "state"
            for _ in jax.tree.leaves(arg):
                roles.append(role)
                owner.append(i)
        return roles, owner

    def _compile(self, args, dynamic, static, flat, in_tree, paths, avals, cluster) -> Executable:
        t0 = time.perf_counter()
        method = self.method
        roles, owner = self._roles(dynamic)
        session = device_setup.ray_session()
        if isinstance(method, PipeshardParallel) and session is not None:
            from .pipeline.ray_driver import compile_pipeshard_ray

            return compile_pipeshard_ray(
                self.fun, avals, roles, in_tree, static, method, cluster, session
            )
        if isinstance(method, PipeshardParallel):
            from .pipeline.executable import StepFun, compile_pipeshard

            step_fun = StepFun(self.fun, static, in_tree)
            return compile_pipeshard(
                self.fun, step_fun, avals, roles, in_tree, static, method, cluster, method.plan
            )

        def flat_fun(*leaves: Any) -> list[Any]:
            from .graph.micro_batch import micro_batches

            with micro_batches(method.num_micro_batches):
                out = self._call_with(static, jax.tree.unflatten(in_tree, leaves))
            return out

        try:
            closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*avals)
        except TypeError as err:
            if "is not a valid JAX type" in str(err):
                raise TypeError(
                    f"{self.fun.__name__} returned a value that is not an array or a pytree of "
                    f"arrays ({err}); parallelized functions must return arrays"
                ) from None
            raise
        _out_leaves, out_tree = jax.tree.flatten(out_shape)
        trace_time = time.perf_counter() - t0
        graph = trace_jaxpr(closed, roles, paths)

        donated = self._donated(dynamic, owner, roles)
        aliases = _aliases(dynamic, out_shape, roles, owner)
        devices = jax.devices()[: cluster.num_devices]
        num = len(devices)
        plans, errors = [], []
        for shape in method.mesh_shapes(num, cluster.devices_per_host):
            logical = cluster.logical_mesh(shape, _submesh(cluster, num))
            cost = CostModel(cluster, logical)
            names = AXIS_NAMES[: len(shape)]
            filters = [
                method.input_filter(role, graph.tensors[t].shape, shape)
                for role, t in zip(roles, graph.inputs, strict=True)
            ]
            out_filters = [_replicated_only if method.replicate_outputs else None] * len(
                graph.outputs
            )
            budget = method.memory_budget or cluster.device.memory_bytes
            try:
                plan = plan_sharding(
                    graph,
                    cost,
                    names,
                    input_filters=filters,
                    output_filters=out_filters,
                    aliases=aliases,
                    donated=donated,
                    memory_budget=budget,
                    backend=method.backend,
                    time_limit=method.time_limit,
                )
            except MemoryBudgetError as err:
                errors.append((shape, err))
                continue
            except ValueError as err:
                if method.mesh_shape is not None or method.layout != "auto":
                    raise ConfigError(str(err)) from None
                errors.append((shape, err))
                continue
            plans.append(plan)
        if not plans:
            shape, err = min(errors, key=lambda e: getattr(e[1], "min_budget", None) or math.inf)
            if isinstance(err, MemoryBudgetError):
                raise MemoryBudgetError(
                    f"{err} (tried mesh shapes {[s for s, _ in errors]})", err.min_budget
                ) from None
            raise err
        best = min(plans, key=lambda p: p.predicted_time)
        searched = tuple((p.mesh_shape, p.predicted_time) for p in plans) + tuple(
            (s, None) for s, _ in errors
        )
        if len(searched) > 1:
            best = dataclasses.replace(best, mesh_search=searched)
        mesh = Mesh(np.array(devices).reshape(best.mesh_shape), best.axis_names)
        fn = build_sharded_function(closed, graph, best, mesh, donate_argnums=donated)
        return Executable(
            fun_name=getattr(self.fun, "__name__", "step"),
            plan=best,
            graph=graph,
            mesh=mesh,
            jitted=fn,
            in_tree=in_tree,
            out_tree=out_tree,
            static_argnums=tuple(i for i, _ in static),
            avals=tuple(avals),
            planning_time=time.perf_counter() - t0,
            trace_time=trace_time,
            donated=tuple(donated),
        )

    def _donated(self, dynamic, owner: list[int], roles: list[str]) -> list[int]:
        if self.donate_argnums == "auto":
            return [k for k, r in enumerate(roles) if r != "batch"]
        n = len(dynamic)
        for i in self.donate_argnums:
            if not -n <= i < n:
                raise ValueError(f"donate_argnums: {i} is out of range for {n} array arguments")
        chosen = {i % n for i in self.donate_argnums}
        return [k for k, o in enumerate(owner) if o in chosen]


def _replicated_only(spec) -> bool:
    return not spec.used_axes


def _submesh(cluster, num: int) -> tuple[int, int]:
    if num >= cluster.devices_per_host:
        return (num // cluster.devices_per_host, cluster.devices_per_host)
    return (1, num)


def _abstract(x: Any, name: str) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if _is_remote(x):  # a Ray step's output: shape known, data on a worker
        return jax.ShapeDtypeStruct(x.shape, jax.dtypes.canonicalize_dtype(x.dtype))
    if isinstance(x, jax.Array | np.ndarray | np.generic | bool | int | float | complex):
        arr = x if hasattr(x, "dtype") else np.asarray(x)
        dtype = jax.dtypes.canonicalize_dtype(arr.dtype)
        return jax.ShapeDtypeStruct(np.shape(arr), dtype)
    raise TypeError(
        f"argument {name or '(top level)'}: {type(x).__name__} is not an array; parallelized "
        "functions take arrays and Python/NumPy numbers (mark other arguments static_argnums)"
    )


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
