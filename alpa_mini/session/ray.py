"""``init(cluster="ray")``: connect to (or start) Ray, place one ``HostWorker`` per host, and
describe what the workers see as a ``ClusterSpec``.

- ``address=None`` starts an embedded single-node Ray (loopback only, no dashboard, a temp
  dir of its own, 0700) and stops it again at ``shutdown``; a watchdog process
  (``reaper``) kills what it started and removes the temp dir if the driver dies first.
  ``"auto"`` or ``"host:port"`` connects to a running cluster (``ray start --head ...``)
  and only disconnects.
- A cluster with GPUs gets one worker per GPU node, holding all of that node's GPUs
  (placement group, ``STRICT_SPREAD``). Without GPUs it is the CPU test mode: ``num_hosts``
  simulated hosts, each a worker process with ``num_cpu_devices`` JAX CPU devices.
- The description comes from the workers' live devices (``ClusterSpec.detect``), so its
  hosts are the workers and its figures the bundled ones for that device kind.
- ``span_hosts=True`` joins the workers into one ``jax.distributed`` group before JAX starts
  in them, so that a stage mesh may span hosts (its collectives run over gloo on CPU, NCCL
  on GPU). It is the default on clusters of several GPU nodes; in the CPU test mode it is
  off unless asked for, because gloo makes every collective slower, also a host's own.

``shutdown`` kills every actor and removes the placement group this module created.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import socket
import sys
import tempfile
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .._validate import positive_int
from ..cluster.spec import ClusterSpec
from ..errors import ConfigError, WorkerFailedError
from .reaper import start_reaper, stop_reaper

__all__ = ["RaySession", "start_ray_session"]

#: Simulated hosts and CPU devices per host in the CPU test mode, unless given.
DEFAULT_CPU_HOSTS = 2
DEFAULT_CPU_DEVICES_PER_HOST = 4
#: Seconds to wait for the workers to start and report their devices.
START_TIMEOUT = 120.0


@dataclass
class RaySession:
    """What ``init(cluster="ray")`` created, so that ``shutdown`` can remove exactly that."""

    cluster: ClusterSpec
    workers: list[Any]
    placement_group: Any
    started_ray: bool
    temp_dir: str | None
    worker_info: list[dict[str, Any]] = field(default_factory=list)
    span_hosts: bool = False  # the workers form one jax.distributed group
    reaper: Any = None  # the watchdog that cleans up an embedded Ray if the driver dies
    garbage: list[tuple[int, str]] = field(default_factory=list)  # (host, resident key)
    steps: Iterator[int] = field(default_factory=itertools.count)  # step ids, session-wide
    handles: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)  # live RemoteArrays

    def failure(self, host: int, reason: str) -> WorkerFailedError:
        """The error for host ``host``'s worker failing: names the values held there that
        the driver still has handles to and has not fetched (lost with the worker)."""
        lost = sorted(
            x.label
            for x in list(self.handles)
            if x._value is None and host in (h for h, _ in x.keys)
        )
        where = self.worker_info[host] if host < len(self.worker_info) else {}
        return WorkerFailedError(host, where, reason, lost=tuple(lost))

    def check_workers(self, timeout: float = 10.0) -> None:
        """Ping every worker; a dead or unresponsive one raises ``WorkerFailedError`` naming
        its host (within ``timeout`` seconds, never a hang)."""
        import ray

        refs = [w.ping.remote() for w in self.workers]
        for host, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=timeout)
            except ray.exceptions.GetTimeoutError:
                raise self.failure(host, f"no answer within {timeout:g} s") from None
            except ray.exceptions.RayActorError as err:
                raise self.failure(host, f"the actor died ({type(err).__name__})") from None

    def close(self) -> None:
        """Kill our actors, remove our placement group, stop Ray if we started it."""
        import ray

        if not ray.is_initialized():
            return
        for w in self.workers:
            with contextlib.suppress(Exception):  # already dead is fine
                ray.kill(w, no_restart=True)
        if self.placement_group is not None:
            with contextlib.suppress(Exception):  # the cluster may be gone already
                ray.util.remove_placement_group(self.placement_group)
        self.workers = []
        ray.shutdown()
        if self.started_ray and self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        stop_reaper(self.reaper)


def start_ray_session(
    address: str | None,
    *,
    num_hosts: int | None = None,
    num_cpu_devices: int | None = None,
    span_hosts: bool | None = None,
) -> RaySession:
    """Connect or start Ray, place the host workers, and describe the cluster."""
    if address is not None and (not isinstance(address, str) or not address.strip()):
        raise ConfigError(
            f"address: {address!r} is invalid; expected None (start a local Ray), 'auto' or "
            "'host:port' of a running head"
        )
    if span_hosts is not None and not isinstance(span_hosts, bool):
        raise ConfigError(
            f"span_hosts: {span_hosts!r} is invalid; expected True (stage meshes may span "
            "hosts: one jax.distributed group), False, or None (True on several GPU nodes)"
        )
    import ray

    if ray.is_initialized():
        raise RuntimeError(
            "init(cluster='ray'): this process is already connected to Ray; call "
            "alpa_mini.shutdown() (or ray.shutdown()) first"
        )
    temp_dir, reaper = None, None
    if address is None:
        temp_dir = tempfile.mkdtemp(prefix="alpa-mini-ray-")  # 0700
        reaper = start_reaper(temp_dir)
        hosts = num_hosts or DEFAULT_CPU_HOSTS
        with _loopback_node():
            ray.init(
                num_cpus=hosts + 1,
                num_gpus=0,
                _temp_dir=temp_dir,
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
    else:
        _check_reachable(address)
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    try:
        session = _place_workers(address is None, temp_dir, num_hosts, num_cpu_devices, span_hosts)
        if temp_dir:  # after the workers start: Ray re-opens the directory as they do
            _make_private(temp_dir)
        session.reaper = reaper
        return session
    except BaseException:
        ray.shutdown()
        if temp_dir:
            shutil.rmtree(temp_dir, ignore_errors=True)
        stop_reaper(reaper)
        raise


def _make_private(temp_dir: str) -> None:
    """Ray opens its temp dir to everyone (0777) and writes its token file world-readable;
    our embedded cluster's are this user's alone (0700, 0600)."""
    os.chmod(temp_dir, 0o700)
    token = Path.home() / ".ray" / "auth_token"
    with contextlib.suppress(OSError):  # another user's file, or none: leave it
        if token.is_file() and token.stat().st_uid == os.getuid():
            os.chmod(token, 0o600)


@contextlib.contextmanager
def _loopback_node() -> Any:
    """Keep an embedded Ray on loopback. ``ray.init`` replaces a loopback
    ``_node_ip_address`` with the machine's reachable address (``resolve_ip_for_localhost``),
    and every Ray process then binds to that address or to all interfaces. Ray keeps the node
    on loopback only where clusters are switched off (its macOS/Windows default,
    ``ray_constants.ENABLE_RAY_CLUSTER``), so that switch is off while this node starts; the
    processes it starts are then told 127.0.0.1 and bind there."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


#: Seconds ``init`` waits for a Ray head's port to accept a connection.
CONNECT_TIMEOUT = 10.0


def _check_reachable(address: str) -> None:
    """Fail within ``CONNECT_TIMEOUT`` naming the address when nothing listens there
    (``ray.init`` itself would retry for minutes); "auto" is left to Ray."""
    if address.strip() == "auto":
        return
    target = address.strip().split("://", 1)[-1]
    host, sep, port_text = target.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(
            f"address: {address!r} is invalid; expected 'auto' or 'host:port' of a running "
            "Ray head (for example '127.0.0.1:6380')"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port_text)), CONNECT_TIMEOUT):
            pass
    except OSError as err:
        raise ConnectionError(
            f"address: no Ray head answers at {address} ({err}); start one with `ray start "
            "--head --port=PORT`, or pass address=None for an embedded Ray"
        ) from None


def _place_workers(
    started: bool,
    temp_dir: str | None,
    num_hosts: int | None,
    num_cpu_devices: int | None,
    span_hosts: bool | None,
) -> RaySession:
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from ..runtime.ray_worker import HostWorker

    gpu_nodes = gpu_node_counts(ray.nodes())
    if gpu_nodes:
        if num_hosts is not None and num_hosts != len(gpu_nodes):
            raise ConfigError(
                f"num_hosts: {num_hosts} was given but the Ray cluster has {len(gpu_nodes)} "
                "GPU nodes; leave it out to use every GPU node"
            )
        bundles = [{"CPU": 1, "GPU": g} for g in gpu_nodes]
        strategy, cpu_devices = "STRICT_SPREAD", None
    else:
        hosts = DEFAULT_CPU_HOSTS if num_hosts is None else positive_int("num_hosts", num_hosts)
        cpu_devices = (
            DEFAULT_CPU_DEVICES_PER_HOST
            if num_cpu_devices is None
            else positive_int("num_cpu_devices", num_cpu_devices)
        )
        bundles = [{"CPU": 1}] * hosts
        strategy = "PACK"
    pg = placement_group(bundles, strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=START_TIMEOUT)
    except Exception as err:
        ray.util.remove_placement_group(pg)
        raise RuntimeError(
            f"init(cluster='ray'): Ray could not reserve {bundles} ({strategy}) within "
            f"{START_TIMEOUT:.0f} s: {err}"
        ) from None
    actor = ray.remote(HostWorker)
    workers = []
    for host, bundle in enumerate(bundles):
        options: dict[str, Any] = {
            "num_cpus": 1,
            "num_gpus": bundle.get("GPU", 0),
            "max_restarts": 0,
            "max_concurrency": 4,  # deliver() must run while run_step() waits in a Recv
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=host
            ),
        }
        env: dict[str, str] = {}
        if cpu_devices is not None:
            env["JAX_PLATFORMS"] = "cpu"
        if started:
            # An embedded Ray runs on this machine: let the workers import what the driver
            # can (a script's or a test's own modules hold the step functions they run).
            env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        if env:
            options["runtime_env"] = {"env_vars": env}
        workers.append(actor.options(**options).remote(host, cpu_devices))
    span = (len(gpu_nodes) > 1) if span_hosts is None else span_hosts and len(bundles) > 1
    try:
        coordinator = None
        if span:  # worker 0's process hosts the group's coordination service
            coordinator = ray.get(workers[0].free_address.remote(started), timeout=START_TIMEOUT)
        starts = [w.start.remote(coordinator, len(workers)) for w in workers]
        ray.get(starts, timeout=START_TIMEOUT)
        info = ray.get([w.info.remote() for w in workers], timeout=START_TIMEOUT)
        cluster = describe_workers(info)
    except BaseException:
        for w in workers:
            ray.kill(w, no_restart=True)
        ray.util.remove_placement_group(pg)
        raise
    ray.get([w.set_peers.remote(workers) for w in workers], timeout=START_TIMEOUT)
    return RaySession(cluster, workers, pg, started, temp_dir, info, span)


def gpu_node_counts(nodes: list[dict[str, Any]]) -> list[int]:
    """GPUs of every live node that has any (``ray.nodes()`` records)."""
    return [
        int(n["Resources"]["GPU"])
        for n in nodes
        if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) >= 1
    ]


def describe_workers(info: list[dict[str, Any]]) -> ClusterSpec:
    """A ``ClusterSpec`` of the workers' devices: each worker is one host."""
    devices = [
        SimpleNamespace(
            process_index=w["host"],
            platform=d["platform"],
            device_kind=d["device_kind"],
            memory_stats=(lambda limit=d["bytes_limit"]: {"bytes_limit": limit} if limit else {}),
        )
        for w in info
        for d in w["devices"]
    ]
    return ClusterSpec.detect(devices)
