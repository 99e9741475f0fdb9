"""A node hands the heap's free pages back after each checkpoint write (node/memory_release.py).
The attack on RSS it defends against: glibc's dynamic mmap threshold, after one large block is
freed, serves later model-sized buffers from the heap and keeps them resident once freed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# glibc's own choices (dynamic mmap threshold, automatic trimming of the heap top) are pinned
# rather than provoked: on CI's host, freeing torch's buffers alone already gave the pages back
# (471 -> 231 MB), so a probe relying on glibc's heuristics could not tell the release from them.
PROBE = textwrap.dedent(
    """
    import ctypes
    from coterie.node.memory_release import release_free_memory
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 1e6
    # pin glibc's choices so freeing alone cannot give pages back: large blocks from the heap, no
    # automatic trimming of its top
    assert libc.mallopt(-3, 32 * 1024 * 1024) == 1  # M_MMAP_THRESHOLD
    assert libc.mallopt(-1, 1 << 30) == 1  # M_TRIM_THRESHOLD
    big, small = [], []
    for _ in range(30):
        p = libc.malloc(8 << 20)
        ctypes.memset(p, 1, 8 << 20)
        big.append(p)
        small.append(libc.malloc(64))
    before = rss_mb()
    for p in big:
        libc.free(p)
    freed = rss_mb()
    ok = release_free_memory()
    after = rss_mb()
    print(f"{before:.0f} {freed:.0f} {after:.0f} {ok}")
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim: Linux only")
def test_free_heap_pages_go_back_to_the_os() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, freed, after, ok = out.stdout.split()
    if ok != "True":
        pytest.skip("this C library has no malloc_trim (not glibc)")
    # with trimming of the top pinned off, freeing alone leaves the 240 MB resident (seen: 267 ->
    # 267 MB); the release hands the whole free pages back (seen: -> 15 MB)
    assert float(freed) > float(before) - 50, f"freeing alone gave the pages back: {out.stdout}"
    assert float(after) < float(freed) - 150, f"RSS with the buffers / freed / released (MB): {out.stdout}"
