"""The planner's memory housekeeping: pages freed on a worker thread go back to the OS, and
the garbage collector's thresholds are raised only while planning runs."""

import gc
import os
import threading

import pytest

from alpa_mini._heap import PLANNING_GC_THRESHOLDS, _malloc_trim, lenient_gc, release_free_memory


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(_malloc_trim() is None, reason="no glibc malloc_trim here")
def test_freed_thread_arena_pages_are_returned():
    # 1 KiB objects bypass pymalloc; one in 64 survives, so the arena cannot shrink from its
    # top and only a trim can return the free pages between the survivors.
    kept: list[bytes] = []

    def churn() -> None:
        chunks = [bytes(1024) + bytes([i % 256]) for i in range(300_000)]
        kept.extend(chunks[::64])
        del chunks

    worker = threading.Thread(target=churn)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive()
    before = _rss_bytes()
    release_free_memory()
    after = _rss_bytes()
    assert before - after > 100 * 2**20, (before, after)
    assert len(kept) == 300_000 // 64 + 1


def test_lenient_gc_raises_the_thresholds_for_its_block_and_restores_them():
    """Inside the block the collector's thresholds are at least ``PLANNING_GC_THRESHOLDS``
    (a caller's higher ones kept); nested and concurrent blocks restore the caller's
    thresholds only when the last one ends, and an exception still restores them."""
    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 20, 5)
        with lenient_gc():
            assert gc.get_threshold() == (PLANNING_GC_THRESHOLDS[0], 20, 10)
            entered, leave = threading.Event(), threading.Event()

            def other() -> None:
                with lenient_gc():
                    entered.set()
                    leave.wait(timeout=30)

            worker = threading.Thread(target=other)
            worker.start()
            assert entered.wait(timeout=30)
        assert gc.get_threshold() == (PLANNING_GC_THRESHOLDS[0], 20, 10)  # the other is in
        leave.set()
        worker.join(timeout=30)
        assert not worker.is_alive()
        assert gc.get_threshold() == (700, 20, 5)
        with pytest.raises(RuntimeError), lenient_gc():
            raise RuntimeError("planning failed")
        assert gc.get_threshold() == (700, 20, 5)
    finally:
        gc.set_threshold(*saved)
