"""The README's quick start, run verbatim as a new user would: extracted from README.md and launched
with ``mpitrain run`` at 2 ranks (its comment says 4; any world size must work)."""

from __future__ import annotations

import re

from tests.helpers import ROOT, run_job


def quick_start() -> str:
    """The first ``python`` block under README.md's "## Quick start" heading."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md: no python block under '## Quick start'"
    return match.group(1)


def test_readme_quick_start_runs_verbatim_on_2_ranks():
    job = run_job(quick_start(), n=2, timeout=180)
    assert job.returncode == 0, job.stderr[-3000:]
    # result.history[-1] printed by each rank: a finite loss after one epoch
    losses = [float(m) for m in re.findall(r"'loss': ([0-9.e+-]+)", job.stdout)]
    assert len(losses) == 2 and all(0 < v < 10 for v in losses), job.stdout[-2000:]
