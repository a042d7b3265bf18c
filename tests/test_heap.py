"""The planner's heap trim: pages freed on a worker thread go back to the OS."""

import os
import threading

import pytest

from alpa_mini._heap import _malloc_trim, release_free_memory


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
