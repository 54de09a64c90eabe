"""A stalled halo exchange warns (naming the plan) instead of waiting silently, then completes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stalled_halo_exchange_warns_naming_the_ranks_it_waits_for_then_completes():
    script = Path(__file__).with_name("stall_script.py")
    mpitrain = Path(sys.executable).with_name("mpitrain")
    out = subprocess.run([str(mpitrain), "run", "-n", "2", "--", sys.executable, str(script)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rank0 = next(ln for ln in out.stdout.splitlines() if ln.startswith("rank 0"))
    assert "halo [1.0, 1.0, 1.0, 1.0]" in rank0  # the late halo arrived
    assert "halo exchange stalled for 1 s; rank 0: owns [0:4, 0:4]" in rank0 and "<-1" in rank0
