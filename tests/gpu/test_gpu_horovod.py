"""mpitrain.horovod on CUDA tensors, at 2, 3 and 4 ranks sharing the GPU(s) (the engine always runs on the
MPI backend: CUDA-aware MPI directly, else host staging). Every collective (sync and async, grouped/fused,
every op and dtype) on CUDA tensors equals the same call on CPU tensors (bitwise where MPI reduces on the
host for both), with results on the input's device; the stream rule holds for an input produced late on a
non-default stream; DistributedOptimizer training of a CUDA model equals one process; broadcast_parameters
and broadcast_optimizer_state of CUDA state. The same checks run on the CPU in
tests/horovod/test_device_paths.py. Skipped, saying why, where torch sees no GPU."""

from __future__ import annotations

import pytest
import torch

import mpitrain.horovod as hvd
from mpitrain.comm.compose import direct_devices
from mpitrain.horovod._basics import state
from tests.gpu._cuda import needs_cuda
from tests.helpers import assert_all_ranks
from tests.horovod import _device_checks as hc
from tests.horovod._util import raises_everywhere
from tests.strategies import _device_checks as dc

pytestmark = [pytest.mark.mpi, *needs_cuda]
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _init(comm):
    hvd.init()  # once; again only if another test module shut it down


def staged() -> bool:
    """Whether the engine stages CUDA tensors through host memory (then results are bitwise the CPU's)."""
    return "cuda" not in direct_devices(state().engine.comms[0])


def test_collectives_on_cuda_tensors_equal_the_cpu_ones_on_the_input_device(comm, device):
    want = hc.run_collectives(CPU)
    got = hc.run_collectives(device)
    hc.assert_same_results(comm, got, want, bitwise=staged())


def test_allreduce_waits_for_an_input_produced_late_on_a_side_stream(comm, device):
    """The op must run after the caller's current stream has produced the input, even when that
    stream is busy (a long sleep kernel first) and is not the default stream."""
    side = torch.cuda.Stream(device=device)
    x = torch.zeros(1 << 16, device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~25 ms of GPU time before the input gets its value
        x.fill_(comm.rank + 1.0)
        hvd.synchronize(hvd.allreduce_async_(x, op=hvd.Sum))  # in place: a read too early sums zeros
    expect = comm.size * (comm.size + 1) / 2
    ok = bool((x.cpu() == expect).all())
    assert_all_ranks(comm, ok, "allreduce read its input before the producing stream finished")


def test_cpu_tensor_on_one_rank_and_cuda_on_the_others_fails_on_every_rank(comm, device):
    """Horovod's "mismatched CPU/GPU device" check: the device type is part of the signature; the
    engine stays usable afterwards."""
    t = torch.ones(4, device=CPU if comm.rank == 0 else device)
    raises_everywhere(comm, hvd.HorovodInternalError, lambda: hvd.allreduce(t, op=hvd.Sum), "devices")
    y = hvd.allreduce(torch.ones(4, device=device), op=hvd.Sum)
    assert_all_ranks(comm, y.is_cuda and bool((y.cpu() == comm.size).all()), "engine unusable after a mismatch")


def test_distributed_optimizer_of_a_cuda_model_equals_one_process(comm, device):
    got = hc.train_distributed_optimizer(device)
    dc.assert_one_process(comm, got, dc.train_one_process(comm.size, device), f"DistributedOptimizer on {device}")


def test_broadcast_parameters_of_a_cuda_model_makes_every_rank_the_roots(comm, device):
    for root in range(comm.size):
        model = dc.fresh_model(device)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(comm.rank)
        hvd.broadcast_parameters(model.state_dict(), root_rank=root)
        want = [p.detach().cpu() + root for p in dc.fresh_model(device).parameters()]
        got = [p.detach() for p in model.parameters()]
        ok = all(g.device == torch.device(device) for g in got)
        ok = ok and all(torch.equal(g.cpu(), w) for g, w in zip(got, want))
        assert_all_ranks(comm, ok, f"broadcast_parameters from {root}: not root's parameters on {device}")


def test_broadcast_optimizer_state_sends_cuda_adam_state_whole(comm, device):
    hc.assert_adam_state_broadcast(comm, device)


def test_sync_batch_norm_on_cuda_equals_the_cpu_layer(comm, device):
    """hvd.SyncBatchNorm (Horovod's synthetic benchmark's norm layer) on CUDA inputs: output, input
    gradient, weight/bias gradients and running statistics equal the same layer on the CPU (float64; the
    CPU layer equals one process, tests/horovod/test_examples.py), two training steps."""
    g = torch.Generator().manual_seed(4 + comm.rank)
    layers = {d: hvd.SyncBatchNorm(5).double().to(d) for d in (CPU, device)}
    results: dict[torch.device, list[torch.Tensor]] = {CPU: [], device: []}
    on_input_device = True
    for _ in range(2):
        x = torch.randn(3 + comm.rank % 2, 5, 4, 4, generator=g, dtype=torch.float64) * 2 + 1
        w = torch.randn(x.shape, generator=g, dtype=torch.float64)
        for d, layer in layers.items():
            layer.zero_grad()
            xd = x.to(d).requires_grad_()
            y = layer(xd)
            (y * w.to(d)).sum().backward()
            on_input_device &= y.device == xd.device
            results[d] += [y.detach().cpu(), xd.grad.cpu(), layer.weight.grad.cpu(), layer.bias.grad.cpu()]
    for d, layer in layers.items():
        results[d] += [layer.running_mean.cpu(), layer.running_var.cpu()]
    assert_all_ranks(comm, on_input_device, "output not on the input's device")
    for i, (got, want) in enumerate(zip(results[device], results[CPU])):
        ok = torch.allclose(got, want, rtol=0, atol=1e-10)
        assert_all_ranks(comm, ok, f"result {i}: max err {(got - want).abs().max().item()}")
