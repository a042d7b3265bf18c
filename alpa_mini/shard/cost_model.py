"""Analytic costs on one logical mesh: roofline compute, alpha-beta collectives, resharding.

Formulas (DESIGN 5.4). For a group of n devices exchanging a per-device buffer of B bytes:
all-reduce alpha + 2 beta (n-1)/n B; all-gather (B = the gathered result) and reduce-scatter
(B = the full input) alpha + beta (n-1)/n B; all-to-all alpha + beta (n-1)/n^2 B n/2 =
alpha + beta (n-1)/(2n) B. A collective over several mesh axes runs as one group of the
product size and pays the slowest axis's link (the one with the largest alpha and beta).

A cluster with a ``ProfileDB`` (``ClusterSpec.with_profile``) is priced with measured figures
instead: compute by the per-device throughput measured with as many devices busy as the mesh
has, and a collective by the alpha-beta fit for its kind and group size where the profile has
one (the same formulas, so only alpha and beta change).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..cluster.spec import ClusterSpec, LogicalMesh
from .spec import ShardingSpec

__all__ = ["CostModel"]


@dataclass(frozen=True)
class CostModel:
    """Costs in seconds for one (cluster, logical mesh) pair."""

    cluster: ClusterSpec
    mesh: LogicalMesh
    _reshard_cache: dict = field(default_factory=dict, repr=False, compare=False)
    #: Operator strategies priced on this mesh, by what they depend on (``problem``'s key):
    #: the layers planned on one mesh repeat most operators.
    op_strategies: dict = field(default_factory=dict, repr=False, compare=False)
    #: Resharding matrices between operators' strategy tuples (``problem._edges``).
    edge_matrices: dict = field(default_factory=dict, repr=False, compare=False)

    def carried(self) -> CostModel:
        """A fresh cost model of the same mesh keeping only what no tensor shape enters: the
        resharding steps of each pair of layout lists and the collective groups. Another
        micro-batch count's stage models start from it (``stage_cost.shared_cost_models``)."""
        kept = {k: v for k, v in self._reshard_cache.items() if k[0] in ("terms", "group")}
        return CostModel(self.cluster, self.mesh, kept)

    # ------------------------------------------------------------------ compute
    def compute(
        self, flops: float, bytes_accessed: float, dtype: str, parallel: int, primitive: str = ""
    ) -> float:
        """Roofline time of work split over ``parallel`` devices (the rest redo it); with a
        profile, ``primitive``'s class may have its own measured rate."""
        profile = self.cluster.profile
        if profile is not None:
            fit = profile.compute_for(self.mesh.num_devices)
            peak, bandwidth = fit.rate_for(primitive), fit.memory_bandwidth
        else:
            peak = self.cluster.device.flops_for(dtype)
            bandwidth = self.cluster.device.memory_bandwidth
        return max(flops / peak, bytes_accessed / bandwidth) / max(parallel, 1)

    def program_overhead(self, kernels: float, launches: int) -> float:
        """Fixed costs a roofline misses, from the profile: ``launches`` program starts and
        ``kernels`` kernels' own overhead on this mesh's devices (0 without a profile: the
        nominal figures have none)."""
        profile = self.cluster.profile
        if profile is None:
            return 0.0
        fit = profile.compute_for(self.mesh.num_devices)
        return launches * fit.launch_overhead + kernels * fit.kernel_overhead

    # ------------------------------------------------------------------ collectives
    def _group(self, axes: Sequence[int], kind: str) -> tuple[int, float, float]:
        """(group size, alpha, beta) of a ``kind`` collective over ``axes`` (cached: hot)."""
        key = ("group", tuple(axes), kind)
        found = self._reshard_cache.get(key)
        if found is None:
            found = self._reshard_cache[key] = self._group_uncached(key[1], kind)
        return found

    def _group_uncached(self, axes: Sequence[int], kind: str) -> tuple[int, float, float]:
        axes = [a for a in axes if self.mesh.shape[a] > 1]
        if not axes:
            return 1, 0.0, 0.0
        n = math.prod(self.mesh.shape[a] for a in axes)
        profile = self.cluster.profile
        fit = None if profile is None else profile.collective(kind, n)
        if fit is not None and not any(self.mesh.crosses_hosts[a] for a in axes):
            return n, fit.alpha, fit.beta
        return n, max(self.mesh.alphas[a] for a in axes), max(self.mesh.betas[a] for a in axes)

    def all_reduce(self, nbytes: float, axes: Sequence[int]) -> float:
        n, alpha, beta = self._group(axes, "all-reduce")
        return 0.0 if n == 1 else alpha + 2.0 * beta * (n - 1) / n * nbytes

    def all_gather(self, nbytes: float, axes: Sequence[int]) -> float:
        """``nbytes`` is the gathered (result) buffer per device."""
        n, alpha, beta = self._group(axes, "all-gather")
        return 0.0 if n == 1 else alpha + beta * (n - 1) / n * nbytes

    @property
    def native_reduce_scatter(self) -> bool:
        """XLA's CPU backend has no reduce-scatter: it all-reduces, then slices locally."""
        return self.cluster.device.name.lower() != "cpu"

    def reduce_scatter(self, nbytes: float, axes: Sequence[int]) -> float:
        """``nbytes`` is the full (input) buffer per device."""
        if not self.native_reduce_scatter:
            return self.all_reduce(nbytes, axes)
        n, alpha, beta = self._group(axes, "reduce-scatter")
        return 0.0 if n == 1 else alpha + beta * (n - 1) / n * nbytes

    def all_to_all(self, nbytes: float, axes: Sequence[int]) -> float:
        n, alpha, beta = self._group(axes, "all-to-all")
        return 0.0 if n == 1 else alpha + beta * (n - 1) / (2.0 * n) * nbytes

    # ------------------------------------------------------------------ resharding
    def reshard(
        self, shape: tuple[int, ...], itemsize: int, src: ShardingSpec, dst: ShardingSpec
    ) -> float:
        """Time to turn a tensor laid out as ``src`` into ``dst`` (see ``reshard_steps``)."""
        return sum(cost for _, _, _, cost in self.reshard_steps(shape, itemsize, src, dst))

    def reshard_table(
        self,
        shape: tuple[int, ...],
        itemsize: int,
        srcs: Sequence[ShardingSpec],
        dsts: Sequence[ShardingSpec],
    ) -> np.ndarray:
        """``reshard`` for every (src, dst) pair; the planner's hot loop. A pair's steps depend
        on the shape only through the tensor's bytes, so they are worked out once per pair
        of layout lists (every micro-batch size reuses them) and priced here per shape, in
        the same floating-point order as ``reshard``; whole tables are kept too (repeated
        layers ask for the same ones)."""
        table_key = ("table", tuple(shape), itemsize, tuple(srcs), tuple(dsts))
        table = self._reshard_cache.get(table_key)
        if table is not None:
            return table
        terms_key = ("terms", table_key[3], table_key[4])
        terms = self._reshard_cache.get(terms_key)
        if terms is None:
            terms = self._reshard_cache[terms_key] = self._step_terms(srcs, dsts)
        full = math.prod(shape) * itemsize
        table = np.zeros((len(srcs), len(dsts)))
        for alpha, coef, shards in terms:  # step k of every pair: alpha + coef * bytes seen
            table = table + (alpha + coef * (full / shards))
        self._reshard_cache[table_key] = table
        return table

    def _step_terms(
        self, srcs: Sequence[ShardingSpec], dsts: Sequence[ShardingSpec]
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per step index k, (alpha, coefficient, shards) arrays over (src, dst) pairs: step k
        costs ``alpha + coef * (bytes / shards)`` (0, 0, 1 where a pair has no step k or its
        group is one device, as ``_collective_terms`` prices it)."""
        per_pair = [[_step_plan(self, s, d) for d in dsts] for s in srcs]
        depth = max((len(p) for row in per_pair for p in row), default=0)
        out = []
        for k in range(depth):
            alpha, coef = np.zeros((len(srcs), len(dsts))), np.zeros((len(srcs), len(dsts)))
            shards = np.ones((len(srcs), len(dsts)))
            for i, row in enumerate(per_pair):
                for j, plan in enumerate(row):
                    if k < len(plan):
                        kind, axes, div = plan[k]
                        alpha[i, j], coef[i, j] = self._collective_terms(kind, axes)
                        shards[i, j] = div
            out.append((alpha, coef, shards))
        return out

    def _collective_terms(self, kind: str, axes: Sequence[int]) -> tuple[float, float]:
        """(alpha, coefficient) with ``kind``'s seconds = alpha + coefficient * nbytes, written
        as ``all_gather`` and ``all_to_all`` compute them, so the sums agree bit for bit."""
        n, alpha, beta = self._group(axes, kind)
        if n == 1:
            return 0.0, 0.0
        if kind == "all-gather":
            return alpha, beta * (n - 1) / n
        return alpha, beta * (n - 1) / (2.0 * n)

    def reshard_steps(
        self, shape: tuple[int, ...], itemsize: int, src: ShardingSpec, dst: ShardingSpec
    ) -> tuple[tuple[str, tuple[int, ...], float, float], ...]:
        """The collectives ``src -> dst`` needs: (kind, axes, bytes, seconds) per step."""
        key = (tuple(shape), itemsize, src, dst)
        steps = self._reshard_cache.get(key)
        if steps is None:
            steps = self._reshard_cache[key] = _reshard_steps(self, *key)
        return steps


def _reshard_steps(
    model: CostModel,
    shape: tuple[int, ...],
    itemsize: int,
    src: ShardingSpec,
    dst: ShardingSpec,
) -> tuple[tuple[str, tuple[int, ...], float, float], ...]:
    """The steps of ``_step_plan`` priced for a tensor of ``shape``: (kind, axes, bytes each
    device sees, seconds)."""
    full = math.prod(shape) * itemsize
    steps = []
    for kind, axes, shards in _step_plan(model, src, dst):
        nbytes = full / shards
        cost = model.all_to_all if kind == "all-to-all" else model.all_gather
        steps.append((kind, axes, nbytes, cost(nbytes, axes)))
    return tuple(steps)


def _step_plan(
    model: CostModel, src: ShardingSpec, dst: ShardingSpec
) -> tuple[tuple[str, tuple[int, ...], int], ...]:
    """Per mesh axis: kept where both specs split the same dim at the same place; moved by an
    all-to-all when it splits another dim in ``dst``; gathered when ``dst`` replicates it.
    Axes only ``dst`` splits are free (each device slices its own part). All-to-alls run
    first on the source layout, then gathers, each on the per-device part it sees: (kind,
    axes, the shards the tensor is in at that step) per step, for any shape."""
    if src == dst:
        return ()
    mesh_shape = model.mesh.shape
    src_at, dst_at = src.placement, dst.placement
    moved, gathered = [], []
    for axis, (dim, pos) in src_at.items():
        target = dst_at.get(axis)
        if target is None:
            gathered.append(axis)
        elif target[0] != dim:
            moved.append(axis)
        elif target[1] != pos or src.dims[dim][:pos] != dst.dims[dim][:pos]:
            # Same dim but a different nesting: the blocks differ, so regather that axis.
            gathered.append(axis)
    steps: list[tuple[str, tuple[int, ...], int]] = []
    shards = src.num_shards(mesh_shape)
    if moved:
        steps.append(("all-to-all", tuple(moved), shards))
    # XLA gathers one tensor dimension at a time: one all-gather per source dim, each seeing
    # the buffer as large as the gathers before it left it.
    remaining = shards
    for dim in sorted({src_at[a][0] for a in gathered}):
        axes = tuple(a for a in gathered if src_at[a][0] == dim)
        remaining //= math.prod(mesh_shape[a] for a in axes)
        steps.append(("all-gather", axes, remaining))
    return tuple(steps)
