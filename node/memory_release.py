"""Hand the heap's free pages back to the OS once a round's checkpoint is written.

glibc raises its mmap threshold each time a large mmapped block is freed (up to 32 MiB on 64-bit),
after which model-sized buffers — gradients, optimizer temporaries, encodings, staging copies —
come from the heap, and what a round frees stays resident: a lone node with a 21 MB MLP (Adam)
sat at 914–970 MB RSS after 14 rounds. ``malloc_trim(0)`` returns every whole free page, at rest
(after the write, not per step, so training keeps reusing its heap): 527–592 MB on the same run
(issue 34 item 2; docs/running-a-node.md). Pinning the mmap threshold instead cut as much but made
rounds ~30% slower (a page fault per page of every large allocation, every step).
No-op where the C library has no malloc_trim (musl, macOS).

``limit_malloc_arenas`` caps glibc's per-thread arenas (``M_ARENA_MAX``), set at start-up by
``run_node`` so that it holds under any launcher (CLI, systemd unit, forked lab nodes): by default
glibc gives each thread that meets contention its own arena, up to 8 per core, and gRPC's and
torch's worker threads each grow theirs in steps of a few MB that a trim rarely gives back
(bench/results/soak.md).

``map_large_buffers`` pins glibc's mmap threshold (set by the learner for a model with a tensor of
16 MiB or more, ``learner.mmap_threshold_mb``) and puts its heap trim threshold back at glibc's
default: with the moving threshold, each step's gradient of a large weight and Adam's temporaries
landed in other holes of the heap from step to step, and the heap's free top stayed resident up
to twice the threshold (64 MiB): a forked ``local`` node with a 21 MB MLP touched ~80 MB over its
rest in a round for ~30 MB alive (bench/results/memory.md, branch localpeak)."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Callable

log = logging.getLogger(__name__)


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's, from the process's own symbols
    except (OSError, AttributeError):
        return None


_TRIM = _malloc_trim()

M_ARENA_MAX = -8  # glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 128 * 1024  # glibc's own default, before its moving threshold raises it
ARENAS = 2  # the main arena and one shared by every other thread


def _mallopt() -> Callable[[int, int], int] | None:
    if _TRIM is None:  # not glibc
        return None
    try:
        return ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None


def limit_malloc_arenas(arenas: int = ARENAS) -> int | None:
    """Cap glibc's malloc arenas for threads created from now on; returns the cap in force, or
    None where the C library has no such knob. An operator's ``MALLOC_ARENA_MAX`` wins."""
    mallopt = _mallopt()
    if mallopt is None:
        return None
    if os.environ.get("MALLOC_ARENA_MAX", "").strip():
        return int(os.environ["MALLOC_ARENA_MAX"]) if os.environ["MALLOC_ARENA_MAX"].strip().isdigit() else None
    try:
        return arenas if mallopt(M_ARENA_MAX, arenas) == 1 else None
    except OSError as e:  # never fatal: glibc's default stays
        log.debug("mallopt(M_ARENA_MAX) failed: %s", e)
        return None


def release_free_memory() -> bool:
    """Return the heap's free pages to the OS; True when the C library could (glibc)."""
    if _TRIM is None:
        return False
    try:
        return bool(_TRIM(0))
    except OSError as e:  # never fatal: memory stays as it was
        log.debug("malloc_trim failed: %s", e)
        return False


def map_large_buffers(threshold: int) -> int | None:
    """Serve every allocation of at least ``threshold`` bytes (at most glibc's 32 MiB) from its own
    mapping, handed back to the OS when freed, and hand the heap's free top back past glibc's
    default 128 KiB; returns the threshold in force, or None where the C library has no such knob
    or the operator set ``MALLOC_MMAP_THRESHOLD_`` (theirs wins). Pinning ends glibc's moving
    threshold, which raises the trim threshold to twice its own (up to 64 MiB of free heap top left
    resident: a forked node's peak 230 MB with 128 KiB against 254 on main). A threshold under a
    model-sized tensor maps its gradient afresh each step: a lower peak again (~203 MB), but every
    page faulted anew each step (rounds ~20% slower at full rate; 1 MiB: ~30%)."""
    if threshold <= 0:
        raise ValueError(f"an mmap threshold must be a positive number of bytes, not {threshold}")
    mallopt = _mallopt()
    if mallopt is None or os.environ.get("MALLOC_MMAP_THRESHOLD_", "").strip():
        return None
    try:
        if mallopt(M_MMAP_THRESHOLD, threshold) != 1:
            return None  # above glibc's maximum (32 MiB on 64-bit): its default stays
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        return threshold
    except OSError as e:  # never fatal: glibc's default stays
        log.debug("mallopt(M_MMAP_THRESHOLD) failed: %s", e)
        return None
