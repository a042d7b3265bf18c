"""PipeshardParallel on Ray: the driver plans, every host worker compiles its own stages and
runs its share of the instruction stream; buffers cross hosts worker-to-worker.

The driver traces and plans from abstract shapes (no devices needed). Each ``HostWorker``
gets a ``WorkerBuilder``: it re-traces the step, lowers the plan onto its own devices and
keeps the part of the stream that runs there (``split_stream``). A ``Put`` whose source
lives on another host becomes ``Send`` there and ``Recv`` + ``Put`` here. One ``run_step``
call per worker per step carries the step inputs that worker reads; each returns the step
outputs it holds.

Outputs stay on the worker that computed them (``RemoteArray`` handles that fetch lazily);
fed back into the next step they are used in place, so parameters and optimiser state do
not travel. Not yet (issue 5 continues): stage meshes spanning hosts (``jax.distributed``).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from .cluster import ClusterSpec, ConfigError
from .executable import dynamic_leaves
from .pipeshard_executable import StepFun
from .pipeshard_method import AutoStageOption, PipeshardParallel
from .pipeshard_plan import PipeshardPlan
from .ray_setup import RaySession, WorkerFailedError
from .runtime.instructions import Accumulate, Free, Instruction, Put, Recv, Run, Send
from .runtime.ray_worker import Resident

__all__ = [
    "RayPipeshardExecutable",
    "RemoteArray",
    "WorkerBuilder",
    "compile_pipeshard_ray",
    "split_stream",
]

#: Seconds one step may take before the driver reports the workers that did not answer.
STEP_TIMEOUT = 300.0


def stage_hosts(plan: PipeshardPlan, devices_per_host: int) -> list[int]:
    """The host of every stage; a stage whose devices span hosts is refused (for now)."""
    hosts = []
    for s, st in enumerate(plan.stages):
        on = sorted({d // devices_per_host for d in st.devices})
        if len(on) != 1:
            raise ConfigError(
                f"stage {s}: devices {list(st.devices)} span hosts {on}; stage meshes across "
                "hosts need a jax.distributed group, which the Ray runtime does not form yet "
                "(use submeshes of at most one host, e.g. AutoStageOption on this cluster "
                "with a smaller memory need, or ManualStageOption)"
            )
        hosts.append(on[0])
    return hosts


def split_stream(
    stream: Sequence[Instruction], stage_host: Sequence[int], arg_names: Sequence[str]
) -> tuple[dict[int, list[Instruction]], dict[int, set[str]], dict[str, int]]:
    """Each host's part of ``stream`` in the same global order, with ``Send``/``Recv`` where
    a ``Put`` crosses hosts; the step inputs each host reads; where every buffer ends up.

    Order is what makes it deadlock-free: a ``Recv`` waits only for a ``Send`` that comes
    earlier in the global stream, and sends never block.
    """
    args = set(arg_names)
    streams: dict[int, list[Instruction]] = {h: [] for h in sorted(set(stage_host))}
    needs: dict[int, set[str]] = {h: set() for h in streams}
    where: dict[str, int] = {}
    for ins in stream:
        h = stage_host[ins.mesh]
        if isinstance(ins, Put):
            src = where.get(ins.src)
            if ins.src in args and src is None:
                needs[h].add(ins.src)
            elif src is not None and src != h:
                tag = f"{ins.src}->{ins.dst}"
                streams[src].append(Send(ins.src, h, tag, ins.mesh))
                streams[h].append(Recv(tag, src, ins.src, ins.mesh))
                streams[h].append(ins)
                streams[h].append(Free((ins.src,), ins.mesh))  # the received copy
                where[ins.dst] = h
                continue
            streams[h].append(ins)
            where[ins.dst] = h
        elif isinstance(ins, Run):
            needs[h].update(n for n in ins.inputs if n in args and n not in where)
            streams[h].append(ins)
            where.update((o, h) for o in ins.outputs)
        elif isinstance(ins, Accumulate):
            streams[h].append(ins)
            where[ins.dst] = h
        else:
            streams[h].append(ins)
    return streams, needs, where


@dataclass(frozen=True)
class WorkerBuilder:
    """Runs on a host worker: trace, lower the plan onto that worker's devices, keep its part
    of the stream. Every worker derives the same programs and names from the same plan."""

    step_fun: StepFun
    avals: tuple[Any, ...]
    plan_json: str
    stage_host: tuple[int, ...]
    devices_per_host: int

    def __call__(self, host: int, devices: Sequence[Any]) -> tuple[Any, ...]:
        from .pipeshard_compile import compile_pipeline
        from .pipeshard_executable import _add, _trace, stage_lowerings
        from .schedules import make_schedule

        plan = PipeshardPlan.from_json(self.plan_json)
        B = plan.num_micro_batches
        step, _, capture, forward = _trace(self.step_fun, list(self.avals), B)
        placed = []
        for s, st in enumerate(plan.stages):
            if self.stage_host[s] == host:
                placed.append(tuple(devices[d % self.devices_per_host] for d in st.devices))
            else:  # never run here; any devices of the right count keep the lowering uniform
                placed.append(tuple(devices[: len(st.devices)]))
        schedule = make_schedule(plan.schedule, plan.num_stages, B)
        compiled = compile_pipeline(step, capture, forward, stage_lowerings(plan, placed), schedule)
        streams, needs, where = split_stream(compiled.stream, self.stage_host, compiled.arg_names)
        holds = sorted(n for n in compiled.out_names if n is not None and where.get(n) == host)
        meta = {"out_names": compiled.out_names, "out_literals": compiled.out_literals}
        return (
            compiled.programs,
            compiled.layouts,
            _add,
            streams.get(host, []),
            sorted(needs.get(host, ())),
            holds,
            meta,
        )


@dataclass(eq=False)
class RayPipeshardExecutable:
    """A pipelined step whose stages run on Ray host workers."""

    fun_name: str
    plan: PipeshardPlan
    session: RaySession
    keys: list[int]  # the executable's index on each worker
    needs: list[list[str]]
    out_names: list[str | None]
    out_literals: dict[int, Any]
    in_tree: Any
    out_tree: Any
    static_argnums: tuple[int, ...]
    planning_time: float
    last_dispatch_seconds: float = 0.0  # the driver's part of the last step: issuing calls
    _steps: Any = field(default_factory=itertools.count)

    def __call__(self, *args: Any) -> Any:
        import ray

        flat = dynamic_leaves(args, self.static_argnums, self.in_tree, self.fun_name)
        step = next(self._steps)
        workers = self.session.workers
        t0 = time.perf_counter()
        garbage, self.session.garbage[:] = list(self.session.garbage), []
        refs = [
            w.run_step.remote(
                key,
                step,
                {n: self._input(flat[int(n[3:])], host) for n in need},
                [k for h, k in garbage if h == host],
            )
            for host, (w, key, need) in enumerate(zip(workers, self.keys, self.needs, strict=True))
        ]
        self.last_dispatch_seconds = time.perf_counter() - t0
        held: dict[str, Any] = {}
        host_of = {ref: host for host, ref in enumerate(refs)}
        pending, deadline = list(refs), time.monotonic() + STEP_TIMEOUT
        while pending:
            # Whichever worker finishes (or dies) first: a dead worker fails at once, while
            # its peers would only time out waiting for what it never sends.
            done, pending = ray.wait(pending, timeout=max(deadline - time.monotonic(), 0))
            if not done:
                host = host_of[pending[0]]
                reason = f"step {step} did not finish within {STEP_TIMEOUT:.0f} s"
                raise WorkerFailedError(host, self.session.worker_info[host], reason)
            for ref in done:
                host = host_of[ref]
                try:
                    for name, (rkey, shape, dtype) in ray.get(ref).items():
                        held[name] = RemoteArray(self.session, host, rkey, shape, dtype)
                except ray.exceptions.RayActorError as err:
                    info = self.session.worker_info[host]
                    raise WorkerFailedError(host, info, f"during step {step}: {err}") from None
                except ray.exceptions.RayTaskError as err:
                    self.session.check_workers(timeout=5.0)  # a dead peer is the real cause
                    raise RuntimeError(f"host {host} failed in step {step}: {err}") from None
        outs = []
        for o, name in enumerate(self.out_names):
            if name is None:
                outs.append(self.out_literals[o])
            elif name in held:
                outs.append(held[name])
            else:  # an input handed back unchanged
                outs.append(flat[int(name[3:])])
        return jax.tree.unflatten(self.out_tree, outs)

    def _input(self, leaf: Any, host: int) -> Any:
        """What a worker gets for a step input: a reference to its own resident copy when
        ``leaf`` is one, else the array (through the object store)."""
        if isinstance(leaf, RemoteArray) and leaf.session is self.session and leaf.host == host:
            return Resident(leaf.key)
        return np.asarray(leaf)


class RemoteArray:
    """A step output that stays on the host worker that computed it. ``np.asarray(x)``
    fetches it (once); passed back into a step on the same worker it is used in place, so
    parameters and optimiser state stay on their workers between steps."""

    def __init__(self, session: RaySession, host: int, key: str, shape, dtype) -> None:
        self.session, self.host, self.key = session, host, key
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self._value: np.ndarray | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def block_until_ready(self) -> RemoteArray:
        return self  # it exists once its step has finished on the worker

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self._value is None:
            import ray

            if not self.session.workers:
                raise RuntimeError(
                    f"this value lived on Ray host worker {self.host}, which alpa_mini."
                    "shutdown() removed; fetch outputs (np.asarray) before shutting down"
                )
            self._value = ray.get(self.session.workers[self.host].fetch.remote(self.key))
        return self._value if dtype is None else self._value.astype(dtype)

    def __float__(self) -> float:
        return float(np.asarray(self))

    def __repr__(self) -> str:
        return f"RemoteArray(host={self.host}, shape={self.shape}, dtype={self.dtype})"

    def __del__(self) -> None:
        # Queue the worker's copy for release with the next step's call (one remote call
        # per step, not one per dropped handle). No module globals: may run at exit.
        self.session.garbage.append((self.host, self.key))


def compile_pipeshard_ray(
    fun: Callable[..., Any],
    avals: list[Any],
    roles: list[str],
    in_tree: Any,
    static: tuple[tuple[int, Any], ...],
    method: PipeshardParallel,
    cluster: ClusterSpec,
    session: RaySession,
) -> RayPipeshardExecutable:
    """Plan on the driver (or replay ``method.plan``), then build on every host worker."""
    import ray

    from .pipeshard_executable import _plan, _trace

    t0 = time.perf_counter()
    step_fun = StepFun(fun, static, in_tree)
    B = method.num_micro_batches
    _, out_shape, capture, forward = _trace(step_fun, avals, B)
    if method.plan is None and isinstance(method.stage_option, AutoStageOption):
        # Stage meshes cannot span host workers yet: search submeshes inside one host.
        option = dataclasses.replace(method.stage_option, submesh_space="one_host")
        method = dataclasses.replace(method, stage_option=option)
    plan = method.plan or _plan(forward, capture, avals, roles, method, cluster, t0, None)
    hosts = stage_hosts(plan, cluster.devices_per_host)
    builder = WorkerBuilder(
        step_fun, tuple(avals), plan.to_json(), tuple(hosts), cluster.devices_per_host
    )
    built = ray.get([w.build.remote(builder) for w in session.workers])
    meta = built[0]["meta"]
    return RayPipeshardExecutable(
        fun_name=getattr(fun, "__name__", "step"),
        plan=plan,
        session=session,
        keys=[b["key"] for b in built],
        needs=[b["needs"] for b in built],
        out_names=list(meta["out_names"]),
        out_literals=dict(meta["out_literals"]),
        in_tree=in_tree,
        out_tree=jax.tree.structure(out_shape),
        static_argnums=tuple(i for i, _ in static),
        planning_time=time.perf_counter() - t0,
    )
