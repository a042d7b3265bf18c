"""Process-wide device setup: ``init`` picks the cluster the planner plans for.

``init(cluster="local", num_cpu_devices=8)`` is the CPU test mode of DESIGN.md section 7: it
sets JAX's ``jax_num_cpu_devices`` before the backend starts, so one process gets 8 simulated
CPU devices, and describes the live devices with ``ClusterSpec.detect()``. With a bundled
cluster name, a YAML path or a ``ClusterSpec``, that description is what the planner assumes
(the devices themselves still come from JAX, and there must be enough of them).

JAX fixes its CPU device count when its backend starts (the first ``jax.devices()``, array or
computation), and a process cannot restart it: call ``init`` before any JAX work, or restart
the process. ``shutdown()`` only forgets the current cluster; the backend stays up.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

from ..cluster.spec import ClusterSpec, _looks_like_path, available_clusters
from ..errors import ConfigError

__all__ = [
    "NUM_CPU_DEVICES_ENV",
    "current_cluster",
    "init",
    "is_initialized",
    "ray_session",
    "shutdown",
]

NUM_CPU_DEVICES_ENV = "ALPA_MINI_NUM_CPU_DEVICES"

_lock = threading.Lock()
_current: ClusterSpec | None = None
_ray: Any = None  # the RaySession of init(cluster="ray")


def init(
    cluster: str | os.PathLike[str] | ClusterSpec = "local",
    *,
    num_cpu_devices: int | None = None,
    address: str | None = None,
    num_hosts: int | None = None,
    span_hosts: bool | None = None,
) -> ClusterSpec:
    """Set up the local JAX devices and the cluster description; return the ClusterSpec.

    Args:
      cluster: ``"local"`` (describe the live JAX devices: one host in CPU test mode), a
        bundled cluster name (see ``available_clusters()``), the path of a cluster YAML, or
        a ``ClusterSpec``. A description must not have more devices than JAX has.
      num_cpu_devices: how many CPU devices JAX's CPU backend should have. ``None`` reads
        the environment variable ``ALPA_MINI_NUM_CPU_DEVICES`` (unset or empty: leave JAX's
        own setting alone). It is applied before the backend starts; if the backend already
        runs with this many CPU devices that is accepted, with another count it is an error.

      address, num_hosts: only with ``cluster="ray"`` (see ``alpa_mini.session.ray``):
        ``address=None`` starts an embedded Ray on loopback, ``"auto"``/``"host:port"``
        connects to a running head. Without GPUs this is the CPU test mode: ``num_hosts``
        simulated hosts (default 2), each a Ray actor with ``num_cpu_devices`` CPU devices
        (default 4). The returned ClusterSpec describes the workers' live devices.
      span_hosts: only with ``cluster="ray"``: join the host workers into one
        ``jax.distributed`` group so that a stage mesh may span hosts. ``None``: on with
        several GPU nodes, off in the CPU test mode (gloo slows every collective there).

    Calling ``init`` again replaces the current cluster (the device count rules still hold).

    Raises:
      ConfigError: a bad ``cluster`` value or file, a bad device count, or a description
        with more devices than JAX has.
      RuntimeError: JAX's backend already started with a different number of CPU devices.
    """
    global _current, _ray
    if cluster == "ray":
        from .ray import start_ray_session

        with _lock:
            _close_ray()
            _ray = start_ray_session(
                address,
                num_hosts=num_hosts,
                num_cpu_devices=num_cpu_devices,
                span_hosts=span_hosts,
            )
            _current = _ray.cluster
            return _current
    if address is not None or num_hosts is not None or span_hosts is not None:
        raise ConfigError(
            f"address/num_hosts/span_hosts: only used with cluster='ray', not cluster={cluster!r}"
        )
    count = _cpu_device_count(num_cpu_devices)
    described = _describe(cluster)  # validate everything before touching JAX
    with _lock:
        if count is not None:
            _set_cpu_device_count(count)
        if described is None:
            spec = ClusterSpec.detect()
        else:
            import jax

            have = jax.device_count()
            if described.num_devices > have:
                raise ConfigError(
                    f"cluster {described.name!r} describes {described.num_devices} devices "
                    f"({described.num_hosts} hosts x {described.devices_per_host}) but JAX "
                    f"has {have}"
                    + (
                        f"; for CPU test mode pass num_cpu_devices={described.num_devices} "
                        f"(or set {NUM_CPU_DEVICES_ENV})"
                        if jax.default_backend() == "cpu"
                        else ""
                    )
                )
            spec = described
        _current = spec
        return spec


def shutdown() -> None:
    """Forget the current cluster (idempotent).

    JAX's backend cannot be un-started: its devices and CPU device count stay as they are
    for the rest of the process, so a later ``init`` must ask for the same CPU device count.
    After ``init(cluster="ray")`` it also kills the host workers, removes their placement
    group and disconnects from Ray (stopping it if ``init`` started it).
    """
    global _current
    with _lock:
        _current = None
        _close_ray()


def ray_session() -> Any:
    """The ``RaySession`` of ``init(cluster="ray")`` (workers, placement group), or None."""
    return _ray


def _close_ray() -> None:
    """Close the Ray session; first let checkpoint saves in flight finish, as their
    workers are about to go (a save that cannot finish is a warning, not lost silently)."""
    global _ray
    if _ray is not None:
        from .checkpoint import wait_for_checkpoints

        try:
            wait_for_checkpoints()
        except Exception as err:  # shutdown must still close the session
            warnings.warn(f"shutdown(): {err}", RuntimeWarning, stacklevel=3)
        session, _ray = _ray, None
        session.close()


def current_cluster() -> ClusterSpec:
    """The ClusterSpec that ``init`` set up; RuntimeError if ``init`` has not been called."""
    spec = _current
    if spec is None:
        raise RuntimeError(
            "alpa_mini.init() has not been called; call "
            "alpa_mini.init(cluster='local', num_cpu_devices=8) first"
        )
    return spec


def is_initialized() -> bool:
    """Whether ``init`` has been called (and ``shutdown`` not since)."""
    return _current is not None


# ---------------------------------------------------------------------- helpers
def _valid_values() -> str:
    return (
        f"'local', 'ray', a bundled cluster name ({', '.join(available_clusters())}), "
        "the path of a cluster YAML, or a ClusterSpec"
    )


def _describe(cluster: object) -> ClusterSpec | None:
    """The ClusterSpec ``cluster`` names, or None for ``"local"`` (detect the devices)."""
    if isinstance(cluster, ClusterSpec):
        return cluster
    if cluster == "local":
        return None
    if isinstance(cluster, os.PathLike) or (
        isinstance(cluster, str) and (cluster in available_clusters() or _looks_like_path(cluster))
    ):
        return ClusterSpec.load(cluster)
    raise ConfigError(f"cluster={cluster!r} is not supported; valid values: {_valid_values()}")


def _cpu_device_count(num_cpu_devices: int | None) -> int | None:
    """The requested CPU device count: the argument, else the environment, else None."""
    if num_cpu_devices is not None:
        if (
            isinstance(num_cpu_devices, bool)
            or not isinstance(num_cpu_devices, int)
            or num_cpu_devices < 1
        ):
            raise ConfigError(
                f"num_cpu_devices: {num_cpu_devices!r} is invalid; expected an integer >= 1"
            )
        return num_cpu_devices
    raw = os.environ.get(NUM_CPU_DEVICES_ENV, "").strip()
    if not raw:
        return None
    try:
        count = int(raw)
    except ValueError:
        count = 0
    if count < 1:
        raise ConfigError(
            f"{NUM_CPU_DEVICES_ENV}={raw!r} is invalid; expected an integer >= 1 "
            "(the number of simulated CPU devices)"
        )
    return count


def _backend_started() -> bool:
    """Whether JAX's backend has started, checked without starting it.

    Uses ``jax._src.xla_bridge.backends_are_initialized()`` (no public equivalent in JAX
    0.10); JAX's own ``jax_num_cpu_devices`` validator uses the same check.
    """
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def _set_cpu_device_count(count: int) -> None:
    import jax

    if not _backend_started():
        jax.config.update("jax_num_cpu_devices", count)
        return
    try:
        have = len(jax.local_devices(backend="cpu"))
    except RuntimeError as err:
        raise RuntimeError(
            f"num_cpu_devices={count} was requested but JAX's backend is already running "
            f"without a CPU backend ({err})"
        ) from None
    if have != count:
        raise RuntimeError(
            f"num_cpu_devices={count} was requested but JAX's backend already started with "
            f"{have} CPU devices; the count is fixed once JAX starts, so call "
            "alpa_mini.init() before any JAX computation (or restart the process)"
        )
