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
from typing import Any

from .instructions import Recv, Run, Send, program_runs
from .local import InstructionTiming, LocalRuntime, is_deleted

__all__ = ["HostWorker", "Resident", "place"]

#: Seconds a ``Recv`` waits for its peer before the step fails (a dead peer, not a hang).
RECV_TIMEOUT = 30.0
#: In a ``jax.distributed`` group on CPU, at most this many dispatched programs may be
#: unfinished: gloo collectives hang with about 30 in flight (measured on jax 0.10.2).
CPU_GROUP_IN_FLIGHT = 8


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
        self._resident: dict[str, Any] = {}
        self._timings: list[InstructionTiming] = []

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
            jax.distributed.initialize(coordinator, num_processes, self.host)
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
        """Called by a peer's ``Send``: park ``value`` until this host's ``Recv`` takes it."""
        with self._arrived:
            self._mailbox[(step, tag)] = value
            self._arrived.notify_all()

    def run_step(
        self,
        key: int,
        step: int,
        inputs: dict[str, Any],
        release: list[str] = (),
        timed: bool = False,
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
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"host {self.host}: nothing from host {ins.frm} for {ins.tag!r} within "
                        f"{RECV_TIMEOUT:.0f} s (is that worker alive?)"
                    )
                self._arrived.wait(left)
            return self._mailbox.pop((step, ins.tag))


@dataclass(frozen=True)
class Pieces:
    """Parts of one array of ``shape`` and ``dtype``: ``(index, data)`` pairs, ``index`` a
    tuple of slices into the whole (shards as their holders sent them)."""

    shape: tuple[int, ...]
    dtype: Any
    parts: tuple[tuple[tuple[slice, ...], Any], ...]

    def merged(self, other: Pieces) -> Pieces:
        return Pieces(self.shape, self.dtype, self.parts + other.parts)

    def region(self, index: tuple[slice, ...]) -> Any:
        """The values of ``index`` (a device's shard), put together from the parts."""
        import numpy as np

        want = [_bounds(s, n) for s, n in zip(index, self.shape, strict=True)]
        out = np.empty([hi - lo for lo, hi in want], self.dtype)
        filled = 0
        for idx, data in self.parts:
            have = [_bounds(s, n) for s, n in zip(idx, self.shape, strict=True)]
            lo = [max(a[0], b[0]) for a, b in zip(want, have, strict=True)]
            hi = [min(a[1], b[1]) for a, b in zip(want, have, strict=True)]
            if any(l >= h for l, h in zip(lo, hi, strict=True)):
                continue
            dst = tuple(slice(l - w[0], h - w[0]) for l, h, w in zip(lo, hi, want, strict=True))
            src = tuple(slice(l - v[0], h - v[0]) for l, h, v in zip(lo, hi, have, strict=True))
            out[dst] = data[src]
            filled += int(np.prod([h - l for l, h in zip(lo, hi, strict=True)]))
        if filled < out.size:
            raise RuntimeError(
                f"a transfer of a {self.shape} array lacks part of {index}: only {filled} of "
                f"{out.size} values arrived (an instruction stream split wrongly)"
            )
        return out


def _bounds(s: slice, n: int) -> tuple[int, int]:
    start, stop, _ = s.indices(n)
    return start, stop


def pieces_for(value: Any, sharding: Any, to: int) -> Pieces:
    """The shards of ``value`` held on this process that process ``to``'s devices need under
    ``sharding``, each distinct shard only from the lowest process holding it."""
    import numpy as np

    shape = tuple(value.shape)
    if not hasattr(value, "addressable_shards"):  # a host array: all of it
        whole = tuple(slice(0, n) for n in shape)
        return Pieces(shape, value.dtype, ((whole, np.asarray(value)),))
    wanted = [
        tuple(_bounds(s, n) for s, n in zip(idx, shape, strict=True))
        for d, idx in sharding.devices_indices_map(shape).items()
        if d.process_index == to
    ]
    first_holder: dict[Any, int] = {}
    for d, idx in value.sharding.devices_indices_map(shape).items():
        key = tuple(_bounds(s, n) for s, n in zip(idx, shape, strict=True))
        first_holder[key] = min(first_holder.get(key, d.process_index), d.process_index)
    parts, seen = [], set()
    for shard in value.addressable_shards:
        key = tuple(_bounds(s, n) for s, n in zip(shard.index, shape, strict=True))
        if key in seen or first_holder[key] != shard.device.process_index:
            continue
        seen.add(key)
        overlaps = any(
            all(max(a[0], b[0]) < min(a[1], b[1]) for a, b in zip(key, w, strict=True))
            for w in wanted
        )
        if overlaps or not shape:
            parts.append((shard.index, np.asarray(shard.data)))
    return Pieces(shape, value.dtype, tuple(parts))


def place(value: Any, sharding: Any) -> Any:
    """``value`` laid out as ``sharding``, also where either spans hosts of a group.

    A value held whole on this host (numpy, or an array on local devices) becomes this
    host's shards of a sharding that spans hosts (every member host does the same with its
    own whole copy); received ``Pieces`` become the shards they cover. A value that spans
    hosts can only be re-laid over the same devices (JAX moves nothing between device sets
    across processes): it crosses by ``Send``/``Recv`` of its pieces instead.
    """
    import jax

    if isinstance(value, Pieces):
        return jax.make_array_from_callback(value.shape, sharding, value.region)
    if getattr(value, "is_fully_addressable", True):
        if sharding.is_fully_addressable or not isinstance(value, jax.Array):
            return jax.device_put(value, sharding)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
    if value.sharding.device_set != sharding.device_set:
        raise RuntimeError(
            f"a value sharded over devices {sorted(d.id for d in value.sharding.device_set)} "
            f"cannot move to devices {sorted(d.id for d in sharding.device_set)} but by "
            "Send/Recv of its pieces (an instruction stream split wrongly)"
        )
    return jax.device_put(value, sharding)
