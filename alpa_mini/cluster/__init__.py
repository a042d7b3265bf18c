"""Hardware descriptions: ``ClusterSpec`` (hosts, devices, links) from bundled or user YAML,
``LogicalMesh`` over a submesh, the profile database of measured costs, and the device
micro-benchmarks that fill it. Imports no JAX until ``profile_devices`` is used."""

from .._lazy import lazy_exports
from .profile_db import ProfileDB
from .spec import ClusterSpec, DeviceKind, Link, LogicalMesh, available_clusters

__all__ = [
    "ClusterSpec",
    "DeviceKind",
    "Link",
    "LogicalMesh",
    "ProfileDB",
    "available_clusters",
    "profile_devices",
]
__getattr__, __dir__ = lazy_exports(__name__, {"profile_devices": "microbench"})
