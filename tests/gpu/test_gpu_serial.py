"""One rank on one GPU: device binding, both backends on CUDA tensors, DataParallel/fit on a CUDA model
equal to plain torch. Skipped, saying why, where torch sees no GPU."""

from __future__ import annotations

import pytest
import torch

import mpitrain
from tests.gpu._cuda import needs_cuda
from tests.helpers import ROOT, run_job
from tests.strategies import _device_checks as dc

pytestmark = needs_cuda
CUDA = torch.device("cuda", 0)


def test_init_binds_a_lone_rank_to_cuda_0():
    mpitrain.init()
    assert mpitrain.device() == CUDA and torch.cuda.current_device() == 0


def test_mpi_backend_reduces_cuda_tensors_direct_and_staged():
    from mpi4py import MPI

    from mpitrain.comm.compose import mpi_communicator

    for direct in (None, frozenset({"cpu"})):  # the default (CUDA-aware or not), then staging forced
        comm = mpi_communicator(MPI.COMM_SELF, direct=direct)
        t = torch.arange(10, dtype=torch.float32, device=CUDA)
        assert comm.allreduce(t, "avg") is t and torch.equal(t.cpu(), torch.arange(10, dtype=torch.float32))
        assert comm.allgather(t).device == t.device
        out = torch.empty_like(t)
        comm.sendrecv(t, 0, out, 0)
        assert torch.equal(out, t)


@pytest.mark.parametrize("kvstore", ["local", "depchain", "dist_sync_mpi"])
def test_data_parallel_on_cuda_at_world_size_one_equals_plain_torch(kvstore):
    comm = mpitrain.init()
    got = dc.train_data_parallel(comm, kvstore, CUDA)
    dc.assert_one_process(comm, got, dc.train_one_process(1, CUDA), f"{kvstore} on cuda")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fit_data_on_cuda_at_world_size_one_equals_plain_torch(precision):
    comm = mpitrain.init()
    got = dc.train_fit(comm, CUDA, precision)
    ref = dc.train_one_process(1, CUDA, precision)
    dc.assert_one_process(comm, got, ref, f"fit {precision} on cuda", atol=dc.ATOL if precision == "fp32" else 1e-2)


def test_torch_backend_runs_nccl_for_cuda_and_gloo_for_cpu_in_one_job():
    job = run_job(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        import torch, mpitrain
        from tests.strategies import _device_checks as dc
        comm = mpitrain.init("torch")
        dev = mpitrain.device()
        g, c = torch.ones(4, device=dev), torch.ones(4)
        comm.allreduce(g); comm.allreduce(c)
        assert g.device == dev and c.device.type == "cpu"
        got = dc.train_data_parallel(comm, "dist_sync_mpi", dev)
        dc.assert_one_process(comm, got, dc.train_one_process(comm.size, dev), "torch backend", atol=1e-5)
        print("OK", dev)
    """, n=1, timeout=300)
    assert job.returncode == 0 and "OK cuda" in job.stdout, job.stdout + job.stderr


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_cuda_transformer_is_exported_on_cuda_from_a_loaders_cpu_rows(name):
    """torch.export refused a CUDA model's embedding of CPU token ids (issue #30): capture moves the
    sample to the parameters' device first."""
    from mpitrain.strategies.pipeline._graph import capture
    from tests.strategies.pipeline.tiny_transformers import build, lm_batches

    model = build(name).to(CUDA)
    (inputs, _), = lm_batches(4, 1)
    traced = capture(model, inputs)
    assert traced.how == "export" and {p.meta["val"].device for p in traced.placeholders} == {CUDA}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_model_fit_of_a_cuda_transformer_on_one_rank_equals_one_process(name):
    """The conformance test of tests/strategies/pipeline at world size 1 (one partition), on CUDA."""
    from tests.strategies.pipeline.test_transformers_mpi import (
        test_default_config_transformer_trains_like_one_process_under_every_strategy_and_schedule as conformance,
    )

    conformance(mpitrain.init(), CUDA, name)
