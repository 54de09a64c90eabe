"""A stage waiting for a message that never comes warns naming it, then ends the job (seen from outside)."""

from __future__ import annotations

import textwrap

from tests.helpers import run_job

SCRIPT = textwrap.dedent("""
    import time, torch
    from torch import nn
    import mpitrain
    from mpitrain.fit import fit

    comm = mpitrain.init()
    calls = []

    def loss_fn(out, y):  # the last partition (rank 1) hangs in its second step
        calls.append(1)
        if len(calls) > 2:
            time.sleep(20)
        return nn.functional.cross_entropy(out, y)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    data = [(torch.randn(4, 4), torch.randint(0, 3, (4,))) for _ in range(3)]
    fit(model, data, loss_fn, lambda p: torch.optim.SGD(p, lr=0.1), strategy="model", partitions=2,
        micro_batches=2, progress=False, balance="params", warn_after=0.5, abort_after=3.0)
""")


def test_stalled_partition_warns_naming_the_message_then_ends_the_job():
    proc = run_job(SCRIPT, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "rank 0: still waiting" in out and "from partition 1 (rank 1), in partition 0" in out, out
    assert "aborting the job" in out, out
