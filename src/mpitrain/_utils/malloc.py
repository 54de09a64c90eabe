"""glibc's malloc tunables at run time (``mallopt``), where the process runs on glibc; nothing elsewhere.

Why a library touches the allocator: torch allocates large CPU tensors with ``posix_memalign``, which
glibc serves by asking its heap for the size plus the alignment (2 MiB under the launcher's
``THP_MEM_ALLOC_ENABLE=1``). A freed block of exactly that size can therefore never serve the next
request of its own size unless a free neighbour joins it, and the small allocations made meanwhile
take those neighbours: a training step's weight-gradient temporaries (one per weight per
micro-batch, as large as the weight) keep extending the heap, which glibc keeps (the launcher's
``MALLOC_TRIM_THRESHOLD_``). Blocks at or above the mmap threshold get their own mapping instead,
returned to the kernel when freed; the launcher sets 32 MiB (glibc's largest) so that activations are
reused without page faults (docs/ARCHITECTURE.md, "Starting ranks")."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["GLIBC_LARGEST", "mmap_threshold", "lower_mmap_threshold", "release_free_memory"]

#: glibc's largest mmap threshold (its dynamic threshold's ceiling on 64-bit), the launcher's default
GLIBC_LARGEST = 32 << 20
_M_MMAP_THRESHOLD = -3  # malloc.h
_set: int | None = None


def _glibc(name: str) -> object | None:
    """The glibc function `name`, or None on another C library."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return getattr(libc, name, None) if hasattr(libc, "gnu_get_libc_version") else None


def mmap_threshold() -> int:
    """The mmap threshold this process runs with: the last one set here, else ``MALLOC_MMAP_THRESHOLD_``
    from the environment, else :data:`GLIBC_LARGEST` (where glibc's dynamic threshold ends up)."""
    if _set is not None:
        return _set
    value = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    return int(value) if value.isdigit() else GLIBC_LARGEST


def lower_mmap_threshold(nbytes: int) -> int:
    """Make glibc give every block of at least `nbytes` its own mapping, unless the threshold is already
    lower (never raised: a user's lower choice stands). Returns the threshold in force afterwards
    (unchanged where the C library is not glibc). Process-wide and lasting, as ``mallopt`` is."""
    global _set
    now = mmap_threshold()
    if nbytes >= now:
        return now
    mallopt = _glibc("mallopt")
    if mallopt is None or not mallopt(_M_MMAP_THRESHOLD, int(nbytes)):  # type: ignore[operator]
        return now
    _set = int(nbytes)
    return _set


def release_free_memory() -> bool:
    """Return the free memory glibc keeps in its heaps to the kernel (``malloc_trim(0)``), so that a
    measurement of the resident set that starts now counts memory a run reuses. False where the C
    library is not glibc."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim(0)  # type: ignore[operator]
    return True
