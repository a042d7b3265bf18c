"""The Ray actor that owns one host's devices (DESIGN 6).

One ``HostWorker`` runs per (simulated) host. In the CPU test mode it gives its own process
``num_cpu_devices`` JAX CPU devices before JAX starts there; on a GPU node it sees the GPUs
Ray assigned to it. ``start`` brings JAX up, first joining every host worker into one
``jax.distributed`` group when stage meshes may span hosts (gloo collectives on CPU, NCCL on
GPU); the worker then reports its devices so that the driver can describe the cluster.
The driver sends a builder that compiles this host's stages here (the planner stays on the
driver side: this module never imports it), then one ``run_step`` call per step; buffers
cross hosts by ``Send`` (a remote ``deliver`` call on the peer, through Ray's object store)
and ``Recv`` (wait in the mailbox), never through the driver. The actor is threaded, so that
``deliver`` runs while ``run_step`` waits.
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint_io import Part, PartWriter, Read, parts_of, read_values, writer_name
from .instructions import Put, Recv, Run, Send, program_runs
from .local import InstructionTiming, LocalRuntime, is_deleted
from .pieces import Pieces, pieces_for, place

__all__ = ["HostWorker", "Pieces", "Resident", "pieces_for", "place"]

#: Seconds a ``Recv`` waits for its peer before the step fails (a dead peer, not a hang).
RECV_TIMEOUT = 30.0
#: In a ``jax.distributed`` group on CPU, at most this many dispatched programs may be
#: unfinished: gloo collectives hang with about 30 in flight (measured on jax 0.10.2).
CPU_GROUP_IN_FLIGHT = 8


class StepAborted(Exception):
    """Raised inside ``run_step`` once its step is aborted (a peer failed in it)."""


@dataclass(frozen=True)
class Resident:
    """A step input that already lives on this worker, kept from an earlier step's output."""

    key: str


class HostWorker:
    """Plain class; ``alpa_mini.session.ray`` wraps it with ``ray.remote`` when it places it."""

    def __init__(self, host: int, num_cpu_devices: int | None) -> None:
        if num_cpu_devices is not None:
            os.environ["JAX_PLATFORMS"] = "cpu"
        import jax

        if num_cpu_devices is not None:
            jax.config.update("jax_num_cpu_devices", num_cpu_devices)
        self.host = host
        self.devices: list[Any] = []  # this host's devices, once ``start`` has run
        self.group_devices: list[Any] = []  # every host's devices, host-major, in a group
        self._throttle = False
        self._executables: list[tuple[LocalRuntime, list[Any], list[str]]] = []
        self._peers: list[Any] = []
        self._mailbox: dict[tuple[int, str], Any] = {}
        self._arrived = threading.Condition()
        self._aborted: set[int] = set()  # steps stopped because a host failed in them
        self._resident: dict[str, Any] = {}
        self._timings: list[InstructionTiming] = []
        self._writer = PartWriter()
        self._restored = 0

    def free_address(self, loopback: bool) -> str:
        """``ip:port`` on this node where a ``jax.distributed`` coordinator can listen."""
        import ray

        ip = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((ip, 0))
            return f"{ip}:{sock.getsockname()[1]}"

    def start(self, coordinator: str | None, num_processes: int) -> None:
        """Start JAX here; with a ``coordinator``, first join the group of ``num_processes``
        host workers (this worker is process ``host``). Blocks until all have joined."""
        import jax

        if coordinator is not None:
            # The coordination service listens only where the group was told to connect
            # (loopback for an embedded Ray), not on every interface (JAX's default).
            jax.distributed.initialize(
                coordinator, num_processes, self.host, coordinator_bind_address=coordinator
            )
            everyone = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
            self.group_devices = everyone
            self._throttle = jax.default_backend() == "cpu"
        self.devices = jax.local_devices()

    def info(self) -> dict[str, Any]:
        """This host's index, process, node address and devices (kind, memory limit)."""
        import ray

        devices = []
        for d in self.devices:
            stats = None
            try:
                stats = d.memory_stats()
            except Exception:  # CPU devices and some runtimes have none
                stats = None
            devices.append(
                {
                    "id": int(d.id),
                    "platform": str(d.platform),
                    "device_kind": str(d.device_kind),
                    "bytes_limit": None if not stats else stats.get("bytes_limit"),
                }
            )
        return {
            "host": self.host,
            "pid": os.getpid(),
            "node_ip": ray.util.get_node_ip_address(),
            "devices": devices,
        }

    def ping(self) -> int:
        return self.host

    # ------------------------------------------------------------------ execution
    def build(self, builder: Callable[..., Any]) -> dict[str, Any]:
        """Compile this host's part of a pipelined step: ``builder(host, devices,
        group_devices)`` returns
        (programs, layouts, add, stream, needs, holds, meta). Returns the executable's
        ``key`` here, the step inputs this host reads, the outputs it ends up holding, and
        the builder's ``meta``."""
        built = builder(self.host, self.devices, self.group_devices)
        programs, layouts, add, stream, needs, holds, meta = built
        key = len(self._executables)
        runtime = LocalRuntime(programs, layouts, add, place=place)
        self._executables.append((runtime, stream, holds))
        return {"key": key, "needs": needs, "holds": holds, "meta": meta}

    def set_peers(self, peers: list[Any]) -> None:
        """Handles of every host worker, indexed by host (for ``Send``)."""
        self._peers = peers

    def deliver(self, step: int, tag: str, value: Any) -> None:
        """Called by a peer's ``Send``: park ``value`` until this host's ``Recv`` takes it
        (dropped if that step was aborted)."""
        with self._arrived:
            if step not in self._aborted:
                self._mailbox[(step, tag)] = value
                self._arrived.notify_all()

    def abort_step(self, step: int) -> None:
        """Stop ``step`` here: a ``Recv`` waiting for it fails at once, and what peers sent
        for it is dropped (another host's part of the step failed)."""
        with self._arrived:
            self._aborted.add(step)
            for k in [k for k in self._mailbox if k[0] == step]:
                del self._mailbox[k]
            self._arrived.notify_all()

    def run_step(
        self,
        key: int,
        step: int,
        inputs: dict[str, Any],
        release: list[str] = (),
        timed: bool = False,
    ) -> dict[str, Any] | None:
        """``_run_step``; None if the step was aborted (``abort_step``) before it ended."""
        try:
            return self._run_step(key, step, inputs, release, timed)
        except StepAborted:
            return None

    def _run_step(
        self,
        key: int,
        step: int,
        inputs: dict[str, Any],
        release: list[str],
        timed: bool,
    ) -> dict[str, Any]:
        """Run this host's stream of executable ``key`` for one step. The step outputs this
        host holds stay here (resident, in their layouts); returns, per output, the key to
        ``fetch`` it by, its shape and dtype. An input given as ``Resident(key)`` is such a
        kept value (the parameters a previous step returned), used without a copy.
        ``release`` names resident values whose handles the driver dropped. ``timed``: every
        instruction waits for its results and its interval is kept for ``last_timings``
        (a ``Recv``'s interval is its wait for the peer)."""
        import jax
        import numpy as np

        self.release(release)
        runtime, stream, holds = self._executables[key]
        buffers: dict[str, Any] = {
            name: self._resident[v.key] if isinstance(v, Resident) else v
            for name, v in inputs.items()
        }
        in_flight: collections.deque[Any] = collections.deque()
        limit = CPU_GROUP_IN_FLIGHT if self._throttle else runtime.max_in_flight
        self._timings = []
        for index, ins in enumerate(stream):
            if step in self._aborted:  # a peer failed: nothing of this step is kept
                raise StepAborted(step)
            start = time.time() if timed else 0.0
            if isinstance(ins, Send):
                value = buffers[ins.src]
                if ins.layout is None:
                    value = np.asarray(value)
                else:
                    value = pieces_for(value, runtime.layouts[ins.layout], ins.to)
                if ins.to == self.host:
                    self.deliver(step, ins.tag, value)
                else:
                    self._peers[ins.to].deliver.remote(step, ins.tag, value)
            elif isinstance(ins, Recv):
                got = self._take(step, ins)
                held = buffers.get(ins.dst)
                buffers[ins.dst] = held.merged(got) if isinstance(held, Pieces) else got
            else:
                runtime.execute_one(ins, buffers)
                written = [buffers[n] for n in runtime.written(ins) if n in buffers]
                if timed:
                    jax.block_until_ready(written)
                elif limit and (self._throttle or isinstance(ins, Run)):
                    in_flight.append(written)
                    if len(in_flight) > limit:
                        # A buffer donated since (a later program's input) is consumed;
                        # residuals are tuples of arrays.
                        leaves = jax.tree.leaves(in_flight.popleft())
                        done = [x for x in leaves if not is_deleted(x)]
                        jax.block_until_ready(done)
            if timed:
                self._timings.append(InstructionTiming(index, ins, start, time.time(), self.host))
        outs = {name: buffers[name] for name in holds}
        jax.block_until_ready(list(outs.values()))
        meta = {}
        for name, value in outs.items():
            rkey = f"{key}:{step}:{name}"
            self._resident[rkey] = value
            meta[name] = (rkey, tuple(value.shape), str(value.dtype))
        return meta

    def program_runs(self, key: int) -> list[tuple[str, int]]:
        """The programs this host's stream of executable ``key`` runs, and how often."""
        return program_runs(self._executables[key][1])

    def hlo_text(self, key: int, program: str) -> str:
        """The compiled HLO of one program of executable ``key`` (after a step)."""
        return self._executables[key][0].hlo_text(program)

    def last_timings(self) -> list[InstructionTiming]:
        """The instruction intervals of this worker's last ``run_step(..., timed=True)``."""
        return list(self._timings)

    def fetch(self, rkey: str) -> Any:
        """A resident value as a numpy array; for one sharded over several hosts' devices,
        the distinct pieces held here as ``[(index, array), ...]`` (``index`` a tuple of
        slices into the whole), which the driver puts together."""
        import numpy as np

        value = self._resident[rkey]
        if getattr(value, "is_fully_addressable", True):
            return np.asarray(value)
        pieces: dict[Any, Any] = {}
        for shard in value.addressable_shards:
            key = tuple((s.start, s.stop, s.step) for s in shard.index)
            if key not in pieces:
                pieces[key] = (shard.index, np.asarray(shard.data))
        return list(pieces.values())

    # ------------------------------------------------------------------ checkpoints
    def save_parts(
        self, directory: str, items: list[tuple[str, str, tuple[int, ...]]]
    ) -> list[Part]:
        """Write resident values under ``directory`` (this host's orbax part tree), in the
        background: ``items`` are (part name, resident key, row offset in the saved array).
        Returns once the values are copied off their devices (the next step may overwrite
        them), with the parts written; ``finish_saves`` waits for the disk."""
        tree: dict[str, Any] = {}
        written: list[Part] = []
        directory = str(Path(directory).with_name(writer_name(Path(directory).name)))
        for name, rkey, offset in items:
            arrays, parts = parts_of(Path(directory).name, name, self._resident[rkey], offset)
            tree.update(arrays)
            written.extend(parts)
        if tree:
            self._writer.write(directory, tree)
        return written

    def finish_saves(self) -> None:
        """Block until this worker's checkpoint writes are on disk."""
        self._writer.wait()

    def restore_parts(
        self, step_dir: str, requests: list[tuple[int | None, str | None, Any]]
    ) -> list[tuple[str, tuple[int, ...], str]]:
        """Read checkpoint regions into resident values: each request is (executable key,
        step input name, (parts, shape, dtype, region)); the value is laid out as that
        input's first ``Put`` on this host lays it out (else kept on the host). Returns each
        value's resident key, shape and dtype."""
        reads = [
            Read(
                tuple(parts),
                tuple(shape),
                dtype,
                self._input_layout(key, arg),
                _region_tuple(region),
            )
            for key, arg, (parts, shape, dtype, region) in requests
        ]
        out = []
        for value in read_values(step_dir, reads):
            if hasattr(value, "block_until_ready"):
                value.block_until_ready()  # the handle promises the value is here
            self._restored += 1
            rkey = f"restored:{self._restored}"
            self._resident[rkey] = value
            out.append((rkey, tuple(value.shape), str(value.dtype)))
        return out

    def _input_layout(self, key: int | None, arg: str | None) -> Any:
        """The sharding step input ``arg`` of executable ``key`` is first put in here."""
        if key is None:
            return None
        runtime, stream, _ = self._executables[key]
        put = next((i for i in stream if isinstance(i, Put) and i.src == arg), None)
        return None if put is None else runtime.layouts[put.layout]

    def release(self, rkeys: list[str]) -> None:
        """Forget resident values nobody holds a handle to any more."""
        for k in rkeys:
            self._resident.pop(k, None)

    def num_resident(self) -> int:
        return len(self._resident)

    def _take(self, step: int, ins: Recv) -> Any:
        deadline = time.monotonic() + RECV_TIMEOUT
        with self._arrived:
            while (step, ins.tag) not in self._mailbox:
                if step in self._aborted:
                    raise StepAborted(step)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"host {self.host}: nothing from host {ins.frm} for {ins.tag!r} within "
                        f"{RECV_TIMEOUT:.0f} s (is that worker alive?)"
                    )
                self._arrived.wait(left)
            return self._mailbox.pop((step, ins.tag))


def _region_tuple(region: Any) -> tuple[tuple[int, int], ...] | None:
    return None if region is None else tuple(tuple(r) for r in region)
