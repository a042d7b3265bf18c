"""The Ray actor that owns one host's devices (DESIGN 6).

One ``HostWorker`` runs per (simulated) host. In the CPU test mode it gives its own process
``num_cpu_devices`` JAX CPU devices before JAX starts there; on a GPU node it sees the GPUs
Ray assigned to it. It reports its devices so that the driver can describe the cluster.
The driver sends a builder that compiles this host's stages here (the planner stays on the
driver side: this module never imports it), then one ``run_step`` call per step; buffers
cross hosts by ``Send`` (a remote ``deliver`` call on the peer, through Ray's object store)
and ``Recv`` (wait in the mailbox), never through the driver. The actor is threaded, so that
``deliver`` runs while ``run_step`` waits.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .instructions import Recv, Send
from .local import LocalRuntime

__all__ = ["HostWorker", "Resident"]

#: Seconds a ``Recv`` waits for its peer before the step fails (a dead peer, not a hang).
RECV_TIMEOUT = 30.0


@dataclass(frozen=True)
class Resident:
    """A step input that already lives on this worker, kept from an earlier step's output."""

    key: str


class HostWorker:
    """Plain class; ``alpa_mini.ray_setup`` wraps it with ``ray.remote`` when it places it."""

    def __init__(self, host: int, num_cpu_devices: int | None) -> None:
        if num_cpu_devices is not None:
            os.environ["JAX_PLATFORMS"] = "cpu"
        import jax

        if num_cpu_devices is not None:
            jax.config.update("jax_num_cpu_devices", num_cpu_devices)
        self.host = host
        self.devices = jax.local_devices()
        self._executables: list[tuple[LocalRuntime, list[Any], list[str]]] = []
        self._peers: list[Any] = []
        self._mailbox: dict[tuple[int, str], Any] = {}
        self._arrived = threading.Condition()
        self._resident: dict[str, Any] = {}

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
        """Compile this host's part of a pipelined step: ``builder(host, devices)`` returns
        (programs, layouts, add, stream, needs, holds, meta). Returns the executable's
        ``key`` here, the step inputs this host reads, the outputs it ends up holding, and
        the builder's ``meta``."""
        programs, layouts, add, stream, needs, holds, meta = builder(self.host, self.devices)
        key = len(self._executables)
        self._executables.append((LocalRuntime(programs, layouts, add), stream, holds))
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
        self, key: int, step: int, inputs: dict[str, Any], release: list[str] = ()
    ) -> dict[str, Any]:
        """Run this host's stream of executable ``key`` for one step. The step outputs this
        host holds stay here (resident, in their layouts); returns, per output, the key to
        ``fetch`` it by, its shape and dtype. An input given as ``Resident(key)`` is such a
        kept value (the parameters a previous step returned), used without a copy.
        ``release`` names resident values whose handles the driver dropped."""
        import jax
        import numpy as np

        self.release(release)
        runtime, stream, holds = self._executables[key]
        buffers: dict[str, Any] = {
            name: self._resident[v.key] if isinstance(v, Resident) else v
            for name, v in inputs.items()
        }
        for ins in stream:
            if isinstance(ins, Send):
                value = np.asarray(buffers[ins.src])
                self._peers[ins.to].deliver.remote(step, ins.tag, value)
            elif isinstance(ins, Recv):
                buffers[ins.dst] = self._take(step, ins)
            else:
                runtime.execute_one(ins, buffers)
        outs = {name: buffers[name] for name in holds}
        jax.block_until_ready(list(outs.values()))
        meta = {}
        for name, value in outs.items():
            rkey = f"{key}:{step}:{name}"
            self._resident[rkey] = value
            meta[name] = (rkey, tuple(value.shape), str(value.dtype))
        return meta

    def fetch(self, rkey: str) -> Any:
        """A resident value as a numpy array."""
        import numpy as np

        return np.asarray(self._resident[rkey])

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
