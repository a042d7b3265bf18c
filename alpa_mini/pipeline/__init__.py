"""Inter-operator parallelism: layers, stage slices, stage costs, the stage search, the
``PipeshardPlan``, schedules and their simulation, lowering to per-stage programs and
instruction streams, and the local and Ray executables."""

from .._lazy import lazy_exports

_LAZY = {
    "PipeshardExecutable": "executable",
    "PipeshardPlan": "plan",
    "StagePlan": "plan",
    "Schedule": "schedules",
    "make_schedule": "schedules",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
