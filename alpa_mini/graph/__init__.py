"""From a traced train step to what the planners read: the ``OpGraph`` (nodes, tensors,
flops, bytes), pipeline markers, gradient capture and micro-batching. Imports nothing from
``shard`` or ``pipeline``."""

from .._lazy import lazy_exports

_LAZY = {"OpGraph": "op_graph", "trace_jaxpr": "tracing"}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
