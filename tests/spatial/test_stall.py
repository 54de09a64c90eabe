"""A stalled halo exchange warns (naming the plan) instead of waiting silently, then completes."""

from __future__ import annotations

import re
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


def test_a_halo_wait_past_abort_after_ends_the_job_naming_the_ranks_it_waits_for():
    """Rank 1 never sends its halo: rank 0 warns after 1 s, and after 2 s the stall monitor says which
    exchange and ranks it gave up on and aborts, so the job ends long before rank 1's 60 s sleep."""
    import time

    from tests.helpers import run_job

    t0 = time.monotonic()
    job = run_job("""
        import time
        import torch
        import mpitrain
        from mpitrain._utils.stall import StallPolicy
        from mpitrain.spatial._exchange import start_exchange, wait_all
        from mpitrain.spatial.halo import plan_halo, window_of

        comm = mpitrain.init()
        plan = plan_halo((8, 4), (2, 1), window_of(3, 1, 1, 1), comm.rank)
        if comm.rank == 1:
            time.sleep(60)
        ex = start_exchange(torch.zeros((1, 1, *plan.owned.shape)), plan, comm)
        wait_all(ex.requests, plan, StallPolicy(warn_after=1.0, abort_after=2.0), comm.abort)
        print("rank", comm.rank, "completed")
    """, timeout=60)
    assert job.returncode != 0 and "completed" not in job.stdout, job.stdout + job.stderr
    assert re.search(r"\[mpitrain\] halo exchange gave up after [23]s; rank 0: owns \[0:4, 0:4\]", job.stderr), \
        job.stderr[-2000:]
    assert "<-1" in job.stderr and "aborting the job" in job.stderr
    assert time.monotonic() - t0 < 40
