"""Tests for operator clustering into layers (solvers.layer_clustering, DESIGN 5.3)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from alpa_mini.solvers.brute_force.clustering import brute_force_clustering
from alpa_mini.solvers.errors import InfeasibleError, SolverInputError
from alpa_mini.solvers.layer_clustering import (
    LayerClustering,
    LayerCountSearch,
    balance_limit,
    cluster_layers,
    cut_bytes_from_tensors,
    evaluate_clustering,
    search_num_layers,
)

# --------------------------------------------------------------------------- helpers


def _transformer(num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """A pre-LN-free transformer-ish chain: per block attn, add, mlp, add.

    Tensors per block ``b`` (equations ``4b .. 4b+3``): attention output (2 bytes, read by the
    add), first residual sum ``h`` (3 bytes, read by mlp and second add), mlp output (8 bytes,
    read by the second add), block output (2 bytes, read by the next attention and first add).
    The only thin cut (2 bytes: just the residual stream) is after each block's second add.
    """
    flops = np.tile([10.0, 1.0, 20.0, 1.0], num_blocks)
    producers, consumers, sizes = [], [], []
    for b in range(num_blocks):
        e = 4 * b
        producers += [e, e + 1, e + 2]
        consumers += [e + 1, e + 3, e + 3]
        sizes += [2, 3, 8]
        producers.append(e + 3)
        consumers.append(e + 5 if b + 1 < num_blocks else 4 * num_blocks)  # output: live to end
        sizes.append(2)
    cuts = cut_bytes_from_tensors(4 * num_blocks, producers, consumers, sizes)
    return flops, cuts


def _independent_feasible(
    flops: list[int], cuts: list[float], num_layers: int, limit: float, threshold: float
) -> bool:
    """Plain-Python check: can ``L`` layers with flops <= limit use only cuts <= threshold?

    Reachable layer counts per allowed prefix end, as Python-int bitsets (no greedy, no
    interval argument), so it shares no reasoning with the solver.
    """
    n = len(flops)
    prefix = [0]
    for x in flops:
        prefix.append(prefix[-1] + x)
    mask = (1 << (num_layers + 1)) - 1
    ends = [q for q in range(1, n) if cuts[q - 1] <= threshold] + [n]
    starts = [0]
    reach = {0: 1}  # bit j set: prefix [0, q) splits into j layers
    lo = 0
    for q in ends:
        while prefix[q] - prefix[starts[lo]] > limit:
            lo += 1
            if lo == len(starts):
                return False
        acc = 0
        for p in starts[lo:]:
            acc |= reach[p] << 1
        reach[q] = acc & mask
        starts.append(q)
    return bool((reach[n] >> num_layers) & 1)


@st.composite
def _instances(draw: st.DrawFn) -> tuple[list[int], list[int], int, float]:
    n = draw(st.integers(1, 10))
    fmax = draw(st.sampled_from([1, 3, 20]))
    cmax = draw(st.sampled_from([1, 3, 50]))
    flops = draw(st.lists(st.integers(0, fmax), min_size=n, max_size=n))
    cuts = draw(st.lists(st.integers(0, cmax), min_size=n - 1, max_size=n - 1))
    num_layers = draw(st.integers(1, n))
    eps = draw(st.one_of(st.just(0.0), st.just(1.0), st.floats(0.0, 1.0)))
    return flops, cuts, num_layers, eps


# --------------------------------------------------------------------------- against brute force


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_instances())
def test_matches_brute_force(instance: tuple[list[int], list[int], int, float]) -> None:
    flops, cuts, num_layers, eps = instance
    expected = brute_force_clustering(flops, cuts, num_layers, eps)
    if expected is None:
        with pytest.raises(InfeasibleError) as info:
            cluster_layers(flops, cuts, num_layers, eps)
        min_eps = info.value.details["min_eps"]
        if min_eps is None:
            assert num_layers > len(flops)
        else:
            # min_eps works, and anything clearly smaller does not.
            assert brute_force_clustering(flops, cuts, num_layers, min_eps) is not None
            assert cluster_layers(flops, cuts, num_layers, min_eps).is_balanced
            if min_eps > 1e-6:
                below = min_eps - 1e-6
                assert brute_force_clustering(flops, cuts, num_layers, below) is None
        return
    got = cluster_layers(flops, cuts, num_layers, eps)
    assert got == expected  # boundaries, per-layer flops, every objective term
    assert got.objective() == expected.objective()
    assert got.is_balanced
    assert got.num_layers == num_layers


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 12).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(
                st.tuples(st.integers(0, n - 1), st.integers(0, n), st.integers(0, 100)),
                max_size=15,
            ),
        )
    )
)
def test_cut_bytes_from_tensors_matches_loop(case: tuple[int, list[tuple[int, int, int]]]) -> None:
    n, tensors = case
    expected = np.zeros(max(n - 1, 0))
    for producer, consumer, size in tensors:
        for k in range(n - 1):
            if producer <= k < consumer:
                expected[k] += size
    producers = [t[0] for t in tensors]
    consumers = [t[1] for t in tensors]
    sizes = [t[2] for t in tensors]
    got = cut_bytes_from_tensors(n, producers, consumers, sizes)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, expected)


# --------------------------------------------------------------------------- known answers


def test_transformer_cut_vector_and_thin_cuts() -> None:
    flops, cuts = _transformer(4)
    # after attn: attn out + residual in (2 + 2); after add: h (3); after mlp: h + mlp (11);
    # after the block: residual only (2). Block 0's residual input is a graph input: not counted.
    np.testing.assert_array_equal(cuts[:8], [2, 3, 11, 2, 4, 3, 11, 2])
    result = cluster_layers(flops, cuts, 4, eps=0.0)
    assert result.layer_starts == (0, 4, 8, 12)
    assert result.layer_ranges == ((0, 4), (4, 8), (8, 12), (12, 16))
    assert result.cut_positions == (3, 7, 11)
    assert result.max_cut_bytes == 2.0 and result.sum_cut_bytes == 6.0
    assert result.layer_flops == (32.0,) * 4
    np.testing.assert_array_equal(result.equation_layers(), np.repeat(np.arange(4), 4))
    assert cluster_layers(flops, cuts, 2, eps=0.0).layer_starts == (0, 8)


def test_transformer_half_blocks_need_min_eps() -> None:
    flops, cuts = _transformer(4)
    # 8 layers of 4 blocks: half blocks have 11 and 21 flops, so eps = 21 * 8 / 128 - 1.
    with pytest.raises(InfeasibleError, match=r"smallest eps that works is 0\.3125") as info:
        cluster_layers(flops, cuts, 8, eps=0.0)
    # eps = 0 allows 16 flops per layer, less than the 20-flop mlp equation alone.
    assert info.value.details["cause"] == "equation_exceeds_limit"
    assert info.value.details["equation"] == 2
    assert info.value.details["min_eps"] == pytest.approx(0.3125)
    result = cluster_layers(flops, cuts, 8, eps=info.value.details["min_eps"])
    assert result.max_layer_flops == 21.0
    assert result.layer_starts == (0, 2, 4, 6, 8, 10, 12, 14)  # after attn+add: cut of 3 bytes
    assert result.max_cut_bytes == 3.0


def test_tie_break_order() -> None:
    ones = [1] * 5
    # Max layer flops beats sum: (0, 1) has max cut 1 and sum 1 but a 3-flop layer; (1, 3)
    # has max cut 1, layers 2, 2, 1 and sum 2.
    assert cluster_layers(ones, [0, 1, 2, 1], 3, eps=1.0).cut_positions == (1, 3)
    # Sum beats lexicographic order: (0, 2) and (1, 2) both have max cut 2 and layers <= 2,
    # but (0, 2) sums to 4 and (1, 2) to 3.
    assert cluster_layers(ones, [2, 1, 2, 2], 3, eps=1.0).cut_positions == (1, 2)
    # Everything equal: earliest boundaries among the most balanced.
    assert cluster_layers(ones, [5, 5, 5, 5], 2, eps=1.0).layer_starts == (0, 2)


def test_single_layer_and_single_equation() -> None:
    one = cluster_layers([7.0], [], 1)
    assert one.layer_starts == (0,) and one.max_cut_bytes == 0.0 and one.layer_flops == (7.0,)
    whole = cluster_layers([1, 2, 3], [9, 9], 1, eps=0.0)
    assert whole.layer_flops == (6.0,) and whole.boundary_cut_bytes == ()


def test_all_zero_flops() -> None:
    result = cluster_layers([0, 0, 0, 0], [3, 1, 2], 3, eps=0.0)
    assert result.layer_starts == (0, 2, 3)  # cuts 1 and 2; the 3-byte cut is avoided
    assert result.max_layer_flops == 0.0 and result.balance_limit == 0.0


def test_fractional_flops_exact_balance() -> None:
    # 10 x 0.1 does not sum to exactly 1.0; the rounding slack keeps eps = 0 feasible.
    result = cluster_layers([0.1] * 10, [1.0] * 9, 10, eps=0.0)
    assert result.layer_starts == tuple(range(10))
    assert result.is_balanced


def test_infeasible_causes() -> None:
    with pytest.raises(InfeasibleError, match="exceeds the number of equations") as info:
        cluster_layers([1, 1], [0], 3)
    assert info.value.details["cause"] == "too_many_layers"
    assert info.value.details["min_eps"] is None
    with pytest.raises(InfeasibleError, match="equation 2 alone") as info:
        cluster_layers([1, 1, 10, 1], [0, 0, 0], 2, eps=0.1)
    details = info.value.details
    assert details["cause"] == "equation_exceeds_limit" and details["equation"] == 2
    # The best 2-layer split is [1, 1 | 10, 1], whose heavier layer has 11 flops.
    assert details["min_eps"] == pytest.approx(11 * 2 / 13 - 1)
    assert cluster_layers([1, 1, 10, 1], [0, 0, 0], 2, eps=details["min_eps"]).max_layer_flops == 11
    with pytest.raises(InfeasibleError, match="has a layer with more than") as info:
        cluster_layers([3, 1, 3, 1, 3], [0, 0, 0, 0], 3, eps=0.0)  # limit 11/3; best is 4
    assert info.value.details["cause"] == "unbalanced"
    assert info.value.details["min_eps"] == pytest.approx(4 * 3 / 11 - 1)


def test_evaluate_clustering_and_json_round_trip() -> None:
    flops, cuts = _transformer(3)
    result = cluster_layers(flops, cuts, 3, eps=0.0)
    assert evaluate_clustering(flops, cuts, result.layer_starts, eps=0.0) == result
    assert LayerClustering.from_json(result.to_json()) == result
    manual = evaluate_clustering(flops, cuts, [0, 1], eps=0.0)
    assert not manual.is_balanced and manual.layer_flops == (10.0, 86.0)
    assert manual.balance_limit == balance_limit(96.0, 2, 0.0)
    with pytest.raises(SolverInputError, match=r"layer_starts\[2\] = 1"):
        evaluate_clustering(flops, cuts, [0, 1, 1])


def test_search_num_layers_prefers_most_layers_without_fat_cuts() -> None:
    flops, cuts = _transformer(8)
    search = search_num_layers(flops, cuts, [16, 1, 2, 4, 8, 40], eps=0.5)
    assert search.candidates == (1, 2, 4, 8, 16, 40)
    max_cuts = [None if r is None else r.max_cut_bytes for r in search.results]
    # 16 layers of <= 24 flops must split every 32-flop block, at best after attn + add
    # (3 bytes); 40 > 32 equations.
    assert max_cuts == [0.0, 2.0, 2.0, 2.0, 3.0, None]
    assert search.reference_max_cut_bytes == 2.0
    assert search.chosen_num_layers == 8
    assert search.chosen.layer_starts == tuple(range(0, 32, 4))
    assert "exceeds the number of equations" in str(search.failures[-1])
    assert [row["chosen"] for row in search.rows()] == [False, False, False, True, False, False]
    # A loose tolerance admits the 16-layer clustering.
    assert (
        search_num_layers(flops, cuts, [8, 16], eps=0.5, cut_tolerance=0.5).chosen_num_layers == 16
    )
    again = LayerCountSearch.from_json(search.to_json())
    assert again == search


def test_search_num_layers_single_layer_and_none_feasible() -> None:
    search = search_num_layers([1, 10], [4], [1, 2], eps=0.0)
    assert search.chosen_num_layers == 1 and math.isnan(search.reference_max_cut_bytes)
    assert LayerCountSearch.from_json(search.to_json()).chosen_num_layers == 1
    with pytest.raises(InfeasibleError, match="no candidate layer count is feasible"):
        search_num_layers([1, 10], [4], [2, 3], eps=0.0)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"flops": [1, -1, 2]}, r"flops\[1\] = -1\.0 .*>= 0"),
        ({"flops": [1, math.nan, 2]}, r"flops\[1\] = nan"),
        ({"flops": [1, 2, math.inf]}, r"flops\[2\] = inf"),
        ({"flops": []}, r"flops must hold at least one"),
        ({"flops": [[1, 2, 3]]}, r"flops must be 1-D"),
        ({"cut_bytes": [1, math.nan]}, r"cut_bytes\[1\] = nan"),
        ({"cut_bytes": [-2, 1]}, r"cut_bytes\[0\] = -2\.0"),
        ({"cut_bytes": [1, 2, 3]}, r"cut_bytes must have length 2, got 3"),
        ({"num_layers": 0}, r"num_layers must be >= 1, got 0"),
        ({"num_layers": 2.0}, r"num_layers must be an integer"),
        ({"num_layers": True}, r"num_layers must be an integer"),
        ({"eps": -0.1}, r"eps must be a finite number >= 0, got -0\.1"),
        ({"eps": math.nan}, r"eps must be a finite number"),
    ],
)
def test_cluster_layers_validation(kwargs: dict[str, object], pattern: str) -> None:
    args: dict[str, object] = {"flops": [1, 2, 3], "cut_bytes": [1, 2], "num_layers": 2}
    args.update(kwargs)
    with pytest.raises(SolverInputError, match=pattern):
        cluster_layers(**args)  # type: ignore[arg-type]


def test_cut_bytes_from_tensors_validation() -> None:
    with pytest.raises(SolverInputError, match=r"producers\[1\] = 3 is out of range"):
        cut_bytes_from_tensors(3, [0, 3], [1, 2], [1, 1])
    with pytest.raises(SolverInputError, match=r"last_consumers\[0\] = -1"):
        cut_bytes_from_tensors(3, [0], [-1], [1])
    with pytest.raises(SolverInputError, match=r"sizes\[0\] = -5\.0"):
        cut_bytes_from_tensors(3, [0], [1], [-5])
    with pytest.raises(SolverInputError, match=r"producers\[0\] = 0\.5"):
        cut_bytes_from_tensors(3, [0.5], [1], [1])
    with pytest.raises(SolverInputError, match="last_consumers must be 1-D with one entry"):
        cut_bytes_from_tensors(3, [0, 1], [1], [1, 1])
    with pytest.raises(SolverInputError, match="num_equations must be >= 1"):
        cut_bytes_from_tensors(0, [], [], [])


def test_search_num_layers_validation() -> None:
    with pytest.raises(SolverInputError, match="candidates must hold at least one"):
        search_num_layers([1, 2], [0], [])
    with pytest.raises(SolverInputError, match="candidates must hold at least one"):
        search_num_layers([1, 2], [0], 2)  # type: ignore[arg-type]
    with pytest.raises(SolverInputError, match=r"candidates\[1\] must be >= 1, got 0"):
        search_num_layers([1, 2], [0], [1, 0])
    with pytest.raises(SolverInputError, match="cut_tolerance must be a finite number"):
        search_num_layers([1, 2], [0], [1], cut_tolerance=-1.0)


# --------------------------------------------------------------------------- larger instances


@pytest.mark.parametrize("seed", [0, 1])
def test_large_instance_threshold_is_minimal(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, num_layers, eps = 5000, 32, 0.1
    flops = rng.integers(0, 1000, n)
    cuts = rng.integers(0, 50_000, n - 1).astype(np.float64)
    result = cluster_layers(flops, cuts, num_layers, eps)

    prefix = np.concatenate(([0], np.cumsum(flops)))
    total = int(prefix[-1])
    limit = (1 + eps) * total / num_layers * (1 + 1e-9)
    assert result.balance_limit == pytest.approx(limit, rel=1e-15)
    bounds = [*result.layer_starts, n]
    layer_flops = [int(prefix[e] - prefix[s]) for s, e in itertools.pairwise(bounds)]
    assert len(layer_flops) == num_layers and min(e - s for s, e in result.layer_ranges) >= 1
    assert max(layer_flops) <= limit
    assert list(result.layer_flops) == layer_flops
    chosen = [cuts[s - 1] for s in result.layer_starts[1:]]
    assert result.max_cut_bytes == max(chosen) and result.sum_cut_bytes == sum(chosen)

    flops_list, cut_list = flops.tolist(), cuts.tolist()
    threshold = result.max_cut_bytes
    below = cuts[cuts < threshold]
    assert _independent_feasible(flops_list, cut_list, num_layers, limit, threshold)
    assert below.size > 0
    assert not _independent_feasible(flops_list, cut_list, num_layers, limit, float(below.max()))
    # Max layer flops is minimal too: one flop less is infeasible at the same threshold.
    assert _independent_feasible(
        flops_list, cut_list, num_layers, result.max_layer_flops, threshold
    )
    assert not _independent_feasible(
        flops_list, cut_list, num_layers, result.max_layer_flops - 1, threshold
    )


def test_large_transformer_finds_block_boundaries() -> None:
    flops, cuts = _transformer(512)  # 2048 equations
    result = cluster_layers(flops, cuts, 128, eps=0.0)
    assert result.layer_starts == tuple(range(0, 2048, 16))
    assert result.max_cut_bytes == 2.0 and result.sum_cut_bytes == 2.0 * 127
