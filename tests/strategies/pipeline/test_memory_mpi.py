"""What a pipeline rank holds beyond its partition: gradients in buckets allocated once, no whole-model
gradient while timing a CPU-built model, the replicas' average in place (issue #27)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mpitrain import Pipeline
from mpitrain._utils.malloc import mmap_threshold
from mpitrain.fit import fit
from mpitrain.perf.memory import step_memory
from mpitrain.strategies.pipeline._pipe import OWN_MAPPING_FROM
from tests.helpers import assert_all_ranks

from .models import batches, reference_train
from .test_meta_mpi import Deep, sgd


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.mpi
def test_cpu_model_grows_by_its_partitions_gradients_with_either_balance(comm, monkeypatch):
    """A model the user built on the CPU (every rank holds it whole): fit adds about this rank's share of
    the gradients, with balance="time" too (each rank times only its own partitions: a whole-graph timing
    would hold the whole model's gradients on every rank, 1/2 of params + grads, and is patched to fail);
    with replicas the average is reduced in place (no flat copy of the gradients). Tensor-level peak
    (perf.memory.step_memory, allocator-independent), weights equal one process's."""
    import mpitrain.strategies.pipeline._graph as graph_module
    import mpitrain.strategies.pipeline._pipe as pipe_module

    def whole_graph(*args, **kwargs):
        raise AssertionError("a rank timed the whole model")

    for module in (graph_module, pipe_module):
        monkeypatch.setattr(module, "measure", whole_graph, raising=False)
    made, build = [], pipe_module.Pipeline.__init__

    def remember(self, *args, **kwargs):  # the pipeline fit builds: the parameters this rank ends up with
        build(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(pipe_module.Pipeline, "__init__", remember)
    torch.manual_seed(0)
    reference = Deep().double()
    full = 2 * _bytes(reference.parameters())  # one process's params + grads
    data = [(x.double(), y) for x, y in batches((128,), 8, 2, seed=3)]
    layouts = [(comm.size, 1)] + ([(2, 2)] if comm.size == 4 else [])
    for (P, R), balance in [(layout, b) for layout in layouts for b in ("params", "time")]:
        model, result = copy.deepcopy(reference), {}

        def train(model=model, result=result, P=P, balance=balance):
            result["fit"] = fit(model, data, nn.CrossEntropyLoss(), sgd, strategy="hybrid", partitions=P,
                                micro_batches=2, progress=False, balance=balance)

        grown = step_memory(train)
        want = reference_train(reference, data, sgd, R * 2)
        errors = [(a - b).abs().max().item() for a, b in zip(result["fit"].model.parameters(), want.parameters())]
        what = f"P={P}, R={R}, balance={balance!r}"
        assert_all_ranks(comm, max(errors) <= 1e-12, f"{what}: rank {comm.rank} errors {errors}")
        # the gradients of the partitions this rank holds (a timed split follows the machine's noise, so
        # the share is read, not assumed 1/P), one layer's temporary weight gradient (the second
        # micro-batch's, added into .grad), one layer's slack and activations
        layer = 0.5 / 8
        bound = _bytes(made[-1].parameters()) / full + 2 * layer + 0.03
        assert_all_ranks(comm, grown / full <= bound, f"{what}: rank {comm.rank} grew {grown} B = "
                                                      f"{grown / full:.3f}x params+grads ({full} B) > {bound:.3f}")


@pytest.mark.mpi
@pytest.mark.parametrize("schedule", ["1f1b", "zb1p"])
def test_gradients_live_in_buckets_allocated_once_and_accumulate_like_one_process(comm, schedule):
    """Pipeline's loop API: each rank's .grad are views of buckets holding exactly its partitions'
    gradients, the same memory at every step; steps without zero_grad accumulate (the previous
    gradients are copied out of the buckets first) and equal one process's summed gradients. Under
    zb1p the weight halves (W, run after the input halves) land in the same buckets."""
    torch.manual_seed(0)
    reference = Deep().double()
    data = [(x.double(), y) for x, y in batches((128,), 8, 3, seed=5)]
    pipe = Pipeline(copy.deepcopy(reference), partitions=comm.size, micro_batches=2, balance="params",
                    example=data[0][0], schedule=schedule)
    mine = list(pipe.parameters())
    loss_fn = nn.CrossEntropyLoss()
    where: list[dict[int, int]] = []
    for x, y in data[:2]:
        for q in mine:
            q.grad = None
        pipe.step(x, y, loss_fn)
        where.append({id(q): q.grad.data_ptr() for q in mine})
    bucket_bytes = sum(b.buffer.numel() * b.buffer.element_size() - b.used.numel() * b.used.element_size()
                       for b in pipe._buckets)
    in_buckets = all(any(b.buffer.data_ptr() <= q.grad.data_ptr() < b.buffer.data_ptr() + b.buffer.numel()
                         * b.buffer.element_size() for b in pipe._buckets) for q in mine)
    ok = where[0] == where[1] and in_buckets and bucket_bytes == _bytes(mine) and 0 < len(mine)
    assert_all_ranks(comm, ok, f"rank {comm.rank}: grads moved {where}, in buckets {in_buckets}, "
                               f"{bucket_bytes} bucket bytes for {_bytes(mine)} of parameters")
    pipe.step(*data[2], loss_fn)  # no zero_grad: adds to the last step's gradients
    one = copy.deepcopy(reference)
    for x, y in data[1:]:
        loss_fn(one(x), y).backward()
    names = {id(q): n for n, q in pipe.model.named_parameters()}
    want = dict(one.named_parameters())
    errors = {names[id(q)]: (q.grad - want[names[id(q)]].grad).abs().max().item() for q in mine}
    assert_all_ranks(comm, max(errors.values()) <= 1e-12, f"rank {comm.rank}: accumulated errors {errors}")


@pytest.mark.mpi
def test_weights_of_several_mib_make_weight_sized_blocks_mapped_on_their_own(comm):
    """A partition whose largest weight reaches OWN_MAPPING_FROM lowers glibc's mmap threshold to that
    weight's bytes (never raising it): its per-micro-batch weight-gradient temporaries then leave no
    holes in the heap. A small model leaves the threshold alone."""
    before = mmap_threshold()
    fit(Deep(), batches((128,), 4, 1), nn.CrossEntropyLoss(), sgd, strategy="model", partitions=comm.size,
        progress=False, balance="params")
    small = mmap_threshold()
    width = 1024  # 1024 x 1024 float32: 4 MiB weights
    big = nn.Sequential(*[nn.Linear(width, width) for _ in range(comm.size)])
    g = torch.Generator().manual_seed(0)  # the same batch on every rank
    fit(big, [(torch.randn(4, width, generator=g), torch.randn(4, width, generator=g))], nn.MSELoss(), sgd,
        strategy="model",
        partitions=comm.size, progress=False, balance="params")
    after = mmap_threshold()
    ok = small == before and after == min(before, OWN_MAPPING_FROM)
    assert_all_ranks(comm, ok, f"rank {comm.rank}: threshold {before} -> {small} (small) -> {after} (4 MiB weights)")
