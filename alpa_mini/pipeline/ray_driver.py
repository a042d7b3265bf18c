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
not travel. With ``init(cluster="ray", span_hosts=True)`` the workers form one
``jax.distributed`` group and a stage mesh may span hosts: each of its hosts runs the
stage's instructions (the same programs, in the same order, as one SPMD computation), and a
buffer sharded over it is gathered whole on those hosts before it moves to another mesh.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from ..cluster.spec import ClusterSpec
from ..errors import ConfigError, WorkerFailedError
from ..graph.scan_split import PieceMap
from ..graph.tracing import is_prng_key
from ..inspect.program_collectives import StepCollectives, step_collectives
from ..options.pipeshard import AutoStageOption, PipeshardParallel
from ..runtime.instructions import Free, Instruction, Put, Recv, Run, Send
from ..runtime.local import InstructionTiming, LocalRuntime
from ..runtime.ray_worker import Resident
from ..session.ray import RaySession
from ..shard.executable import dynamic_leaves
from .executable import (
    StepFun,
    add_buffers,
    apply_scan_splits,
    leaf_paths,
    prepare_step,
    split_leaf_indices,
    stage_lowerings,
    trace_step,
)
from .plan import PipeshardPlan
from .ray_keys import KeysAsData, data_aval, data_to_keys, key_impls, keys_to_data

__all__ = [
    "HostStreams",
    "RayPipeshardExecutable",
    "RemoteArray",
    "RemoteSlot",
    "StackedRemoteArray",
    "WorkerBuilder",
    "compile_pipeshard_ray",
    "split_stream",
    "stage_hosts",
]

#: Seconds one step may take before the driver reports the workers that did not answer,
#: and between the driver's pings of the workers while it waits (a stopped worker is
#: reported within this plus the ping's 5 s).
STEP_TIMEOUT = 300.0
STEP_POLL = 10.0


def stage_hosts(
    plan: PipeshardPlan, devices_per_host: int, span_hosts: bool
) -> list[tuple[int, ...]]:
    """The hosts of every stage's mesh; one spanning hosts needs the workers' group."""
    hosts = []
    for s, st in enumerate(plan.stages):
        on = tuple(sorted({d // devices_per_host for d in st.devices}))
        if len(on) > 1 and not span_hosts:
            raise ConfigError(
                f"stage {s}: devices {list(st.devices)} span hosts {list(on)}; a stage mesh "
                "across hosts needs the host workers in one jax.distributed group: "
                "alpa_mini.init(cluster='ray', span_hosts=True, ...)"
            )
        hosts.append(on)
    return hosts


@dataclass(frozen=True)
class HostStreams:
    """An instruction stream split over host workers (see ``split_stream``)."""

    streams: dict[int, list[Instruction]]  # each host's instructions, in global order
    needs: dict[int, set[str]]  # the step inputs each host reads
    where: dict[str, tuple[int, ...]]  # the hosts holding each buffer (several: sharded)
    mesh_of: dict[str, int]  # the mesh each buffer was last laid out on
    arg_meshes: dict[str, set[int]]  # the meshes each step input is put on


def split_stream(
    stream: Sequence[Instruction],
    stage_hosts: Sequence[tuple[int, ...]],
    arg_names: Sequence[str],
) -> HostStreams:
    """Each host's part of ``stream``: every instruction goes to all hosts of its mesh;
    a ``Put`` from another host becomes ``Send`` there and ``Recv`` + ``Put`` here; where
    either mesh spans hosts, the shards travel instead, each to the hosts that need it.

    Order is what makes it deadlock-free: every host keeps the global order, so a ``Recv``
    waits only for a ``Send``, and a collective only for peers' instructions, that come
    earlier; sends never block.
    """
    args = set(arg_names)
    streams: dict[int, list[Instruction]] = {
        h: [] for h in sorted({h for hs in stage_hosts for h in hs})
    }
    needs: dict[int, set[str]] = {h: set() for h in streams}
    where: dict[str, tuple[int, ...]] = {}
    mesh_of: dict[str, int] = {}
    arg_meshes: dict[str, set[int]] = {}

    def emit(hosts: Sequence[int], ins: Instruction) -> None:
        for h in hosts:
            streams[h].append(ins)

    for ins in stream:
        hs = stage_hosts[ins.mesh]
        if isinstance(ins, Put):
            src = ins.src
            if src in args and src not in where:
                for h in hs:
                    needs[h].add(src)
                arg_meshes.setdefault(src, set()).add(ins.mesh)
                emit(hs, ins)
            elif src not in where:
                raise ValueError(f"stream: Put reads {src!r} before any instruction writes it")
            elif mesh_of[src] == ins.mesh or (len(hs) == 1 and where[src] == hs):
                emit(hs, ins)  # the same mesh, or one host to itself
            else:
                _transfer(ins, where[src], mesh_of[src], hs, streams)
        elif isinstance(ins, Run):
            for h in hs:
                needs[h].update(n for n in ins.inputs if n in args and n not in where)
            emit(hs, ins)
        else:
            emit(hs, ins)
        for name in LocalRuntime.written(ins):
            where[name], mesh_of[name] = hs, ins.mesh
    return HostStreams(streams, needs, where, mesh_of, arg_meshes)


def _transfer(
    put: Put,
    holders: tuple[int, ...],
    src_mesh: int,
    hosts: tuple[int, ...],
    streams: dict[int, list[Instruction]],
) -> None:
    """``put`` across meshes of different hosts. From one host to one other: a whole copy,
    which the receiver's ``Put`` lays out. Where either mesh spans hosts: every holder sends
    each receiving host the shards it holds that the host's devices need under the
    destination layout (a holder to itself too), and the receiver assembles them."""
    if len(holders) == 1 and len(hosts) == 1:
        (frm,), (h,) = holders, hosts
        copy, tag = put.src, f"{put.src}->{put.dst}"
        streams[frm].append(Send(copy, h, tag, src_mesh))
        streams[h].append(Recv(tag, frm, copy, put.mesh))
        streams[h].append(Put(copy, put.dst, put.mesh, put.layout))
        streams[h].append(Free((copy,), put.mesh))
        return
    # Every send before any receive: the receivers' Put is one collective over their mesh,
    # which a host must not enter while a peer still waits for its pieces.
    copy = f"{put.src}@pieces"
    for h in hosts:
        for frm in holders:
            streams[frm].append(
                Send(put.src, h, f"{put.src}->{put.dst}#{frm}", src_mesh, put.layout)
            )
    for h in hosts:
        for frm in holders:
            streams[h].append(Recv(f"{put.src}->{put.dst}#{frm}", frm, copy, put.mesh))
        streams[h].append(Put(copy, put.dst, put.mesh, put.layout))
        streams[h].append(Free((copy,), put.mesh))


@dataclass(frozen=True)
class WorkerBuilder:
    """Runs on a host worker: trace, lower the plan onto that worker's devices, keep its part
    of the stream. Every worker derives the same programs and names from the same plan."""

    step_fun: StepFun
    avals: tuple[Any, ...]
    plan_json: str
    stage_host: tuple[tuple[int, ...], ...]
    devices_per_host: int
    donated: tuple[int, ...] = ()  # argument leaves the step may consume
    shard_state: bool = False  # optimiser state in ZeRO layouts (PipeshardParallel)
    fuse: bool = True  # PipeshardParallel.fuse_programs
    roles: tuple[str, ...] = ()  # each argument leaf's role (batch leaves are split)

    def __call__(
        self, host: int, devices: Sequence[Any], group_devices: Sequence[Any] = ()
    ) -> tuple[Any, ...]:
        """``devices``: this host's; ``group_devices``: every host's, host-major, when the
        workers form one ``jax.distributed`` group (plan device ``d`` is then the d-th)."""
        from .lower.compile import compile_pipeline
        from .schedules import make_schedule

        plan = PipeshardPlan.from_json(self.plan_json)
        B = plan.num_micro_batches
        step, _, capture, forward = trace_step(self.step_fun, list(self.avals), self.roles, B)
        step, capture, forward, _ = apply_scan_splits(
            step, capture, forward, plan.scan_splits, self.roles, plan.row_splits
        )
        placed = []
        for s, st in enumerate(plan.stages):
            if group_devices:
                placed.append(tuple(group_devices[d] for d in st.devices))
            elif host in self.stage_host[s]:
                placed.append(tuple(devices[d % self.devices_per_host] for d in st.devices))
            else:  # never run here; any devices of the right count keep the lowering uniform
                placed.append(tuple(devices[: len(st.devices)]))
        schedule = make_schedule(plan.schedule, plan.num_stages, B)
        lowering = stage_lowerings(plan, placed)
        compiled = compile_pipeline(
            step,
            capture,
            forward,
            lowering,
            schedule,
            self.donated,
            self.shard_state,
            self.fuse,
        )
        split = split_stream(compiled.stream, self.stage_host, compiled.arg_names)
        holds = sorted(
            n for n in compiled.out_names if n is not None and host in split.where.get(n, ())
        )
        spread = {  # outputs sharded over several hosts: the devices of their mesh
            n: tuple(sorted(plan.stages[split.mesh_of[n]].devices))
            for n in compiled.out_names
            if n is not None and len(split.where.get(n, ())) > 1
        }
        meta = {
            "out_names": compiled.out_names,
            "out_literals": compiled.out_literals,
            "out_devices": spread,
            "arg_devices": {  # the device sets (plan devices) each step input is put on
                n: {tuple(sorted(plan.stages[m].devices)) for m in meshes}
                for n, meshes in split.arg_meshes.items()
            },
        }
        return (
            compiled.programs,
            compiled.layouts,
            add_buffers,
            split.streams.get(host, []),
            sorted(split.needs.get(host, ())),
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
    out_devices: dict[str, tuple[int, ...]]  # plan devices of outputs sharded over hosts
    arg_devices: dict[str, set[tuple[int, ...]]]  # plan devices each step input is put on
    stage_host: tuple[tuple[int, ...], ...]  # the hosts of every stage's mesh
    in_tree: Any
    out_tree: Any
    static_argnums: tuple[int, ...]
    planning_time: float
    last_dispatch_seconds: float = 0.0  # the driver's part of the last step: issuing calls
    #: The user's flat leaves <-> the step's when scanned stacks are split into row pieces.
    pieces: PieceMap | None = None
    #: PRNG key argument leaves and outputs (flat index -> implementation): they travel as
    #: their key data (``ray_keys``).
    key_inputs: dict[int, str] = field(default_factory=dict)
    key_outputs: dict[int, str] = field(default_factory=dict)
    _program_table: dict[str, tuple[int, int]] | None = field(default=None, repr=False)
    _out_paths: list[str] | None = field(default=None, repr=False)  # outputs' key paths

    def __call__(self, *args: Any) -> Any:
        return self._run(args, timed=False)

    def profile(self, *args: Any) -> tuple[Any, list[InstructionTiming]]:
        """One step with every instruction timed on its worker (each waits for its results
        before the next starts; the hosts still run side by side): the step's outputs and
        the intervals, in ``time.time`` seconds, each with the host that ran it."""

        outs = self._run(args, timed=True)
        refs = {h: w.last_timings.remote() for h, w in enumerate(self.session.workers)}
        per_host = await_workers(self.session, refs, "reading the step's timings")
        timings = [t for host in per_host for t in host]
        return outs, sorted(timings, key=lambda t: (t.start, t.host, t.index))

    def trace(self, path: str | Path, *args: Any, png: bool = True) -> list[InstructionTiming]:
        """One profiled step (``profile``) as a Chrome trace at ``path`` plus a Gantt chart
        beside it (same stem, .png), one track per mesh named like
        ``PipeshardPlan.timeline``'s; returns every host's timings.

        Instructions of one host run back to back while profiled, but the hosts run side by
        side, so the trace shows how the meshes of different hosts overlap. A mesh spanning
        hosts runs each instruction on all of them in lockstep: its track shows its first
        host's intervals (the others are in the returned timings).
        """
        from ..inspect.timeline import write_measured_trace

        _, timings = self.profile(*args)
        first = {m: hosts[0] for m, hosts in enumerate(self.stage_host)}
        shown = [
            t
            for t in timings
            if isinstance(t.instruction, Send | Recv) or t.host == first[t.instruction.mesh]
        ]
        how = "back to back on each host, hosts side by side"
        write_measured_trace(path, shown, self.plan, self.fun_name, how=how, png=png)
        return timings

    def get_hlo_text(self, program: str) -> str:
        """The compiled HLO of one program, from a worker that runs it (after a step)."""

        table = self._programs()
        if program not in table:
            raise ValueError(f"program: no program {program!r}; valid: {sorted(table)}")
        host = table[program][0]
        ref = self.session.workers[host].hlo_text.remote(self.keys[host], program)
        return await_workers(self.session, {host: ref}, f"reading {program}'s HLO")[0]

    def collectives(self) -> StepCollectives:
        """Per program (stage, role, runs per step), the collectives of its compiled HLO as
        a worker that runs it compiled it; ``.per_step()`` totals one step."""
        runs = [(program, n) for program, (_, n) in self._programs().items()]
        return step_collectives(runs, self.get_hlo_text)

    def _programs(self) -> dict[str, tuple[int, int]]:
        """Each program: the first host whose stream runs it, and its runs per step there
        (a mesh over several hosts runs it as often on each)."""

        if self._program_table is None:
            workers = self.session.workers
            refs = {
                h: w.program_runs.remote(k)
                for h, (w, k) in enumerate(zip(workers, self.keys, strict=True))
            }
            found: dict[str, tuple[int, int]] = {}
            for host, runs in enumerate(await_workers(self.session, refs, "listing programs")):
                for program, n in runs:
                    found.setdefault(program, (host, n))
            self._program_table = found
        return self._program_table

    def _run(self, args: tuple[Any, ...], timed: bool) -> Any:

        flat = dynamic_leaves(args, self.static_argnums, self.in_tree, self.fun_name)
        if self.key_inputs:
            keys_to_data(flat, self.key_inputs, leaf_paths(self.in_tree))
        if self.pieces is not None:
            flat = self.pieces.split_inputs(flat, lambda x, a, b, i: _remote_rows(x, a, b))
        step = next(self.session.steps)  # unique in the session: mailboxes never mix steps
        workers = self.session.workers
        t0 = time.perf_counter()
        garbage, self.session.garbage[:] = list(self.session.garbage), []
        refs = [
            w.run_step.remote(
                key,
                step,
                {n: self._input(flat[int(n[3:])], host, n) for n in need},
                [k for h, k in garbage if h == host],
                timed,
            )
            for host, (w, key, need) in enumerate(zip(workers, self.keys, self.needs, strict=True))
        ]
        self.last_dispatch_seconds = time.perf_counter() - t0
        held: dict[str, dict[str, Any]] = {}
        for host, result in self._collect(step, refs):
            for name, (rkey, shape, dtype) in result.items():
                entry = held.setdefault(name, {"keys": [], "shape": shape, "dtype": dtype})
                entry["keys"].append((host, rkey))
        outs = []
        for o, name in enumerate(self.out_names):
            if name is None:
                outs.append(self.out_literals[o])
            elif name in held:
                h = held[name]
                keys = tuple(sorted(h["keys"]))
                devices = self.out_devices.get(name, ())
                outs.append(RemoteArray(self.session, keys, h["shape"], h["dtype"], devices))
            else:  # an input handed back unchanged
                outs.append(flat[int(name[3:])])
        if self.pieces is not None:
            outs = self.pieces.join_outputs(outs, _join_remote)
        self._label(outs, step)
        data_to_keys(outs, self.key_outputs)
        return jax.tree.unflatten(self.out_tree, outs)

    def _collect(self, step: int, refs: list[Any]) -> list[tuple[int, Any]]:
        """Every host's result of ``step``. A worker that dies, or stops answering the
        driver's pings (every ``STEP_POLL`` s), is a ``WorkerFailedError``; a host whose
        part of the step raised stops the step on every host before the error is raised, so
        the session stays usable for the next step."""
        import ray

        host_of = {ref: host for host, ref in enumerate(refs)}
        results, pending = [], list(refs)
        deadline = time.monotonic() + STEP_TIMEOUT
        while pending:
            # Whichever worker finishes (or dies) first: a dead worker fails at once, while
            # its peers would only time out waiting for what it never sends.
            done, pending = ray.wait(pending, timeout=STEP_POLL)
            if not done:
                self._check(step)
                if time.monotonic() > deadline:
                    host = host_of[pending[0]]
                    reason = f"step {step} did not finish within {STEP_TIMEOUT:.0f} s"
                    raise self.session.failure(host, reason)
                continue
            for ref in done:
                host = host_of[ref]
                try:
                    result = ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    self._abort(step, [], check=False)
                    raise self.session.failure(host, f"during step {step}: {err}") from None
                except ray.exceptions.RayTaskError as err:
                    self._abort(step, pending)
                    raise RuntimeError(
                        f"host {host} failed in step {step}: {err.cause!r}; every host stopped "
                        "that step, and the session is ready for the next one"
                    ) from None
                if result is None:  # aborted: only after another host failed, reported above
                    raise RuntimeError(f"host {host}: step {step} was aborted")
                results.append((host, result))
        return results

    def _check(self, step: int) -> None:
        """Ping the workers while a step runs: a stopped or dead one fails the step (and
        the step stops on the others)."""
        try:
            self.session.check_workers(timeout=5.0)
        except WorkerFailedError as err:
            self._abort(step, [], check=False)
            raise self.session.failure(err.host, f"during step {step}: {err.reason}") from None

    def _abort(self, step: int, pending: list[Any], check: bool = True) -> None:
        """Stop ``step`` on the hosts still running it (their ``Recv``s would wait for a
        host that failed) and wait until they have; with ``check``, a worker that cannot be
        stopped is a ``WorkerFailedError`` (the session must then be re-initialised)."""
        import ray

        for w in self.session.workers:
            w.abort_step.remote(step)
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=STEP_POLL)
        if check:
            self._check(step)

    def _label(self, outs: list[Any], step: int) -> None:
        """Name each output handle (key path, step) for the errors that report it lost."""
        if self._out_paths is None:  # the same every step: worked out once
            self._out_paths = leaf_paths(self.out_tree)
        for path, x in zip(self._out_paths, outs, strict=True):
            name = f"{self.fun_name} output{path} of step {step}"
            if isinstance(x, StackedRemoteArray):
                for part, a in zip(x.parts, x.starts, strict=False):
                    part.label = f"{name} (rows {a}:{a + part.shape[0]})"
            if isinstance(x, RemoteArray):
                x.label = name

    def remote_slots(self, avals: Sequence[Any]) -> list[RemoteSlot]:
        """Where this step reads each argument leaf: ``restore_checkpoint`` targets that put
        values on the workers reading them, in the layouts they read them in."""
        # A PRNG key is read on the driver and sent as its data each step (``ray_keys``).
        return [
            jax.ShapeDtypeStruct(a.shape, a.dtype)
            if is_prng_key(a)
            else RemoteSlot(self, i, tuple(a.shape), np.dtype(a.dtype))
            for i, a in enumerate(avals)
        ]

    def step_inputs(self, leaf: int) -> list[tuple[str, int | None, int | None]]:
        """The step inputs user argument leaf ``leaf`` becomes: (name, first row, stop row),
        rows None for the whole leaf (several: a scanned stack cut into row pieces)."""
        if self.pieces is None:
            return [(f"arg{leaf}", None, None)]
        return [(f"arg{j}", a, b) for j, (k, a, b) in enumerate(self.pieces.inputs) if k == leaf]

    def _input(self, leaf: Any, host: int, name: str) -> Any:
        """What a worker gets for step input ``name``: a reference to its own resident copy
        where that can be used in place, else the array (through the object store). A value
        sharded over several hosts is used in place only by the mesh it is sharded over
        (JAX cannot move it to other devices across processes)."""
        if isinstance(leaf, RemoteArray) and leaf.session is self.session:
            here = dict(leaf.keys).get(host)
            if here is not None and (len(leaf.keys) == 1 or not leaf.devices):
                return Resident(here)  # held here alone, or a whole copy on each host
            if here is not None and self.arg_devices.get(name) == {leaf.devices}:
                return Resident(here)
        return np.asarray(leaf)


@dataclass(frozen=True, eq=False)
class RemoteSlot:
    """Argument leaf ``leaf`` of a step on Ray, as a ``restore_checkpoint`` target: the
    value is read on the workers whose stages read it, in their layouts, and comes back as
    a ``RemoteArray`` that the step uses in place."""

    executable: RayPipeshardExecutable
    leaf: int
    shape: tuple[int, ...]
    dtype: Any


class RemoteArray:
    """A step output that stays on the host worker(s) that computed it. ``np.asarray(x)``
    fetches it (once); passed back into a step on the same worker it is used in place, so
    parameters and optimiser state stay on their workers between steps. A value sharded
    over the devices of several hosts (a stage mesh spanning hosts) has a key on each, and
    ``devices`` names them; several keys without ``devices`` are whole copies (a restored
    value that stages on several hosts read)."""

    def __init__(
        self,
        session: RaySession,
        keys: tuple[tuple[int, str], ...],
        shape: Sequence[int],
        dtype: Any,
        devices: tuple[int, ...] = (),
    ) -> None:
        self.session, self.keys = session, keys
        self.devices = devices  # plan devices of the spanning mesh it is sharded over
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self._value: np.ndarray | None = None
        self.label = f"an array of shape {self.shape}"  # what errors call it
        session.handles.add(self)

    @property
    def host(self) -> int:
        """The (first) host worker holding it."""
        return self.keys[0][0]

    @property
    def hosts(self) -> tuple[int, ...]:
        return tuple(h for h, _ in self.keys)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def block_until_ready(self) -> RemoteArray:
        return self  # it exists once its step has finished on the worker

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self._value is None:
            if not self.session.workers:
                raise RuntimeError(
                    f"this value lived on Ray host worker(s) {list(self.hosts)}, which "
                    "alpa_mini.shutdown() removed; fetch outputs (np.asarray) before shutting "
                    "down"
                )
            keys = self.keys if self.devices else self.keys[:1]  # copies: one is enough
            got = _fetch(self.session, keys, self.label)
            if isinstance(got[0], np.ndarray):
                self._value = got[0]
            else:  # pieces of a value sharded over several hosts
                whole = np.empty(self.shape, self.dtype)
                for index, piece in (p for pieces in got for p in pieces):
                    whole[index] = piece
                self._value = whole
        return self._value if dtype is None else self._value.astype(dtype)

    def __float__(self) -> float:
        return float(np.asarray(self))

    def __repr__(self) -> str:
        return f"RemoteArray(hosts={list(self.hosts)}, shape={self.shape}, dtype={self.dtype})"

    def __del__(self) -> None:
        # Queue the workers' copies for release with the next step's call (one remote call
        # per step, not one per dropped handle). No module globals: may run at exit.
        self.session.garbage.extend(self.keys)


#: Seconds between checks of the workers while a fetch waits (a dead worker is named at
#: once; a stopped one within this plus ``check_workers``' 5 s), and the most a fetch waits.
FETCH_POLL = 10.0
FETCH_LIMIT = 600.0
#: The most seconds the workers may take to trace and compile a step.
BUILD_LIMIT = 3600.0


def _fetch(session: RaySession, keys: Sequence[tuple[int, str]], label: str) -> list[Any]:
    """The workers' copies of one output (see ``await_workers``)."""
    refs = {h: session.workers[h].fetch.remote(k) for h, k in keys}
    return list(await_workers(session, refs, f"a fetch of {label}"))


def await_workers(
    session: RaySession, refs: dict[int, Any], what: str, limit: float = FETCH_LIMIT
) -> list[Any]:
    """The results of remote calls on host workers (``{host: ref}``), in host order. A
    worker that died or stopped answering is a ``WorkerFailedError`` naming its host and
    ``what`` was under way; calls still busy after ``limit`` seconds while the workers
    answer are a ``TimeoutError``."""
    import ray

    start = time.monotonic()
    while True:
        try:
            return ray.get(list(refs.values()), timeout=FETCH_POLL)
        except ray.exceptions.RayActorError as err:
            host = next((h for h, r in refs.items() if _died(r)), next(iter(refs)))
            raise session.failure(host, f"during {what} ({type(err).__name__})") from None
        except ray.exceptions.GetTimeoutError:
            try:
                session.check_workers(timeout=5.0)
            except WorkerFailedError as err:
                raise session.failure(err.host, f"during {what}: {err.reason}") from None
            if time.monotonic() - start > limit:
                raise TimeoutError(
                    f"{what} on hosts {sorted(refs)} did not finish within {limit:g} s "
                    "although the workers answer"
                ) from None


def _died(ref: Any) -> bool:
    import ray

    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:  # not ready, or another error: not this one's death
        return False
    return False


class StackedRemoteArray(RemoteArray):
    """A stacked output whose row pieces stay on the workers of their stages; fed back, each
    piece is used in place; ``np.asarray`` fetches and concatenates them."""

    def __init__(self, parts: Sequence[RemoteArray]) -> None:
        first = parts[0]
        shape = (sum(p.shape[0] for p in parts), *first.shape[1:])
        super().__init__(first.session, (), shape, first.dtype)
        self.parts = tuple(parts)
        self.starts = tuple(itertools.accumulate((p.shape[0] for p in parts), initial=0))

    @property
    def host(self) -> int:
        return self.parts[0].host

    @property
    def hosts(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(h for p in self.parts for h in p.hosts))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if self._value is None:
            self._value = np.concatenate([np.asarray(p) for p in self.parts])
        return self._value if dtype is None else self._value.astype(dtype)

    def __repr__(self) -> str:
        return (
            f"StackedRemoteArray(hosts={list(self.hosts)}, shape={self.shape}, "
            f"dtype={self.dtype}, pieces={len(self.parts)})"
        )


def _remote_rows(x: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of a step input: a piece of a stacked output as it is (so it is
    used in place), else the rows of the fetched array."""
    if isinstance(x, StackedRemoteArray):
        for p, a in zip(x.parts, x.starts, strict=False):
            if a == start and a + p.shape[0] == stop:
                return p
    return np.asarray(x)[start:stop]


def _join_remote(parts: Sequence[Any]) -> Any:
    if all(isinstance(p, RemoteArray) for p in parts):
        return StackedRemoteArray(parts)
    return np.concatenate([np.asarray(p) for p in parts])


def compile_pipeshard_ray(
    fun: Callable[..., Any],
    avals: list[Any],
    roles: list[str],
    in_tree: Any,
    static: tuple[tuple[int, Any], ...],
    method: PipeshardParallel,
    cluster: ClusterSpec,
    session: RaySession,
    donated: Sequence[int] = (),
) -> RayPipeshardExecutable:
    """Plan on the driver (or replay ``method.plan``), then build on every host worker;
    ``donated``: argument leaves the step may consume (a worker's resident copy)."""

    t0 = time.perf_counter()
    step_fun: Any = StepFun(fun, static, in_tree)
    impls = key_impls(avals)
    if impls:  # the workers exchange arguments and results as NumPy arrays: keys as data
        step_fun = KeysAsData(step_fun, impls)
        avals = [data_aval(a) if k in impls else a for k, a in enumerate(avals)]
    if (
        method.plan is None
        and isinstance(method.stage_option, AutoStageOption)
        and not session.span_hosts
    ):
        # Without the workers' jax.distributed group no stage mesh may span hosts.
        option = dataclasses.replace(method.stage_option, submesh_space="one_host")
        method = dataclasses.replace(method, stage_option=option)
    prepared = prepare_step(step_fun, avals, roles, method, cluster)
    plan = prepared.plan
    donated = split_leaf_indices(prepared.pieces, donated)
    hosts = stage_hosts(plan, cluster.devices_per_host, session.span_hosts)
    builder = WorkerBuilder(
        step_fun,
        tuple(avals),
        plan.to_json(),
        tuple(hosts),
        cluster.devices_per_host,
        tuple(donated),
        method.shards_optimizer_state,
        method.fuse_programs,
        tuple(roles),
    )
    refs = {h: w.build.remote(builder) for h, w in enumerate(session.workers)}
    built = await_workers(session, refs, "compiling the step", limit=BUILD_LIMIT)
    meta = built[0]["meta"]
    return RayPipeshardExecutable(
        fun_name=getattr(fun, "__name__", "step"),
        plan=plan,
        session=session,
        keys=[b["key"] for b in built],
        needs=[b["needs"] for b in built],
        out_names=list(meta["out_names"]),
        out_literals=dict(meta["out_literals"]),
        out_devices=dict(meta["out_devices"]),
        arg_devices=dict(meta["arg_devices"]),
        stage_host=tuple(hosts),
        in_tree=in_tree,
        out_tree=prepared.out_tree,
        static_argnums=tuple(i for i, _ in static),
        planning_time=time.perf_counter() - t0,
        pieces=prepared.pieces,
        key_inputs=impls,
        key_outputs=dict(step_fun.out_impls) if impls else {},
    )
