"""Horovod's own example, examples/pytorch/pytorch_mnist.py, as its user runs it with one import changed.

The test makes the example's calls in the example's order (init, DistributedSampler partitions,
broadcast_parameters of the state_dict, broadcast_optimizer_state, DistributedOptimizer with
named_parameters/compression/op/gradient_predivide_factor, lr scaled by size, train epochs with
set_epoch, metric_average through a named allreduce of a 0-dim tensor, join) on MNIST-shaped synthetic
data, and compares with one process training on the concatenated per-rank batches. Two deliberate
changes make the math comparable: float64, and the example's dropout probabilities set to 0 (dropout
draws different masks per rank than one process would).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import torch.utils.data.distributed
from torch import nn

import mpitrain.horovod as hvd
from tests.helpers import assert_all_ranks

from ._util import close

pytestmark = pytest.mark.mpi

BATCH, STEPS, EPOCHS, LR, MOMENTUM = 4, 3, 2, 0.01, 0.5


class Net(nn.Module):
    """The example's network (two convolutions, two linear layers), dropout probability a parameter."""

    def __init__(self, drop: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d(drop)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)
        self.drop = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = F.relu(self.fc1(x.view(-1, 320)))
        x = F.dropout(x, p=self.drop, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def _datasets(size: int) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """MNIST-shaped random train/test sets, the same on every rank; sizes divide evenly over the ranks."""
    g = torch.Generator().manual_seed(0)
    n, m = BATCH * STEPS * size, 5 * size
    train = torch.utils.data.TensorDataset(torch.randn(n, 1, 28, 28, generator=g, dtype=torch.float64),
                                           torch.randint(0, 10, (n,), generator=g))
    test = torch.utils.data.TensorDataset(torch.randn(m, 1, 28, 28, generator=g, dtype=torch.float64),
                                          torch.randint(0, 10, (m,), generator=g))
    return train, test


def _one_process(init: Net, train: torch.utils.data.TensorDataset, size: int, fp16: bool) -> Net:
    """One process on the concatenation of every rank's batch i (the samplers' partitions, epoch by epoch).
    With fp16 compression, as Horovod documents it: each rank's gradient is rounded to float16, then averaged."""
    ref = copy.deepcopy(init)
    opt = torch.optim.SGD(ref.parameters(), lr=LR * size, momentum=MOMENTUM)
    samplers = [torch.utils.data.distributed.DistributedSampler(train, num_replicas=size, rank=r) for r in range(size)]
    x, y = train.tensors
    for epoch in range(1, EPOCHS + 1):
        parts = []
        for s in samplers:
            s.set_epoch(epoch)
            parts.append(list(s))
        for i in range(STEPS):
            batches = [p[i * BATCH:(i + 1) * BATCH] for p in parts]
            opt.zero_grad()
            if fp16:
                grads = []
                for b in batches:
                    ref.zero_grad()
                    F.nll_loss(ref(x[b]), y[b]).backward()
                    grads.append([q.grad.half().double() for q in ref.parameters()])
                for j, q in enumerate(ref.parameters()):
                    q.grad = sum(g[j] for g in grads) / size
            else:
                idx = [k for b in batches for k in b]
                F.nll_loss(ref(x[idx]), y[idx]).backward()
            opt.step()
    return ref


@pytest.mark.parametrize("fp16, predivide", [(False, 1.0), (True, 2.0)])
def test_pytorch_mnist_example_matches_one_process(comm, fp16, predivide):
    """pytorch_mnist.py's sequence of calls: after 2 epochs every rank holds the parameters of one process
    trained on the concatenated batches (float64: 1e-12; fp16 compression: Horovod's documented rounding,
    1e-5), and metric_average's test loss and accuracy equal one process's over the whole test set."""
    hvd.init()
    threads = torch.get_num_threads()
    torch.manual_seed(42 + hvd.rank())  # different initial weights: broadcast_parameters must fix them
    torch.set_num_threads(1)
    try:
        train_dataset, test_dataset = _datasets(hvd.size())
        train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, num_replicas=hvd.size(),
                                                                        rank=hvd.rank())
        train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=BATCH, sampler=train_sampler)
        test_sampler = torch.utils.data.distributed.DistributedSampler(test_dataset, num_replicas=hvd.size(),
                                                                       rank=hvd.rank())
        test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=1000, sampler=test_sampler)

        model = Net(drop=0.0).double()
        init = copy.deepcopy(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR * hvd.size(), momentum=MOMENTUM)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        init = comm.broadcast_object(init, 0)  # the reference starts from rank 0's weights, as broadcast
        compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression, op=hvd.Average,
                                             gradient_predivide_factor=predivide)
        for epoch in range(1, EPOCHS + 1):
            model.train()
            train_sampler.set_epoch(epoch)
            for data, target in train_loader:
                optimizer.zero_grad()
                F.nll_loss(model(data), target).backward()
                optimizer.step()
        loss, accuracy = _test_metrics(model, test_loader, len(test_sampler))
        last = hvd.join()
    finally:
        torch.set_num_threads(threads)

    ref = _one_process(init, train_dataset, hvd.size(), fp16)
    tol = 1e-5 if fp16 else 1e-12
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        close(comm, p.detach(), q.detach(), what=name, tol=tol)
    ref.eval()
    with torch.no_grad():
        out = ref(test_dataset.tensors[0])
        ref_loss = F.nll_loss(out, test_dataset.tensors[1]).item()
        ref_acc = out.argmax(1).eq(test_dataset.tensors[1]).double().mean().item()
    # metric_average allreduces torch.tensor(python float): float32, as in Horovod
    assert_all_ranks(comm, abs(loss - ref_loss) <= (1e-4 if fp16 else 1e-6) * abs(ref_loss),
                     f"test loss {loss} vs one process {ref_loss}")
    assert_all_ranks(comm, abs(accuracy - ref_acc) <= 1e-6, f"accuracy {accuracy} vs one process {ref_acc}")
    assert_all_ranks(comm, len(set(comm.allgather_object(last))) == 1 and 0 <= last < hvd.size(),
                     f"join() returned {last}")


def _test_metrics(model: nn.Module, loader: torch.utils.data.DataLoader, n: int) -> tuple[float, float]:
    """The example's test(): per-rank sums over this rank's partition, divided by its length, then averaged
    over the ranks by metric_average (hvd.allreduce of torch.tensor(value), named)."""

    def metric_average(val: object, name: str) -> float:
        return float(hvd.allreduce(torch.tensor(val), name=name).item())

    model.eval()
    test_loss, test_accuracy = 0.0, torch.tensor(0.0)
    with torch.no_grad():
        for data, target in loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.max(1, keepdim=True)[1]
            test_accuracy += pred.eq(target.view_as(pred)).float().sum()
    return (metric_average(test_loss / n, "avg_loss"),
            metric_average(float(test_accuracy / n), "avg_accuracy"))


# -- pytorch_synthetic_benchmark.py: torchvision models built with norm_layer=hvd.SyncBatchNorm ----------
@pytest.mark.parametrize("shape, momentum, uneven", [((3, 4, 5, 5), 0.1, False), ((3, 4, 5, 5), None, True),
                                                     ((3, 4), 0.3, True), ((2, 4, 3, 3, 3), 0.1, False)])
def test_sync_batch_norm_matches_batch_norm_on_the_global_batch(comm, shape, momentum, uneven):
    """hvd.SyncBatchNorm on each rank's batch (sizes may differ by rank) equals torch's BatchNorm in one
    process on the concatenated batch (float64): output, input gradient, the sum over ranks of the weight
    and bias gradients, running statistics and num_batches_tracked after two training steps, and eval output.
    The loss of one process is the sum of the ranks' losses (the global batch's)."""
    hvd.init()
    counts = [shape[0] + (r % 2 if uneven else 0) for r in range(comm.size)]
    g = torch.Generator().manual_seed(3)
    bn_cls = {2: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}[len(shape)]
    ref = bn_cls(shape[1], momentum=momentum).double()
    mine = hvd.SyncBatchNorm(shape[1], momentum=momentum).double()
    with torch.no_grad():
        for layer in (ref, mine):
            layer.weight.copy_(torch.linspace(0.5, 2.0, shape[1]))
            layer.bias.copy_(torch.linspace(-1.0, 1.0, shape[1]))
    start = sum(counts[:comm.rank])
    for _ in range(2):
        xs = torch.randn(sum(counts), *shape[1:], generator=g, dtype=torch.float64) * 3 + 1
        w = torch.randn(xs.shape, generator=g, dtype=torch.float64)
        x_all, x = xs.clone().requires_grad_(), xs[start:start + counts[comm.rank]].clone().requires_grad_()
        for layer in (ref, mine):
            layer.zero_grad()
        y_all = ref(x_all)
        (y_all * w).sum().backward()
        y = mine(x)
        (y * w[start:start + counts[comm.rank]]).sum().backward()
        close(comm, y.detach(), y_all.detach()[start:start + counts[comm.rank]], what="output", tol=1e-12)
        close(comm, x.grad, x_all.grad[start:start + counts[comm.rank]], what="input grad", tol=1e-12)
        for name in ("weight", "bias"):
            total = hvd.allreduce(getattr(mine, name).grad, op=hvd.Sum, name=f"bn.{name}")
            close(comm, total, getattr(ref, name).grad, what=f"{name} grad", tol=1e-12)
    close(comm, mine.running_mean, ref.running_mean, what="running_mean", tol=1e-12)
    close(comm, mine.running_var, ref.running_var, what="running_var", tol=1e-12)
    close(comm, mine.num_batches_tracked, ref.num_batches_tracked, what="num_batches_tracked")
    mine.eval()
    ref.eval()
    close(comm, mine(xs[start:start + 1]).detach(), ref(xs[start:start + 1]).detach(), what="eval", tol=1e-12)


def test_sync_batch_norm_model_with_distributed_optimizer_matches_one_process(comm):
    """pytorch_synthetic_benchmark.py's shape: a CNN with hvd.SyncBatchNorm trained by DistributedOptimizer
    (small buckets, so gradient buckets are in flight while SyncBatchNorm's backward allreduce runs) equals
    one process with BatchNorm2d on the concatenated batches (float64, 3 steps, then eval outputs)."""
    hvd.init()

    def cnn(norm: type[nn.Module]) -> nn.Module:
        torch.manual_seed(5)
        return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), norm(6), nn.ReLU(), nn.Conv2d(6, 6, 3), norm(6),
                             nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(24, 10)).double()

    ref, model = cnn(nn.BatchNorm2d), cnn(hvd.SyncBatchNorm)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), bucket_mb=0.0005, first_bucket_mb=0.0002)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    g = torch.Generator().manual_seed(9)
    per = 3
    for _ in range(3):
        x = torch.randn(per * comm.size, 3, 8, 8, generator=g, dtype=torch.float64)
        y = torch.randint(0, 10, (per * comm.size,), generator=g)
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        mine = slice(per * comm.rank, per * (comm.rank + 1))
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
    assert_all_ranks(comm, len(opt.buckets) > 1, f"{len(opt.buckets)} bucket(s)")
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values()):
        close(comm, p, q, what=name, tol=1e-12)
    model.eval()
    ref.eval()
    close(comm, model(x).detach(), ref(x).detach(), what="eval output", tol=1e-12)
