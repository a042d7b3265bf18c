"""``mark_pipeline_boundary()``: a user's hint where one pipeline layer ends and the next begins.

The marker is an identity primitive. Inside a ``PipeshardParallel`` step the layer builder cuts
the forward program at every marker; everywhere else (plain ``jax.jit``, ``ShardParallel``,
``jax.grad``) it costs nothing: the tracer and the lowering skip it, XLA never sees it.
"""

from __future__ import annotations

from typing import Any

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["MARKER_NAME", "mark_pipeline_boundary", "pipeline_boundary_p"]

MARKER_NAME = "alpa_pipeline_boundary"

pipeline_boundary_p = Primitive(MARKER_NAME)
pipeline_boundary_p.multiple_results = True
pipeline_boundary_p.def_impl(lambda *args: list(args))
pipeline_boundary_p.def_abstract_eval(lambda *avals: list(avals))
mlir.register_lowering(pipeline_boundary_p, lambda ctx, *args: list(args))


def _jvp(primals: Any, tangents: Any) -> tuple[list[Any], list[Any]]:
    return pipeline_boundary_p.bind(*primals), list(tangents)


ad.primitive_jvps[pipeline_boundary_p] = _jvp
ad.primitive_transposes[pipeline_boundary_p] = lambda cts, *args: list(cts)
batching.primitive_batchers[pipeline_boundary_p] = lambda args, dims: (
    pipeline_boundary_p.bind(*args),
    dims,
)


def mark_pipeline_boundary(*values: Any) -> Any:
    """End the current pipeline layer here; returns its arguments unchanged.

    ``mark_pipeline_boundary()`` marks a position; ``x = mark_pipeline_boundary(x)`` also pins
    the marker after ``x`` is computed (useful when the order of independent equations varies).
    """
    out = pipeline_boundary_p.bind(*values)
    if not values:
        return None
    return out[0] if len(values) == 1 else tuple(out)
