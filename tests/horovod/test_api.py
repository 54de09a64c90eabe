"""mpitrain.horovod's public surface and single-process behaviour (serial tests), plus Horovod's MNIST
example run from outside a job at 2 and 3 ranks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mpitrain.horovod as hvd
from tests.helpers import ROOT

#: horovod.torch's names (0.28.1, horovod/torch/__init__.py) that mpitrain.horovod provides.
HOROVOD_TORCH_NAMES = """
Compression allgather_object broadcast_object broadcast_optimizer_state broadcast_parameters
allreduce allreduce_async allreduce_ allreduce_async_ grouped_allreduce grouped_allreduce_async
grouped_allreduce_ grouped_allreduce_async_ allgather allgather_async grouped_allgather grouped_allgather_async
broadcast broadcast_async broadcast_ broadcast_async_ alltoall alltoall_async reducescatter reducescatter_async
grouped_reducescatter grouped_reducescatter_async join barrier poll synchronize init shutdown is_initialized
start_timeline stop_timeline size local_size cross_size rank local_rank cross_rank mpi_threads_supported
mpi_enabled mpi_built gloo_enabled gloo_built nccl_built ddl_built ccl_built cuda_built rocm_built ProcessSet
global_process_set add_process_set remove_process_set Average Sum Adasum Min Max Product HorovodInternalError
DistributedOptimizer SyncBatchNorm
""".split()


def test_all_is_the_horovod_torch_surface():
    assert sorted(hvd.__all__) == sorted(set(hvd.__all__)), "duplicates in __all__"
    missing = [n for n in HOROVOD_TORCH_NAMES if n not in hvd.__all__ or not hasattr(hvd, n)]
    assert not missing, missing
    assert set(hvd.__all__) - set(HOROVOD_TORCH_NAMES) == {"is_homogeneous"}


def test_refused_parts_say_why():
    for name in ("elastic", "sparse_allreduce_async"):
        with pytest.raises(AttributeError, match="not supported"):
            getattr(hvd, name)


def test_queries_before_init_raise_and_one_process_works():
    hvd.shutdown()
    with pytest.raises(ValueError, match="not been initialized"):
        hvd.rank()
    hvd.init()
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
    t = torch.arange(4.0)
    assert torch.equal(hvd.allreduce(t), t) and torch.equal(hvd.allgather(t), t)
    assert hvd.alltoall(t).tolist() == t.tolist() and hvd.join() == 0
    model = torch.nn.Linear(3, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert isinstance(opt, torch.optim.SGD)
    with pytest.raises(NotImplementedError):
        hvd.start_timeline("x.json")


@pytest.mark.parametrize("ranks", [2, 3])
def test_horovod_mnist_example_reaches_90_percent(ranks):
    launcher = Path(sys.executable).parent / "mpitrain"
    proc = subprocess.run([str(launcher), "run", "-n", str(ranks), "--", sys.executable, "examples/horovod_mnist.py",
                           "--epochs", "6", "--batch-size", "16", "--lr", "0.02"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracies = [float(a) for a in re.findall(r"Accuracy: ([\d.]+)%", proc.stdout)]
    assert len(accuracies) == 6 and accuracies[-1] >= 90.0, proc.stdout[-2000:]


def test_sync_batch_norm_in_one_process_is_batch_norm():
    """A job of one rank: hvd.SyncBatchNorm is torch's BatchNorm2d (output, gradients, running statistics,
    the cumulative average of momentum=None)."""
    hvd.init()
    ref, mine = torch.nn.BatchNorm2d(3, momentum=None).double(), hvd.SyncBatchNorm(3, momentum=None).double()
    for _ in range(2):
        x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
        xr, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
        (ref(xr) ** 2).sum().backward()
        (mine(xm) ** 2).sum().backward()
        torch.testing.assert_close(xm.grad, xr.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(mine.weight.grad, ref.weight.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(mine.state_dict(), ref.state_dict(), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="at least 2D"):
        mine(torch.ones(3, dtype=torch.float64))
