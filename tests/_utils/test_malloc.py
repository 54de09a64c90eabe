"""_utils/malloc: the mmap threshold is only ever lowered (in a fresh process: it is process-wide)."""

from __future__ import annotations

import subprocess
import sys


def test_threshold_is_lowered_never_raised_and_free_memory_released():
    code = (
        "from mpitrain._utils.malloc import GLIBC_LARGEST, lower_mmap_threshold, mmap_threshold, release_free_memory\n"
        "assert mmap_threshold() == 32 << 20, mmap_threshold()\n"
        "assert lower_mmap_threshold(64 << 20) == 32 << 20\n"
        "assert lower_mmap_threshold(8 << 20) == 8 << 20 == mmap_threshold()\n"
        "assert lower_mmap_threshold(16 << 20) == 8 << 20\n"
        "assert release_free_memory()\n")
    env = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
