"""The searched micro-batch count: the bisection against exhaustive search, and
``PipeshardParallel(num_micro_batches=None)`` end to end."""

from __future__ import annotations

import gc
import math
import random
import weakref

import jax
import pytest

import alpa_mini
from alpa_mini import ClusterSpec, MemoryBudgetError, PipeshardParallel
from alpa_mini.errors import ConfigError
from alpa_mini.models import make_train_step, sgd
from alpa_mini.pipeline.micro_batch_search import (
    Dominated,
    micro_batch_candidates,
    search_micro_batches,
)
from alpa_mini.pipeline.plan import PipeshardPlan
from alpa_mini.pipeline.simulate import simulate_plan
from alpa_mini.solvers.errors import InfeasibleError
from helpers.mlp import marked_mlp_args, marked_mlp_loss


def test_candidates_are_the_divisors_nearest_each_power_of_two():
    assert micro_batch_candidates(1024) == [2**k for k in range(11)]
    # 1520 = 16 * 95: after 16, the divisors nearest 32, 64, ..., 1024 on a log scale.
    assert micro_batch_candidates(1520) == [1, 2, 4, 8, 16, 38, 76, 152, 304, 380, 760]
    assert micro_batch_candidates(24) == [1, 2, 4, 8, 12]
    assert micro_batch_candidates(7) == [1, 7]
    assert micro_batch_candidates(1) == [1]


def test_near_each_power_of_two_the_count_whose_micro_batches_split_over_most_devices():
    # 1792 = 256 * 7 on 1024 devices: 56 (32 rows each, data parallel up to 32) beside 64
    # (28 rows, at most 4), and so on up the ladder; a power-of-two batch keeps its ladder.
    assert micro_batch_candidates(1792, 1024) == [1, 2, 4, 7, 14, 28, 56, 112, 224, 448, 896]
    assert micro_batch_candidates(1792) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 448, 896]
    assert micro_batch_candidates(1024, 64) == micro_batch_candidates(1024)
    # 2304 = 256 * 9 on 1536 = 512 * 3 devices: 96 (24 rows: Megatron-LM's dp 24) for 128
    assert 96 in micro_batch_candidates(2304, 1536)
    assert 128 not in micro_batch_candidates(2304, 1536)
    with pytest.raises(ConfigError, match="devices: 0"):
        micro_batch_candidates(8, 0)


def _curve(k: int, rng: random.Random) -> list[float]:
    """An infeasible prefix, then a strictly falling and strictly rising run."""
    first = rng.randrange(k)
    low = rng.randrange(first, k)
    out = []
    for i in range(k):
        if i < first:
            out.append(math.inf)
        else:
            out.append(10.0 + abs(i - low) + rng.random() * 0.1 * (i != low))
    return out


def _planner(curve: list[float], calls: list[int], *, stop: bool):
    """``plan(B, beat)`` over ``curve`` (seconds per log2 B; inf: no fit); with ``stop``, a
    count slower than ``beat`` stops at a bound between the two, as the stage DP does."""

    def plan(b: int, beat: float):
        calls.append(b)
        t = curve[b.bit_length() - 1]
        if math.isinf(t):
            raise MemoryBudgetError(f"B={b} does not fit", 2.0 * b)
        if stop and t > beat:
            raise Dominated((t + beat) / 2, beat)
        return f"plan{b}", t

    return plan


@pytest.mark.parametrize("stop", [False, True])
def test_bisection_finds_the_exhaustive_best_in_about_two_log2_k_plans(stop):
    rng = random.Random(0)
    planned = plain = 0
    for _ in range(300):
        k = rng.randrange(1, 12)
        curve = _curve(k, rng)
        if all(math.isinf(t) for t in curve):
            continue
        calls: list[int] = []
        candidates = [2**i for i in range(k)]
        result, best, tried, dominated = search_micro_batches(
            candidates, _planner(curve, calls, stop=stop)
        )
        want = min(range(k), key=curve.__getitem__)
        assert best == candidates[want] and result == f"plan{best}"
        bound = 2 * math.ceil(math.log2(k)) + 1 if k > 1 else 1
        assert len(calls) == len(set(calls)) <= bound
        assert sorted(b for b, _ in tried + dominated) == sorted(calls)
        assert [b for b, _ in tried] == [b for b in calls if b not in dict(dominated)]
        assert all((t is None) == math.isinf(curve[b.bit_length() - 1]) for b, t in tried)
        assert all(curve[want] < t <= curve[b.bit_length() - 1] for b, t in dominated)
        assert stop or not dominated
        planned += len(calls)
        plain += _plain_bisection_plans(curve)
    # Planning the upper count of the first pair first, and comparing with counts already
    # planned, costs fewer plans over these curves than the plain bisection.
    assert planned < plain


def _plain_bisection_plans(curve: list[float]) -> int:
    """How many counts a bisection that always plans ``mid + 1`` to compare plans."""
    seen: set[int] = set()
    lo, hi = 0, len(curve) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        seen.add(mid)
        if math.isinf(curve[mid]):
            lo = mid + 1
            continue
        seen.add(mid + 1)
        lo, hi = (mid + 1, hi) if curve[mid + 1] < curve[mid] else (lo, mid)
    return len(seen | {lo})


def test_gpt_39b_plans_four_counts_two_of_them_stopped_at_their_bound():
    """GPT-39B's curve on 8x8 A100s (seconds per iteration, from the defaults table; no fit
    below 32, 30 s at 1024). Nothing has fitted yet, so the first pair's upper count 64 goes
    first; then 32, the middle 256 (both slower than 64: their plans stop at their bound)
    and 128. 256 being slower than 64 puts the best below 256 without planning 512. (32
    fits, so 64 is not the smallest count that fits and its neighbour is not probed.)"""
    curve = [math.inf] * 5 + [70.38, 25.32, 24.85, 26.08, 28.21, 30.0]
    calls: list[int] = []
    _, best, tried, dominated = search_micro_batches(
        [2**i for i in range(11)], _planner(curve, calls, stop=True)
    )
    assert best == 128
    assert calls == [64, 32, 256, 128]
    assert [b for b, _ in dominated] == [32, 256] and [b for b, _ in tried] == [64, 128]
    assert _plain_bisection_plans(curve) == 5


def test_a_best_count_that_is_the_smallest_fitting_one_takes_three_plans():
    """GPT-3 1.3B on 4 GPUs (the defaults table): 32 does not fit and 64 is the fastest, so
    64's upper neighbour 128, slower, ends the search; 256 is never planned."""
    curve = [math.inf] * 6 + [34.61, 35.03, 35.97, 37.0, 38.0]
    calls: list[int] = []
    _, best, _, dominated = search_micro_batches(
        [2**i for i in range(11)], _planner(curve, calls, stop=True)
    )
    assert best == 64 and calls == [64, 32, 128] and [b for b, _ in dominated] == [128]


def test_when_the_upper_count_does_not_fit_neither_does_the_lower():
    """Memory only falls as B grows: before anything fits, a pair whose upper count does not
    fit is passed over without planning its lower count."""
    curve = [math.inf] * 9 + [3.0, 2.0, 2.5]
    calls: list[int] = []
    _, best, _, _ = search_micro_batches(
        [2**i for i in range(12)], _planner(curve, calls, stop=True)
    )
    assert best == 1024
    assert 32 not in calls and calls[0] == 64 and len(calls) <= 5


def test_nothing_fitting_is_a_memory_error_with_the_smallest_budget_seen():
    def plan(b, beat):
        raise MemoryBudgetError(f"B={b}: too big", 100.0 / b)

    with pytest.raises(MemoryBudgetError, match=r"no micro-batch count searched \(1, 2, 4\)") as e:
        search_micro_batches([1, 2, 4], plan)
    assert e.value.min_budget == 25.0


def test_a_count_that_failed_keeps_none_of_its_tables_alive_while_others_are_planned():
    """A count whose DP found nothing raises MemoryBudgetError while handling the DP's own
    error (as ``stage_search`` does). The search keeps the error for its report, but neither
    it nor the error it chains to may keep that count's tables (GiBs at 1T) alive while
    later counts are planned; only the fastest plan so far is kept."""

    class Table:  # stands in for a count's cost table
        pass

    alive: dict[int, weakref.ref] = {}
    seen_alive: dict[int, list[int]] = {}

    def plan(b, beat):
        gc.collect()
        seen_alive[b] = sorted(c for c, ref in alive.items() if ref() is not None)
        table = Table()
        alive[b] = weakref.ref(table)
        if b < 4:
            try:
                raise InfeasibleError("no slicing")
            except InfeasibleError:
                raise MemoryBudgetError(f"B={b}: nothing fits", None) from None
        if b > 4:
            try:
                raise ValueError("its bound")
            except ValueError:
                raise Dominated(2.0, beat) from None
        return table, 1.0

    result, best, _, dominated = search_micro_batches([1, 2, 4, 8], plan)
    assert best == 4 and [b for b, _ in dominated] == [8]
    assert sorted(seen_alive) == [2, 4, 8] and result is alive[4]()
    assert seen_alive == {4: [], 2: [4], 8: [4]}


@pytest.mark.slow  # 9 s: plans every count
def test_a_searched_count_is_the_fastest_plan_over_all_counts(devices8):
    """An MLP of 4 marked layers, batch 64, on 8 devices: the count chosen is the one
    planning every candidate separately finds fastest in the simulator, tracing the step
    once (later counts trace the loss alone); the plan records what it tried and keeps it
    through JSON; the step trains as serial JAX."""
    alpa_mini.shutdown()
    cluster = ClusterSpec.named("cpu-2x4")
    alpa_mini.init(cluster=cluster)
    params, data = marked_mlp_args(4, 32, 64)
    opt = sgd(0.1)
    step = make_train_step(marked_mlp_loss, opt, alpa_mini.value_and_grad)
    state = opt.init(params)
    times = {}
    for b in micro_batch_candidates(64):
        method = PipeshardParallel(num_micro_batches=b)
        try:
            plan = alpa_mini.plan(step, params, state, data, method=method)
            # (transfers between stages included, as the search ranks several stages)
            times[b] = simulate_plan(plan, cluster).iteration_time
        except MemoryBudgetError:
            times[b] = math.inf
    calls = []

    def counted(*args):
        calls.append(1)
        return step(*args)

    searched = alpa_mini.plan(counted, params, state, data, method=PipeshardParallel(None))
    assert searched.num_micro_batches == min(times, key=times.get)
    tried = searched.planning.micro_batches_tried
    assert tried and all(t == pytest.approx(times[b], rel=1e-9) for b, t in tried)
    assert len(tried) < len(times)
    # The loss reads the step's inputs as they are: the first count traces the step once, at
    # full shapes (direct_trace), and later counts trace the loss alone (LossRecipe).
    assert len(calls) == 1
    again = PipeshardPlan.from_json(searched.to_json())
    assert again.planning.micro_batches_tried == tried
    # The step itself plans the same way and trains as serial JAX.
    pstep = alpa_mini.parallelize(step, method=PipeshardParallel(num_micro_batches=None))
    p, _, _ = pstep(params, state, data)
    assert pstep.get_executable(params, state, data).plan.num_micro_batches == (
        searched.num_micro_batches
    )
    want_p, _, _ = jax.jit(make_train_step(marked_mlp_loss, opt))(params, state, data)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(want_p), strict=True):
        assert jax.numpy.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_when_no_count_fits_the_error_names_the_least_memory_of_the_largest(devices8):
    """Counts that do not fit are priced without working out the memory they would need (a
    second table of ILPs each); when none fits, the largest count is planned once more for
    the error, which names the least per-device memory that fits there. The step is traced
    once, at full shapes (its loss reads the step's inputs as they are: ``direct_trace``),
    although no count could be planned."""
    alpa_mini.shutdown()
    alpa_mini.init(cluster=ClusterSpec.named("cpu-2x4"))
    params, data = marked_mlp_args(4, 32, 64)
    opt = sgd(0.1)
    step = make_train_step(marked_mlp_loss, opt, alpa_mini.value_and_grad)
    rows = []

    def counted(*args):
        rows.append(jax.tree.leaves(args[2])[0].shape[0])
        return step(*args)

    method = PipeshardParallel(None, memory_budget=1024.0)
    with pytest.raises(MemoryBudgetError, match="at the largest count") as e:
        alpa_mini.plan(counted, params, opt.init(params), data, method=method)
    assert rows == [64]  # one trace; later counts trace the loss alone
    need = e.value.min_budget
    assert need is not None and need > 1024.0
    fits = PipeshardParallel(64, memory_budget=need * 1.001)
    assert alpa_mini.plan(step, params, opt.init(params), data, method=fits).num_micro_batches == 64


def test_counts_stopped_at_their_bound_round_trip_and_bad_records_name_the_field():
    from alpa_mini.graph.planning_stats import PlanningStats

    stats = PlanningStats(
        micro_batches_tried=((64, 25.3), (32, None)), micro_batches_dominated=((256, 26.1),)
    )
    assert PlanningStats.from_dict(stats.to_dict()) == stats
    # Plans saved before the field read as having stopped no count.
    old = {k: v for k, v in stats.to_dict().items() if k != "micro_batches_dominated"}
    assert PlanningStats.from_dict(old).micro_batches_dominated == ()
    bad = {**stats.to_dict(), "micro_batches_dominated": [[256, None]]}
    with pytest.raises(ValueError, match=r"planning.micro_batches_dominated\[0\]: expected"):
        PlanningStats.from_dict(bad)
