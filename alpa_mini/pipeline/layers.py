"""Cut a flat forward jaxpr into layers and layer ranges into stage slices.

The forward loss is first flattened (``jit``/``closed_call`` bodies inlined, so markers and
clustering see individual equations). Layers are contiguous equation ranges: cut at
``mark_pipeline_boundary()`` markers (a step without any: at its repeated blocks,
``solvers.repeated_blocks``), or chosen by ``solvers.layer_clustering`` (balanced flops,
fewest bytes crossing a cut). A stage is a contiguous range of layers (``stage_slice``).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from ..errors import ConfigError
from ..graph.jaxpr_walk import eqn_total_flops, subjaxprs
from ..graph.markers import MARKER_NAME
from ..options.pipeshard import AutoLayerOption, ManualLayerOption
from ..solvers.errors import InfeasibleError
from ..solvers.layer_clustering import cluster_layers, cut_bytes_from_tensors
from ..solvers.repeated_blocks import block_layer_starts, find_repeated_blocks

__all__ = [
    "cluster_layer_starts",
    "layer_hash",
    "layer_starts",
    "layer_starts_and_eps",
    "marker_layer_starts",
]


def marker_layer_starts(jaxpr: Jaxpr) -> tuple[int, ...]:
    """Layer start indices from ``mark_pipeline_boundary`` equations (a layer ends after a
    marker); markers at the very start or end add no empty layer. A marker nested inside a
    ``scan``, ``while``, ``cond`` or ``checkpoint`` body cannot cut the loss and is refused."""
    for i, eqn in enumerate(jaxpr.eqns):
        if any(_has_marker(sub) for sub in subjaxprs(eqn)):
            raise ConfigError(
                f"mark_pipeline_boundary(): called inside a {eqn.primitive.name} body (loss "
                f"equation {i}), where it cannot cut the loss into layers; call it between "
                "the loop or remat block and its neighbours, or use AutoLayerOption (which cuts "
                "a scan over stacked layers between its iterations)"
            )
    n = len(jaxpr.eqns)
    starts = [0]
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name == MARKER_NAME and 0 < i + 1 < n and i + 1 > starts[-1]:
            starts.append(i + 1)
    return tuple(starts)


#: The balance ``AutoLayerOption(eps=None)`` tries first.
DEFAULT_EPS = 0.1


def _has_marker(jaxpr: Jaxpr) -> bool:
    return any(
        e.primitive.name == MARKER_NAME or any(_has_marker(s) for s in subjaxprs(e))
        for e in jaxpr.eqns
    )


def cluster_layer_starts(
    jaxpr: Jaxpr, num_layers: int, eps: float | None = DEFAULT_EPS
) -> tuple[tuple[int, ...], float]:
    """Layer starts chosen by ``solvers.layer_clustering``: flops within (1+eps)·mean per layer
    while the largest activation crossing a cut is as small as possible; and the eps used.
    ``eps=None`` relaxes ``DEFAULT_EPS`` to the smallest eps that works when it does not."""
    eqns = jaxpr.eqns
    n = len(eqns)
    if n == 0:
        raise ValueError("layer_option: the loss function has no equations to split into layers")
    num_layers = min(num_layers, n)
    flops = np.array([eqn_total_flops(e) for e in eqns], dtype=np.float64)
    # Every equation weighs at least a little, so zero-flop stretches still get balanced.
    flops = np.maximum(flops, 1e-3 * max(float(flops.sum()), 1.0) / n)
    cuts = _cut_bytes(jaxpr)
    used = DEFAULT_EPS if eps is None else eps
    try:
        result = cluster_layers(flops, cuts, num_layers, used)
    except InfeasibleError as err:
        min_eps = (err.details or {}).get("min_eps")
        if eps is not None or min_eps is None or not math.isfinite(min_eps):
            raise
        used = float(min_eps) * (1 + 1e-9) + 1e-12  # the bound itself, past rounding
        result = cluster_layers(flops, cuts, num_layers, used)
    return tuple(int(s) for s in result.layer_starts), used


def _cut_bytes(jaxpr: Jaxpr) -> np.ndarray:
    """Bytes crossing the boundary after each equation but the last (values made before it
    and read after it, or returned)."""
    eqns, n = jaxpr.eqns, len(jaxpr.eqns)
    producer: dict[Any, int] = {}
    last_use: dict[Any, int] = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if not isinstance(v, Literal) and v in producer:
                last_use[v] = i
        for v in eqn.outvars:
            producer[v] = i
    for v in jaxpr.outvars:
        if not isinstance(v, Literal) and v in producer:
            last_use[v] = n
    vars_ = [v for v in producer if v in last_use]
    sizes = [v.aval.size * v.aval.dtype.itemsize for v in vars_]
    if n <= 1:
        return np.zeros(0)
    return cut_bytes_from_tensors(
        n, [producer[v] for v in vars_], [last_use[v] for v in vars_], sizes
    )


def repeated_block_starts(jaxpr: Jaxpr) -> tuple[int, ...] | None:
    """Layer starts of a step without markers whose loss applies blocks several times in a
    row (a Python loop over layers): one layer per block, and one per stretch between runs
    of alike blocks (``solvers.repeated_blocks``); None where the runs hold less than half
    the flops. Equations compare by primitive, parameters and shapes, but not by where a
    ``slice`` starts: block i reading ``W[i]`` of a stacked weight or ``keys[i]`` of split
    keys is the same block at another index."""
    eqns = jaxpr.eqns
    if len(eqns) < 2:
        return None
    ids: dict[str, int] = {}
    sig = [
        ids.setdefault(
            f"{_op_text(e, _POSITIONS.get(e.primitive.name, ()))}"
            f"({','.join(_aval_text(v.aval) for v in e.invars)})"
            f"->({','.join(_aval_text(v.aval) for v in e.outvars)})",
            len(ids),
        )
        for e in eqns
    ]
    flops = [eqn_total_flops(e) for e in eqns]
    runs = find_repeated_blocks(sig, _cut_bytes(jaxpr), flops)
    return block_layer_starts(runs, len(eqns)) if runs else None


@functools.lru_cache(maxsize=1 << 14)
def _cached_text(aval: Any) -> str:
    return aval.str_short()


def _aval_text(aval: Any) -> str:
    """``aval.str_short()``, which layer hashes spell every variable with: most of their
    time uncached, while a model has few distinct avals."""
    try:
        return _cached_text(aval)
    except TypeError:  # an unhashable abstract value
        return aval.str_short()


_LITERAL_TEXT: dict[tuple[type, str, tuple[int, ...], bytes], str] = {}


def _literal_text(val: Any) -> str:
    """``repr`` of a literal's value, cached by type, dtype, shape and bytes (numpy's printing is
    slow and a model has few distinct literals; equal floats such as 0.0 and -0.0 print
    differently, so value equality is not the key)."""
    try:
        arr = np.asarray(val)
        key = (type(val), str(getattr(val, "dtype", "")), arr.shape, arr.tobytes())
    except (TypeError, ValueError):
        return repr(val)
    text = _LITERAL_TEXT.get(key)
    if text is None:
        if len(_LITERAL_TEXT) >= 1 << 12:
            _LITERAL_TEXT.clear()
        text = _LITERAL_TEXT[key] = repr(val)
    return text


# Parameters that say where an equation reads, not what it computes: block signatures and
# the stage model's ILP keys leave them out; the hash that shares a layer's jitted function
# keeps them, since that function reads at them.
_POSITIONS = {"slice": ("start_indices", "limit_indices")}


def _op_text(eqn: Any, skip: tuple[str, ...] = ()) -> str:
    """An equation's primitive and parameters (less ``skip``), as layer hashes and block
    signatures spell them."""
    params = sorted((kv for kv in eqn.params.items() if kv[0] not in skip), key=lambda kv: kv[0])
    return f"{eqn.primitive.name}[{params!r}]"


def layer_hash(
    eqns: Sequence[Any],
    invars: Sequence[Any],
    outvars: Sequence[Any] = (),
    *,
    positions: bool = True,
) -> str:
    """A structural hash of a run of equations and the values it hands on: equal for layers
    that differ only in which variables they read (the same block on other parameters).
    ``positions=False`` also leaves out where slices start (``w[i]`` of a stacked weight),
    which a layer's costs and layouts do not depend on but its jitted function does."""
    skip = {} if positions else _POSITIONS
    names: dict[Any, str] = {}

    def name(v: Any) -> str:
        if isinstance(v, Literal):
            return f"lit({_literal_text(v.val)}:{_aval_text(v.aval)})"
        if v not in names:
            names[v] = f"v{len(names)}:{_aval_text(v.aval)}"
        return names[v]

    parts = [",".join(name(v) for v in invars)]
    for eqn in eqns:
        parts.append(
            f"{_op_text(eqn, skip.get(eqn.primitive.name, ()))}"
            f"({','.join(name(v) for v in eqn.invars)})"
            f"->({','.join(name(v) for v in eqn.outvars)})"
        )
    parts.append("out:" + ",".join(name(v) for v in outvars))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def layer_starts(
    forward: ClosedJaxpr, option: AutoLayerOption | ManualLayerOption
) -> tuple[int, ...]:
    """Equation index where each layer starts: clustered, or at the user's markers."""
    return layer_starts_and_eps(forward, option)[0]


def layer_starts_and_eps(
    forward: ClosedJaxpr, option: AutoLayerOption | ManualLayerOption
) -> tuple[tuple[int, ...], float | None]:
    """``layer_starts`` and the flop balance eps the clustering used (None for markers). A
    step without markers is cut at its repeated blocks where it has them."""
    if isinstance(option, AutoLayerOption):
        return cluster_layer_starts(forward.jaxpr, option.layer_num, option.eps)
    starts = marker_layer_starts(forward.jaxpr)
    if len(starts) == 1 and not _has_marker(forward.jaxpr):
        starts = repeated_block_starts(forward.jaxpr) or starts
    return starts, None
