"""Layers of a model written as a loop: the blocks of its repeated runs of equations.

A step that applies one block k times in a Python loop (unrolled, no pipeline markers) shows
the block's equations k times in a row. Cut where each repetition starts, every block is one
layer of the same structure, so the planner solves one layer ILP for all of them and the
stage DP balances whole blocks. A model may hold several such runs (a ResNet's groups, each
of its own width); what lies between and around them (an embedding, a block unlike its
neighbours, a head and the loss) is a layer per stretch. Equations are compared by signature
ids the caller gives (primitive, parameters and shapes), so this module sees no jaxpr.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["RepeatedBlocks", "block_layer_starts", "find_repeated_blocks"]

#: The least share of the step's flops the repeated runs must hold together to be cut into
#: layers, and each run alone: below them a repetition is incidental (a chain of alike
#: elementwise ops) and the step stays as its markers (none) leave it.
MIN_FLOP_SHARE = 0.5
MIN_RUN_SHARE = 0.05


@dataclass(frozen=True, order=True)
class RepeatedBlocks:
    """``count`` consecutive blocks of ``period`` equations, the first starting at ``start``."""

    start: int
    period: int
    count: int

    @property
    def end(self) -> int:
        return self.start + self.count * self.period


def block_layer_starts(runs: tuple[RepeatedBlocks, ...], num_equations: int) -> tuple[int, ...]:
    """Where each layer starts: every block of every run, and the equations between runs (an
    embedding, a head and the loss, a block unlike its neighbours) one layer per gap."""
    starts = {0}
    for run in runs:
        starts.update(run.start + i * run.period for i in range(run.count))
        starts.add(run.end)
    return tuple(sorted(s for s in starts if s < num_equations))


def find_repeated_blocks(
    ids: ArrayLike,
    cut_bytes: ArrayLike,
    flops: ArrayLike,
    min_flop_share: float = MIN_FLOP_SHARE,
    min_run_share: float = MIN_RUN_SHARE,
) -> tuple[RepeatedBlocks, ...]:
    """The repeated runs of equations, in order: the run whose whole blocks hold the most
    flops (the shortest period among equals), then the same search in what lies before and
    after it, and so on; each run cut where the bytes crossing its blocks' boundaries are
    fewest. Empty where the runs hold less than ``min_flop_share`` of the flops (a run
    holding less than ``min_run_share`` is not kept). ``ids``: a signature id per equation;
    ``cut_bytes[k]``: bytes crossing the boundary after equation k
    (``layer_clustering.cut_bytes_from_tensors``); ``flops``: per equation."""
    sig = np.asarray(ids, dtype=np.int64)
    cuts = np.asarray(cut_bytes, dtype=np.float64)
    work = np.asarray(flops, dtype=np.float64)
    n = sig.shape[0]
    if cuts.shape[0] != max(n - 1, 0) or work.shape[0] != n:
        raise ValueError(
            f"cut_bytes and flops: expected {max(n - 1, 0)} and {n} entries for {n} equations, "
            f"got {cuts.shape[0]} and {work.shape[0]}"
        )
    cum = np.concatenate(([0.0], np.cumsum(work)))
    total = float(cum[-1])
    runs: list[RepeatedBlocks] = []
    segments = [(0, n)]
    while segments:
        a, b = segments.pop()
        found = _richest_run(sig[a:b], cum[a : b + 1] - cum[a])
        if found is None:
            continue
        run = _phased(a + found[0], found[1], found[2], cuts)
        if cum[run.end] - cum[run.start] < min_run_share * total:
            continue
        runs.append(run)
        segments += [(a, run.start), (run.end, b)]
    held = sum(float(cum[r.end] - cum[r.start]) for r in runs)
    if not runs or held < min_flop_share * total:
        return ()
    return tuple(sorted(runs))


def _richest_run(sig: np.ndarray, cum: np.ndarray) -> tuple[int, int, int] | None:
    """(first equation, period, equations covered) of the stretch, over every period up to
    half the equations, where each equation equals the one ``period`` later for at least a
    period, extended by that period, whose whole blocks hold the most flops (``cum``: the
    running flop sums from 0); one numpy pass per period (0.4 s for 14,000 equations)."""
    best: tuple[float, int, int, int] | None = None  # (flops, -period, first, covered)
    for p in range(1, sig.shape[0] // 2 + 1):
        same = np.concatenate(([False], sig[:-p] == sig[p:], [False]))
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        if edges.size == 0:
            continue
        first, lengths = edges[::2], edges[1::2] - edges[::2]
        whole = (lengths + p) // p * p  # equations in whole blocks
        held = np.where(lengths >= p, cum[first + whole] - cum[first], -1.0)
        k = int(np.argmax(held))
        if held[k] < 0:
            continue
        key = (float(held[k]), -p, int(first[k]), int(lengths[k]) + p)
        if best is None or key[:2] > best[:2]:
            best = key
    return None if best is None else (best[2], -best[1], best[3])


def _phased(first: int, period: int, covered: int, cuts: np.ndarray) -> RepeatedBlocks:
    """The blocks of a run, starting at the offset (within one period of its first equation)
    whose boundaries between blocks carry the fewest bytes on average; ties go to more whole
    blocks, then the earliest start."""
    best: tuple[float, int, int] | None = None
    for start in range(first, first + period):
        count = (first + covered - start) // period
        if count < 2:
            continue
        inner = [start + i * period - 1 for i in range(1, count)]
        key = (float(np.mean(cuts[inner])), -count, start)
        if best is None or key < best:
            best = key
    assert best is not None  # start = first always leaves covered // period >= 2 blocks
    return RepeatedBlocks(best[2], period, -best[1])
