"""The Ray actor that owns one host's devices (DESIGN 6).

One ``HostWorker`` runs per (simulated) host. In the CPU test mode it gives its own process
``num_cpu_devices`` JAX CPU devices before JAX starts there; on a GPU node it sees the GPUs
Ray assigned to it. It reports its devices so that the driver can describe the cluster.
Later steps compile and run stage programs here; this module never imports the planner.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["HostWorker"]


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
