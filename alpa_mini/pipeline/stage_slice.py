"""The one definition of a pipeline stage: a contiguous equation range of the flat forward,
the values crossing its edges, which of them carry cotangents, and the bytes it hands on.

The planner prices a stage's forward + backward from this and lowering builds the same
programs from it, so what the ILP prices is what runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax.extend.core import Jaxpr, Literal

__all__ = ["StageSlice", "is_float", "slice_stage"]


@dataclass(frozen=True, eq=False)
class StageSlice:
    """Equations ``[start, end)`` of the flat forward and the variables crossing its edges.

    ``invars``: read here, defined outside (loss inputs, constants, earlier slices), in first-
    read order; ``outvars``: defined here and read later (by a later slice or as a loss
    output). ``diff_in``/``nondiff_in`` split the non-constant ``invars``, ``diff_out``/
    ``nondiff_out`` the ``outvars``, by whether a cotangent flows through them (see
    ``slice_stage``). ``boundary_bytes``: what the stage sends on per micro-batch.
    """

    start: int
    end: int
    eqns: tuple[Any, ...]
    invars: tuple[Any, ...]
    outvars: tuple[Any, ...]
    diff_in: tuple[Any, ...] = ()
    nondiff_in: tuple[Any, ...] = ()
    diff_out: tuple[Any, ...] = ()
    nondiff_out: tuple[Any, ...] = ()
    boundary_bytes: float = 0.0


def is_float(aval: Any) -> bool:
    """Whether values of ``aval`` can carry a cotangent (floating or complex)."""
    return bool(jnp.issubdtype(aval.dtype, jnp.inexact))


def slice_stage(
    jaxpr: Jaxpr, start: int, end: int, diff_inputs: Sequence[bool] | None = None
) -> StageSlice:
    """The stage of equations ``[start, end)`` of the flat forward ``jaxpr``.

    ``diff_inputs[j]``: whether the loss differentiates its input ``j`` (``GradCapture.diff``;
    None: every float input). An input from an earlier stage is differentiable iff it is a
    float; an output iff it is a float read by a later equation (a later stage, which takes it
    as a differentiable input) or it is the loss value itself. Auxiliary loss outputs that no
    later equation reads carry no cotangent. The last slice also hands on the loss outputs that
    no equation of it defines.
    """
    eqns = tuple(jaxpr.eqns[start:end])
    defined: set[Any] = set()
    reads: list[Any] = []
    seen: set[Any] = set()
    for eqn in eqns:
        for v in eqn.invars:
            if isinstance(v, Literal) or v in defined or v in seen:
                continue
            seen.add(v)
            reads.append(v)
        defined.update(eqn.outvars)
    read_later: set[Any] = set()
    for eqn in jaxpr.eqns[end:]:
        read_later.update(v for v in eqn.invars if not isinstance(v, Literal))
    final = [v for v in jaxpr.outvars if not isinstance(v, Literal)]
    later = read_later | set(final)
    outs = [v for eqn in eqns for v in eqn.outvars if v in later and not _is_drop(v)]
    last = end == len(jaxpr.eqns)
    if last:  # loss outputs defined before this slice pass through it
        for v in final:
            if v not in defined and v not in outs:
                if v not in seen:
                    seen.add(v)
                    reads.append(v)
                outs.append(v)
    outvars = tuple(dict.fromkeys(outs))

    loss_in = {v: j for j, v in enumerate(jaxpr.invars)}
    consts = set(jaxpr.constvars)
    diff_in, nondiff_in = [], []
    for v in reads:
        if v in consts:
            continue
        j = loss_in.get(v)
        diff = is_float(v.aval) if j is None or diff_inputs is None else diff_inputs[j]
        (diff_in if diff else nondiff_in).append(v)
    value = jaxpr.outvars[0] if jaxpr.outvars else None
    diff_out = [v for v in outvars if is_float(v.aval) and (v in read_later or v is value)]
    nondiff_out = [v for v in outvars if not any(v is d for d in diff_out)]
    sent = 0.0 if last else sum(_nbytes(v.aval) for v in outvars)
    return StageSlice(
        start, end, eqns, tuple(reads), outvars,
        tuple(diff_in), tuple(nondiff_in), tuple(diff_out), tuple(nondiff_out), sent,
    )  # fmt: skip


def _nbytes(aval: Any) -> float:
    return float(math.prod(aval.shape) * aval.dtype.itemsize)


def _is_drop(v: Any) -> bool:
    return type(v).__name__ == "DropVar"
