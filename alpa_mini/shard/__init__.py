"""Intra-operator parallelism: sharding specs, per-operator strategies, the cost model, the
ILP problem built from an ``OpGraph`` and read back into a ``ShardingPlan``, its
explanation, lowering to a sharded jitted function and the ``Executable``. Imports nothing
from ``pipeline``."""

from .._lazy import lazy_exports

_LAZY = {
    "CostModel": "cost_model",
    "Executable": "executable",
    "ShardingPlan": "plan",
    "ShardingSpec": "spec",
    "plan_sharding": "problem",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
