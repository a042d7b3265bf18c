"""Sessions: ``init``/``shutdown`` of the local CPU test mode (``local``) or a Ray cluster
(``ray``: embedded or connected). In: a cluster name, spec or address. Out: the current
``ClusterSpec`` and, on Ray, the host workers."""

from .._lazy import lazy_exports

_LAZY = {
    name: "local"
    for name in ("current_cluster", "init", "is_initialized", "ray_session", "shutdown")
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
