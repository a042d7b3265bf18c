"""Micro-benchmarks of the local devices: matmul and elementwise throughput per number of busy
devices, and all-reduce / all-gather / reduce-scatter / all-to-all times per group size, fitted
into a ``ProfileDB`` (``alpa_mini.cluster.profile_db``) that replaces the cluster's nominal figures.

    db = alpa_mini.profile_devices()          # about a minute on 8 simulated CPU devices
    cluster = alpa_mini.ClusterSpec.detect().with_profile(db)

Every figure is the median of ``repeats`` timed calls after one warm-up call (compilation
excluded), each waiting for its result.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .profile_db import (
    COLLECTIVE_KINDS,
    CollectiveFit,
    ComputeFit,
    ProfileDB,
    byte_factor,
    fit_alpha_beta,
)

__all__ = ["measure_collective", "measure_compute", "profile_devices"]

#: Per-device matmul sizes (m = k = n), small to large: the small ones fix the per-kernel
#: overhead, the large ones the peak rate.
MATMUL_SIZES = (32, 64, 128, 256, 512, 1024)
#: Per-device float32 elements of the elementwise benchmark (256 KiB to 4 MiB: activations of
#: the size stage programs touch; larger buffers measure page faults more than bandwidth).
ELEMENTWISE_ELEMS = (1 << 16, 1 << 18, 1 << 20)
#: Per-device buffer bytes of the collective benchmarks.
COLLECTIVE_BYTES = (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)


def _median_seconds(fn: Callable[..., Any], args: Sequence[Any], repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _mesh(devices: Sequence[Any]) -> Mesh:
    return Mesh(np.asarray(devices, dtype=object), ("x",))


def measure_compute(devices: Sequence[Any], *, repeats: int = 5) -> ComputeFit:
    """Per-device throughput while all of ``devices`` run the same program, each on its own
    shard (what one SPMD stage program does): the launch overhead (``x + 1`` on a few
    elements); matmul time over ``MATMUL_SIZES`` fitted as alpha + flops / peak (alpha, less
    the launch, is the per-kernel overhead); elementwise bandwidth and the op-class rates
    with the launch taken out."""
    n = len(devices)
    sharding = NamedSharding(_mesh(devices), PartitionSpec("x"))
    tiny = jax.device_put(jnp.ones((n, 8), jnp.float32), sharding)
    launch = _median_seconds(jax.jit(lambda x: x + 1.0, out_shardings=sharding), (tiny,), repeats)
    matmul = jax.jit(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), out_shardings=sharding)
    flops, times = [], []
    for m in MATMUL_SIZES:
        a = jax.device_put(jnp.ones((n, m, m), jnp.float32), sharding)
        times.append(_median_seconds(matmul, (a, a), repeats))
        flops.append(2.0 * m**3)
    alpha, beta = fit_alpha_beta(flops, times)
    peak = 1.0 / beta if beta > 0 else max(f / t for f, t in zip(flops, times, strict=True))
    axpy = jax.jit(lambda x, y: x * 1.5 + y, out_shardings=sharding)
    bandwidths = []
    for elems in ELEMENTWISE_ELEMS:
        x = jax.device_put(jnp.ones((n, elems), jnp.float32), sharding)
        seconds = _median_seconds(axpy, (x, x), repeats) - launch
        bandwidths.append(3.0 * 4 * elems / max(seconds, 1e-9))
    return ComputeFit(
        n,
        peak,
        statistics.median(bandwidths),
        launch,
        max(alpha - launch, 0.0),
        _class_rates(sharding, n, launch, repeats),
    )


def _class_rates(
    sharding: NamedSharding, n: int, launch: float, repeats: int
) -> tuple[tuple[str, float], ...]:
    """Elements per second per device of a transcendental (``tanh``) and of a row reduction
    (``sum``), the median over the elementwise benchmark's sizes."""
    programs = {
        "reduction": jax.jit(lambda x: jnp.sum(x.reshape(n, -1, 256), axis=-1)),
        "transcendental": jax.jit(jnp.tanh, out_shardings=sharding),
    }
    out = []
    for name, program in programs.items():
        rates = []
        for elems in ELEMENTWISE_ELEMS:
            x = jax.device_put(jnp.ones((n, elems), jnp.float32), sharding)
            seconds = _median_seconds(program, (x,), repeats) - launch
            rates.append(elems / max(seconds, 1e-9))
        out.append((name, statistics.median(rates)))
    return tuple(sorted(out))


def _collective_program(kind: str, mesh: Mesh) -> Callable[[jax.Array], jax.Array]:
    spec = PartitionSpec("x")
    if kind == "all-reduce":

        def body(x: jax.Array) -> jax.Array:
            return jax.lax.psum(x, "x")

    elif kind == "all-gather":

        def body(x: jax.Array) -> jax.Array:
            return jax.lax.all_gather(x, "x", tiled=True)

    elif kind == "reduce-scatter":

        def body(x: jax.Array) -> jax.Array:
            return jax.lax.psum_scatter(x, "x", tiled=True)

    elif kind == "all-to-all":

        def body(x: jax.Array) -> jax.Array:
            return jax.lax.all_to_all(x, "x", 0, 0, tiled=True)

    else:
        raise ValueError(f"kind: {kind!r} is not one of {', '.join(COLLECTIVE_KINDS)}")
    out = PartitionSpec(None) if kind == "all-gather" else spec
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=out, check_vma=False))


def measure_collective(
    devices: Sequence[Any],
    kind: str,
    *,
    sizes: Sequence[int] = COLLECTIVE_BYTES,
    repeats: int = 5,
) -> CollectiveFit:
    """Time ``kind`` over ``devices`` at each per-device buffer size in ``sizes`` (for an
    all-gather, the gathered result's size, as the cost model counts it; for the others the
    input's) and fit
    ``alpha + beta * byte_factor * bytes``."""
    n = len(devices)
    if n < 2:
        raise ValueError(f"devices: a collective needs 2 or more, got {n}")
    mesh = _mesh(devices)
    program = _collective_program(kind, mesh)
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    xs, ts = [], []
    for nbytes in sizes:
        # Per-device elements, a multiple of n (all-to-all splits the shard n ways).
        elems = max(n, (nbytes // 4) // n * n)
        local = elems // n if kind == "all-gather" else elems
        x = jax.device_put(jnp.ones((n * local,), jnp.float32), sharding)
        ts.append(_median_seconds(program, (x,), repeats))
        xs.append(byte_factor(kind, n) * 4.0 * elems)
    alpha, beta = fit_alpha_beta(xs, ts)
    return CollectiveFit(kind, n, alpha, beta)


def profile_devices(
    devices: Sequence[Any] | None = None,
    *,
    busy_counts: Sequence[int] | None = None,
    group_sizes: Sequence[int] | None = None,
    kinds: Sequence[str] = COLLECTIVE_KINDS,
    repeats: int = 5,
) -> ProfileDB:
    """Measure the local ``devices`` (default: all) and fit a ``ProfileDB``.

    ``busy_counts``: how many devices compute at once (default: powers of two up to all);
    ``group_sizes``: collective group sizes (default: the busy counts from 2). Groups are the
    first devices in order, as a stage's submesh takes them.
    """
    devices = list(jax.devices() if devices is None else devices)
    powers = [2**i for i in range(len(devices).bit_length()) if 2**i <= len(devices)]
    busy_counts = list(busy_counts or powers)
    group_sizes = list(group_sizes or [n for n in powers if n >= 2])
    for where, counts in (("busy_counts", busy_counts), ("group_sizes", group_sizes)):
        bad = [c for c in counts if not 1 <= c <= len(devices)]
        if bad:
            raise ValueError(f"{where}: {bad[0]!r} is invalid; expected 1..{len(devices)}")
    compute = tuple(measure_compute(devices[:n], repeats=repeats) for n in busy_counts)
    collectives = tuple(
        measure_collective(devices[:n], kind, repeats=repeats)
        for n in group_sizes
        if n >= 2
        for kind in kinds
    )
    kind = devices[0].device_kind if devices[0].platform != "cpu" else "cpu"
    machine = (
        f"{len(devices)} {devices[0].platform} devices on {platform.node() or 'a host'} "
        f"({platform.machine()}), jax {jax.__version__}, "
        f"{datetime.date.today().isoformat()}"
    )
    return ProfileDB(kind, compute, collectives, machine)
