"""The `--device cuda` tables of `bench pipeline` and `bench spatial` are device-generic: on this
rank's device (the CPU here; a GPU on a GPU machine) every contender trains and is timed against plain
torch in one process, which is its own reference (ratio 1). Tiny models: this checks that the tables
run at every world size, not speed."""

from __future__ import annotations

import pytest

from mpitrain.bench import _pipeline_cuda, _spatial_cuda, pipeline, spatial
from tests.helpers import assert_all_ranks

pytestmark = pytest.mark.mpi


@pytest.mark.timeout(240)
def test_pipeline_device_table_times_every_schedule_against_one_process(comm):
    args = pipeline._parse(["--device", "cuda", "--mlp-depth", "4", "--mlp-width", "16", "--batch", "24",
                            "--micro-batches", "4", "--rounds", "1", "--steps", "1", "--precisions", "fp32"])
    rows = _pipeline_cuda.run(args)
    size = comm.size
    labels = ["torch, 1 process", "torch, 1 process, M=4", "model gpipe", "model 1f1b"]
    labels += ["model interleaved-1f1b"] if 4 % size == 0 else []
    labels += ["hybrid 1f1b (P=2)"] if size >= 4 and size % 2 == 0 else []
    labels += ["data"]
    got = [r[1] for r in rows]
    assert_all_ranks(comm, got == labels, f"contenders {got}, expected {labels}")
    assert_all_ranks(comm, all(r[4] > 0 for r in rows), "every contender has a positive ms/step")
    assert_all_ranks(comm, rows[0][7] == 1.0 and [r[2] for r in rows[2:4]] == [size, size],
                     "torch is its own reference; the model pipelines span every rank")


@pytest.mark.timeout(240)
def test_spatial_device_table_times_every_grid_against_one_process(comm):
    args = spatial._parse(["--device", "cuda", "--size", "32", "--widths", "4,8", "--convs", "1", "--batch", "2",
                           "--rounds", "1", "--precisions", "fp32"])
    args.formats = ["nchw"]
    model, x, y, title = spatial._workload(args)
    grids = [((comm.size, 1), 1)]
    rows = _spatial_cuda.run(args, model, x, y, title, grids, spatial._fmt)
    labels = ["torch, 1 process (nchw, fp32)", f"spatial {comm.size}x1 (nchw, fp32)",
              f"spatial {comm.size}x1 (nchw, fp32) no-overlap"]
    got = [r[0] for r in rows]
    assert_all_ranks(comm, got == labels, f"contenders {got}, expected {labels}")
    assert_all_ranks(comm, all(r[3] > 0 and r[8] > 0 for r in rows), "every contender has a time and a memory")
    assert_all_ranks(comm, rows[0][6] == 1.0 and rows[1][1] == comm.size, "torch is its own reference")
