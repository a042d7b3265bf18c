"""The micro-batch count B, searched when ``PipeshardParallel(num_micro_batches=None)``.

Candidates form a geometric ladder of the batch's divisors: for each power of two up to the
batch, a divisor near it (the powers of two themselves when they divide it, and e.g. 38, 76,
152 for a batch of 1520), preferring one whose micro-batches split over many of the
cluster's devices (56 rather than 64 for a batch of 1792 on 1024 GPUs). Each count is
ranked by its plan's predicted time, simulated with the transfers between its stages where
it has several (``executable._ranked_time``). Two facts make a bisection
enough: memory only falls as B grows (smaller micro-batches hold fewer activations), so the
counts that fit are a suffix; and the predicted iteration time over them first falls (a
smaller pipeline bubble, (S - 1) / B of the step) and then rises (micro-batches too small to
keep devices busy, more launches). So comparing neighbours ``B`` and ``2B`` says on which
side the best lies, in about ``2 log2(k)`` plans for ``k`` candidates; where a count already
planned on either side was faster, that says it without planning the neighbour (GPT-39B's
search plans 64, 32, 256, then 128 alone, as 64 beat 256). Where the fastest count so far
is the smallest that fits, its upper neighbour is planned next: a plan held back by memory
(one stage, say) is often best at the largest micro-batch it fits, so where the neighbour
is slower the search ends there (GPT-3 1.3B on 4 GPUs plans 64, 32, which does not fit,
and 128, not 256 as well); where it is faster the bisection goes on above it. Every plan
made is kept in the record, and the fastest of them is returned even where the curve is
not unimodal.

Two more facts save planning. Each count is planned against the fastest so far (``beat``):
without refinement a plan's predicted time is its stage DP's objective, and the DP over the
layer MIPs' LP bounds is a lower bound on it, so a count whose bound is already slower stops
there (``Dominated``) before any MIP of it is branched on. And while nothing has fitted, the
pair's upper count goes first: larger counts fit more often and plan faster, the lower one
then has something to beat, and where the upper does not fit the lower is passed over too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

from ..errors import ConfigError, MemoryBudgetError

__all__ = ["micro_batch_candidates", "search_micro_batches"]

T = TypeVar("T")


def micro_batch_candidates(rows: int, devices: int = 1) -> list[int]:
    """Per power of two ``2**k <= rows``, a divisor B of ``rows`` near it, ascending without
    repeats: about log2(rows) counts spaced about 2x apart, so a batch that is not a power
    of two still gets counts near each. Among the divisors within half an octave of ``2**k``
    the one whose micro-batch of ``rows / B`` rows splits over the most of ``devices`` (the
    largest gcd(rows / B, devices): a data-parallel degree must divide the micro-batch), then
    the nearest on a log scale, then the smaller; where none is that close, the nearest.
    (A batch of 1792 on 1024 GPUs gets 56, 32 rows each, not 64, 28 rows each: data
    parallelism of 32 fits 56's micro-batches, at most 4 fits 64's.)"""
    if rows < 1:
        raise ConfigError(f"batch: {rows} rows; a searched micro-batch count needs >= 1")
    if devices < 1:
        raise ConfigError(f"devices: {devices} is invalid; expected >= 1")
    small = [d for d in range(1, math.isqrt(rows) + 1) if rows % d == 0]
    divisors = sorted({*small, *(rows // d for d in small)})
    out: list[int] = []
    for k in range(rows.bit_length()):
        close = [d for d in divisors if abs(math.log2(d) - k) <= 0.5]
        pick = min(
            close or divisors,
            key=lambda d, k=k: (
                -math.gcd(rows // d, devices) if close else 0,
                abs(math.log2(d) - k),
                d,
            ),
        )
        if pick not in out:
            out.append(pick)
    return sorted(out)


class Dominated(Exception):
    """Raised by a count's planning once a lower bound on its predicted seconds, ``bound``,
    exceeds ``beat``, the fastest count planned so far: it cannot be the best."""

    def __init__(self, bound: float, beat: float) -> None:
        super().__init__(f"at least {bound:.6g} s, slower than {beat:.6g} s already planned")
        self.bound = bound


def search_micro_batches(
    candidates: Sequence[int], plan: Callable[[int, float], tuple[T, float]]
) -> tuple[T, int, list[tuple[int, float | None]], list[tuple[int, float]]]:
    """The best of ``candidates``: ``plan(B, beat)`` returns (result, predicted seconds), or
    raises ``MemoryBudgetError`` (or ``ConfigError``) where nothing fits at B, or
    ``Dominated`` once it proves B slower than ``beat`` (the fastest count so far; inf before
    any). Returns the fastest result, its B, every B planned with its predicted seconds
    (None: nothing fit) in the order they were planned, and every B dropped as dominated with
    its lower bound."""
    # Seconds (or why not) per count planned; only the fastest result so far is kept, since
    # a plan of a large model holds its jaxprs and cost tables (GiBs at 1T).
    results: dict[int, float | ValueError | Dominated] = {}
    order: list[int] = []
    best: list[tuple[float, int, T]] = []

    def seconds(i: int) -> float:
        """Count ``i``'s predicted seconds; inf where nothing fits, the bound if dominated."""
        b = candidates[i]
        if b not in results:
            try:
                result, t = plan(b, best[0][0] if best else math.inf)
            except (Dominated, MemoryBudgetError, ConfigError) as err:
                results[b] = _without_frames(err)
            else:
                results[b] = t
                if not best or (t, b) < best[0][:2]:
                    best[:] = [(t, b, result)]
                del result
            order.append(b)
        got = results[b]
        if isinstance(got, Dominated):
            return got.bound
        return math.inf if isinstance(got, ValueError) else got

    lo, hi = 0, len(candidates) - 1
    probed = False
    while lo < hi:
        below = results.get(candidates[lo - 1]) if lo else None
        smallest = below is None or isinstance(below, ValueError)
        if not probed and best and best[0][1] == candidates[lo] and smallest:
            # The fastest so far is the smallest count that fits (nothing fits below it, or
            # nothing was planned there): its upper neighbour says at once whether the curve
            # rises from there.
            probed = True
            if not seconds(lo + 1) < seconds(lo):
                break
            lo += 1
            continue
        mid = (lo + hi) // 2
        if not best and candidates[mid] not in results and math.isinf(seconds(mid + 1)):
            lo = min(mid + 2, hi)  # nothing fits at mid + 1, so nothing at mid either
            continue
        here = seconds(mid)
        if math.isinf(here):  # nothing fits yet
            lo = mid + 1
            continue
        side = _known_side(mid, here, {candidates.index(b): t for b, t in _exact(results)})
        if side < 0:
            hi = mid - 1
        elif side > 0 or seconds(mid + 1) < here:  # still falling
            lo = mid + 1
        else:
            hi = mid
    seconds(lo)
    exact = dict(_exact(results))
    tried = [(b, exact.get(b)) for b in order if not isinstance(results[b], Dominated)]
    dominated = [(b, got.bound) for b in order if isinstance(got := results[b], Dominated)]
    if best:
        _, b, result = best[0]
        return result, b, tried, dominated  # type: ignore[return-value]
    errors = [results[b] for b in order]
    text = "; ".join(f"B={b}: {results[b]}" for b in order)[:2000]
    counts = ", ".join(map(str, candidates))
    if all(isinstance(e, MemoryBudgetError) for e in errors):
        budgets = [e.min_budget for e in errors if e.min_budget is not None]  # type: ignore[union-attr]
        raise MemoryBudgetError(
            f"memory_budget: no micro-batch count searched ({counts}) gives a plan that fits "
            f"({text})",
            min(budgets) if budgets else None,
        )
    raise ConfigError(f"num_micro_batches: no count searched ({counts}) can be planned ({text})")


def _without_frames(err: BaseException) -> BaseException:
    """``err`` with no traceback left on it or on the exceptions it chains to: their frames
    hold that count's cost tables (GiBs at 1T: a MemoryBudgetError raised while handling
    the DP's InfeasibleError keeps it as ``__context__``, and that one's traceback keeps
    the stage search's locals alive until the search ends)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo += [e.__cause__, e.__context__]
    return err


def _exact(results: dict[int, float | ValueError | Dominated]) -> list[tuple[int, float]]:
    """The counts planned to the end, with their predicted seconds."""
    return [(b, t) for b, t in results.items() if not isinstance(t, ValueError | Dominated)]


def _known_side(mid: int, here: float, planned: dict[int, float]) -> int:
    """Which side of candidate ``mid`` (seconds ``here``) the fastest lies on, as far as the
    counts already planned prove it: -1 (below) where a smaller count was strictly faster, 1
    (above) where a larger one was, 0 where they do not say. On a curve that falls and then
    rises, a faster count below ``mid`` means the curve is already rising at ``mid``."""
    for j, got in planned.items():
        if not got < here:
            continue
        if j < mid:
            return -1
        if j > mid:
            return 1
    return 0
