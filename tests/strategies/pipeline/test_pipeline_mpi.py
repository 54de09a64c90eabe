"""Model and hybrid parallelism against one process training on the same global batches."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mpitrain
from mpitrain.fit import fit
from tests.helpers import assert_all_ranks, assert_close_all_ranks

from .models import MODELS, batches, reference_train

STEPS, MICRO, PER_REPLICA = 3, 3, 6


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def layouts(size: int) -> list[tuple[int, int]]:
    """(P, R) pairs that fill `size` ranks: the whole pipeline, and 2 x 2 on four ranks."""
    return [(size, 1)] + ([(2, size // 2)] if size == 4 else [])


def compare_parameters(comm, got: nn.Module, want: nn.Module, buffers: bool) -> None:
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        assert_close_all_ranks(comm, a.detach(), b.detach(), atol=1e-5, what=f"parameter {name}")
    if buffers:  # BatchNorm running statistics: per micro-batch, in order, like the reference
        for (name, a), b in zip(got.named_buffers(), want.buffers()):
            assert_close_all_ranks(comm, a.double(), b.double(), atol=1e-5, what=f"buffer {name}")


# zbv cuts 2P partitions: the MLP's 6 cut points cannot hold 8 (P = 4); it runs zb1p
CASES = [(name, schedule) for name in sorted(MODELS) for schedule in ("gpipe", "1f1b", "zb1p", "zbv")
         if (name, schedule) != ("mlp", "zbv")]


@pytest.mark.mpi
@pytest.mark.parametrize("name, schedule", CASES)
def test_parameters_after_3_steps_equal_one_process(comm, name, schedule):
    cls, shape = MODELS[name]
    for P, R in layouts(comm.size):
        torch.manual_seed(0)
        model = cls()
        data = batches(shape, PER_REPLICA * R, STEPS)
        want = reference_train(model, data, sgd, R * MICRO)
        result = fit(model, data, nn.CrossEntropyLoss(), sgd, strategy="model" if R == 1 else "hybrid",
                     partitions=P, micro_batches=MICRO, schedule=schedule, progress=False, balance="params")
        compare_parameters(comm, result.model, want, buffers=R == 1)


@pytest.mark.mpi
def test_time_balance_eval_outputs_and_loss_history_equal_one_process(comm):
    cls, shape = MODELS["resnet"]
    for P, R in layouts(comm.size):
        torch.manual_seed(1)
        model = cls()
        data = batches(shape, 4 * comm.size, 2, seed=3)
        held_out = batches(shape, 7, 2, seed=4)  # 7: uneven replica and micro-batch slices
        want = reference_train(model, data, sgd, 2 * R)
        result = fit(model, data, nn.CrossEntropyLoss(), sgd, strategy="hybrid", partitions=P,
                     micro_batches=2, eval_data=held_out, metrics=["accuracy"], progress=False,
                     balance="time")
        compare_parameters(comm, result.model, want, buffers=R == 1)
        if R > 1:  # BatchNorm statistics are replica 0's: evaluate the reference with them
            want.load_state_dict(result.model.state_dict())
        want.eval()
        with torch.no_grad():
            loss = sum(nn.CrossEntropyLoss()(want(x), y).item() * len(y) for x, y in held_out) / 14
        record = result.history[-1]
        assert_all_ranks(comm, abs(record["eval_loss"] - loss) < 1e-5,
                         f"eval loss {record['eval_loss']} vs {loss} (P={P}, R={R})")
        fresh = cls()
        fresh.load_state_dict(result.model.state_dict())
        x = held_out[0][0]
        assert_close_all_ranks(comm, fresh.eval()(x), want(x), atol=1e-5, what="fresh instance outputs")


@pytest.mark.mpi
def test_training_loss_is_the_one_process_mean_on_every_rank(comm):
    cls, shape = MODELS["skip"]
    torch.manual_seed(2)
    model = cls()
    data = batches(shape, 6, 1, seed=5)
    with torch.no_grad():
        want = nn.CrossEntropyLoss()(model(data[0][0]), data[0][1]).item()
    result = fit(model, data, nn.CrossEntropyLoss(), sgd, strategy="model", partitions=comm.size,
                 micro_batches=2, progress=False, balance="params")
    got = result.history[0]["loss"]
    losses = comm.allgather_object(got)
    assert_all_ranks(comm, abs(got - want) < 1e-5 and len(set(losses)) == 1,
                     f"loss {got} vs {want}: {losses}")


@pytest.mark.mpi
@pytest.mark.parametrize("kwargs, match", [
    ({"strategy": "model", "partitions": 1}, "partitions == world size"),
    ({"strategy": "hybrid", "partitions": 5}, "partitions x replicas"),
    ({"strategy": "model", "schedule": "zigzag"}, "unknown schedule"),
    ({"strategy": "model", "micro_batches": 0}, "micro_batches must be a positive int"),
    ({"strategy": "model", "balance": [1]}, "balance must be"),
    ({"strategy": "model", "stall_timout": 3}, "does not take option"),
    ({"strategy": "model", "checkpoint": "sometimes"}, "checkpoint"),
    ({"strategy": "model", "schedule": "interleaved-1f1b", "micro_batches": 5}, "multiple"),
    ({"strategy": "model", "schedule": "zb1p", "checkpoint": "always"}, "recompute the forward in each"),
    ({"strategy": "model", "schedule": "zbv", "virtual_stages": 3}, "exactly 2 partitions per rank"),
])
def test_bad_arguments_are_refused_on_every_rank_before_any_message(comm, kwargs, match):
    cls, shape = MODELS["mlp"]
    kwargs = {"partitions": comm.size, **kwargs}
    with pytest.raises(ValueError, match=match):
        fit(cls(), batches(shape, 6, 1), nn.CrossEntropyLoss(), sgd, progress=False, **kwargs)


@pytest.mark.mpi
def test_pipe_and_replica_groups_hold_world_ranks_r_times_p_plus_p(comm):
    """World rank r * P + p runs pipeline rank p of replica r: `pipe` holds its replica's P ranks, `group`
    the R ranks of pipeline rank p, each in that order (an allgather of world ranks over each)."""
    for P in [d for d in range(1, comm.size + 1) if comm.size % d == 0]:
        pipe = mpitrain.Pipeline(nn.Linear(2, 2), partitions=P, comm=comm)
        r, p = divmod(comm.rank, P)
        me = torch.tensor([comm.rank], dtype=torch.int64)
        got = (pipe.pipe.allgather(me).tolist(), pipe.group.allgather(me).tolist(), pipe.replica, pipe.p)
        want = (list(range(r * P, (r + 1) * P)), list(range(p, comm.size, P)), r, p)
        assert_all_ranks(comm, got == want, f"P={P}: {got} != {want}")


@pytest.mark.mpi
def test_more_partitions_than_graph_nodes_is_refused(comm):
    with pytest.raises(ValueError, match="exceed the 1 nodes"):
        fit(nn.Sequential(nn.Linear(3, 2)), [(torch.ones(4, 3), torch.zeros(4, dtype=torch.long))],
            nn.CrossEntropyLoss(), sgd, strategy="model", partitions=comm.size, progress=False)


def skip_balance(size: int) -> list[int]:
    """Node counts putting `tanh` (a) in partition 0 and its readers in the last two partitions (from
    3 ranks on; on 4 ranks a also jumps over partition 1)."""
    from mpitrain.strategies.pipeline._graph import trace

    names = [n.name for n in trace(MODELS["skip"][0]()).nodes]
    after = {2: ["relu"], 3: ["relu", "mul"], 4: ["relu", "tanh_1", "add"]}[size]
    bounds = [0, *(names.index(v) + 1 for v in after), len(names)]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@pytest.mark.mpi(sizes=(2, 3, 4))
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb1p"])
def test_skip_read_by_two_later_partitions_gets_the_sum_of_their_errors(comm, schedule):
    cls, shape = MODELS["skip"]
    torch.manual_seed(3)
    model = cls()
    data = batches(shape, 8, STEPS, seed=6)
    want = reference_train(model, data, sgd, 4)
    result = fit(model, data, nn.CrossEntropyLoss(), sgd, strategy="model", partitions=comm.size,
                 micro_batches=4, schedule=schedule, progress=False, balance=skip_balance(comm.size))
    compare_parameters(comm, result.model, want, buffers=False)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@pytest.mark.mpi
def test_optimizer_built_right_after_construction_trains_like_one_process(comm):
    """The issue's loop: ``opt = AdamW(pipe.parameters())`` before any step, no `example`, default
    balance "time" (the optimizer holds every parameter; each rank's steps only its own, with weight
    decay): an nn.Sequential, the ResNet-like CNN, and a meta-device nn.Sequential materialised in place."""
    from mpitrain.strategies.pipeline._materialize import materialize

    def sequential() -> nn.Module:
        return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16),
                             nn.Tanh(), nn.Linear(16, 5))

    def on_meta() -> nn.Module:
        with torch.device("meta"):
            return sequential()

    resnet, resnet_shape = MODELS["resnet"]
    cases = [("sequential", sequential, (12,)), ("resnet", resnet, resnet_shape), ("meta", on_meta, (12,))]
    for (P, R), (name, make, shape) in [(layout, case) for layout in layouts(comm.size) for case in cases]:
        torch.manual_seed(2)
        model = make()
        reference = copy.deepcopy(model)
        if name == "meta":
            materialize(reference)
        data = batches(shape, 4 * R, STEPS, seed=5)
        want = reference_train(reference, data, adamw, 2 * R)
        pipe = mpitrain.Pipeline(model, partitions=P, replicas=R, micro_batches=2, comm=comm)
        opt = adamw(pipe.parameters())
        for x, y in data:
            opt.zero_grad()
            pipe.step(x, y, nn.CrossEntropyLoss())
            opt.step()
        got = pipe.trained_model()
        # a meta model's other partitions stay on meta: ranks compare different numbers of tensors, so
        # one verdict per rank
        errors = {key: (a.detach() - b.detach()).abs().max().item()
                  for (key, a), b in zip(got.named_parameters(), want.parameters()) if not a.is_meta}
        assert_all_ranks(comm, max(errors.values()) <= 1e-5, f"{name} P={P}: rank {comm.rank} errors {errors}")
        assert_all_ranks(comm, name != "meta" or any(a.is_meta for a in got.parameters()),
                         f"{name}: rank {comm.rank} holds the whole meta model")


@pytest.mark.mpi
def test_torchvision_cnn_over_changing_image_sizes_trains_like_one_process(comm):
    """A torchvision ResNet (BasicBlock, one block per stage) on batches of 16, 24 and 20 pixel images
    under model and hybrid: one captured graph, receive buffers per image size, the split fixed;
    float64 parameters (and, with one replica, BatchNorm statistics) equal one process's."""
    from mpitrain.spatial.models import torchvision_module

    resnet = torchvision_module("models.resnet")
    g = torch.Generator().manual_seed(0)
    for P, R in layouts(comm.size):
        torch.manual_seed(0)
        model = resnet.ResNet(resnet.BasicBlock, [1, 1, 1, 1], num_classes=5).double()
        data = [(torch.randn(4 * R, 3, s, s, generator=g, dtype=torch.float64), torch.randint(0, 5, (4 * R,)))
                for s in (16, 24, 20)]
        want = reference_train(model, data, sgd, 2 * R)
        result = fit(model, data, nn.CrossEntropyLoss(), sgd, strategy="model" if R == 1 else "hybrid",
                     partitions=P, micro_batches=2, progress=False, balance="params")
        compare_parameters(comm, result.model, want, buffers=R == 1)
