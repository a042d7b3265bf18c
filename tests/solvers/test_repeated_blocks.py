"""``find_repeated_blocks``: the blocks of a step written as a loop, found from equation
signatures alone, against planted repetitions and a brute-force search."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpa_mini.solvers.repeated_blocks import (
    RepeatedBlocks,
    block_layer_starts,
    find_repeated_blocks,
)


def _find(ids, cuts=None, flops=None, **kw):
    n = len(ids)
    cuts = np.ones(max(n - 1, 0)) if cuts is None else cuts
    flops = np.ones(n) if flops is None else flops
    return find_repeated_blocks(ids, cuts, flops, **kw)


def test_a_prefix_four_blocks_and_a_suffix() -> None:
    ids = [7, 8] + [1, 2, 3] * 4 + [9]
    found = _find(ids)
    assert found == (RepeatedBlocks(start=2, period=3, count=4),)
    assert block_layer_starts(found, len(ids)) == (0, 2, 5, 8, 11, 14)


def test_blocks_from_the_first_equation_to_the_last_add_no_empty_layer() -> None:
    ids = [1, 2] * 3
    assert block_layer_starts(_find(ids), len(ids)) == (0, 2, 4)


def test_the_blocks_start_where_their_boundaries_carry_fewest_bytes() -> None:
    # Pattern a b c repeated 4 times after one prefix equation; the thinnest boundary is
    # after b (cut index of the equation b), so blocks run c a b: one whole block fewer.
    ids = [9] + [1, 2, 3] * 4
    cuts = np.full(len(ids) - 1, 10.0)
    cuts[[2 + 3 * i for i in range(4)]] = 1.0  # after each b (positions 2, 5, 8, 11)
    found = _find(ids, cuts=cuts)
    assert found == (RepeatedBlocks(start=3, period=3, count=3),)
    assert block_layer_starts(found, len(ids)) == (0, 3, 6, 9, 12)


def test_nothing_repeated_or_a_repetition_without_the_work_is_no_blocks() -> None:
    assert _find([1, 2, 3, 4, 5]) == ()
    assert _find([1]) == ()
    # Elementwise ops repeated (no flops) beside one matmul holding all the work.
    ids = [5, 1, 1, 1, 1, 1, 1]
    flops = np.array([100.0, 0, 0, 0, 0, 0, 0])
    assert _find(ids, flops=flops) == ()
    # The same run, holding the work, is cut.
    assert _find(ids, flops=np.array([1.0, 10, 10, 10, 10, 10, 10])) != ()


def test_the_shortest_period_wins_among_equal_covers() -> None:
    ids = [1, 2] * 6  # periods 2, 4 and 6 all cover everything
    assert _find(ids) == (RepeatedBlocks(0, 2, 6),)


def test_runs_of_different_blocks_are_each_cut_and_the_gaps_are_layers() -> None:
    # A ResNet-like step: a stem, three blocks of one width, a transition block, four of
    # another width, a head. The work sits in the blocks.
    ids = [0] + [1, 2] * 3 + [5, 6, 7] + [3, 4] * 4 + [9]
    flops = np.array([1.0] + [10.0] * 6 + [10.0] * 3 + [10.0] * 8 + [1.0])
    found = _find(ids, flops=flops)
    assert found == (RepeatedBlocks(1, 2, 3), RepeatedBlocks(10, 2, 4))
    assert block_layer_starts(found, len(ids)) == (0, 1, 3, 5, 7, 10, 12, 14, 16, 18)
    # A run holding too little of the work is left inside its neighbours' layers.
    assert _find(ids, flops=flops, min_run_share=0.4, min_flop_share=0.4) == (
        RepeatedBlocks(10, 2, 4),
    )


def test_the_richest_run_wins_over_a_longer_cheap_one() -> None:
    ids = [1] * 8 + [2, 3] * 2
    flops = np.array([0.1] * 8 + [10.0] * 4)
    assert _find(ids, flops=flops, min_run_share=0.5) == (RepeatedBlocks(8, 2, 2),)


def test_mismatched_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="cut_bytes and flops"):
        find_repeated_blocks([1, 2, 1, 2], [1.0], [1.0] * 4)


def _brute_best(ids: list[int]) -> tuple[int, int]:
    """(equations covered, its shortest period) of the longest stretch, over every period p
    and start, where each equation equals the one p later, extended by p, at least 2p long."""
    n, best = len(ids), (0, 0)
    for p in range(1, n // 2 + 1):
        for s in range(n - p):
            length = 0
            while s + length + p < n and ids[s + length] == ids[s + length + p]:
                length += 1
            if length >= p and length + p > best[0]:
                best = (length + p, p)
    return best


@settings(max_examples=150, deadline=None)
@given(
    prefix=st.lists(st.integers(0, 3), max_size=4),
    block=st.lists(st.integers(0, 3), min_size=1, max_size=4),
    copies=st.integers(2, 4),
    suffix=st.lists(st.integers(0, 3), max_size=4),
)
def test_the_run_covers_as_much_as_brute_force_and_its_blocks_are_equal(
    prefix: list[int], block: list[int], copies: int, suffix: list[int]
) -> None:
    ids = prefix + block * copies + suffix
    found = _find(ids, min_flop_share=0.0, min_run_share=0.0)
    assert found  # the planted blocks repeat
    for r in found:
        assert r.count >= 2
        assert all(ids[r.end - i * r.period - r.period : r.end - i * r.period] ==
                   ids[r.start : r.start + r.period] for i in range(r.count))  # fmt: skip
    assert all(a.end <= b.start for a, b in itertools.pairwise(found))
    # With every equation and boundary alike, the richest run is the longest: its every
    # whole block, at its shortest period.
    covered, period = _brute_best(ids)
    assert (period, covered // period) in {(r.period, r.count) for r in found}
    starts = block_layer_starts(found, len(ids))
    assert starts[0] == 0 and list(starts) == sorted(set(starts)) and starts[-1] < len(ids)
