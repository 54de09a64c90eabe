"""strategies.step: the one training step every strategy shares (StepTrainer.train_shares): its order,
its weights, its loss; and, over real MPI at 2, 3, 4 ranks, every concrete strategy's step on uneven
shares equals one process (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpitrain.comm.place import Place
from mpitrain.strategies import StepTrainer
from mpitrain.strategies.base import FitSpec, LoopSpec
from mpitrain.strategies.data_parallel import DataTrainer
from mpitrain.strategies.pipeline import make_trainer as pipeline_trainer
from mpitrain.strategies.pipesgd import PipeSGDTrainer
from mpitrain.strategies.step import replica_eval
from tests.helpers import assert_all_ranks, assert_close_all_ranks


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3)).double()


def sgd(params):
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)


class Recording(StepTrainer):
    """A one-rank StepTrainer over a plain model that records which hook ran when."""

    label = "recording"

    def __init__(self, comm, ready: bool = True, clip: float | None = None, replicas: int = 1) -> None:
        self.model, self.comm, self.calls = mlp(), comm, []
        self.optimizer = sgd(self.model.parameters())
        self.place = Place.of(comm.size, comm.rank, replicas=comm.size)
        self.loop, self.replicas, self.ready = LoopSpec(grad_clip=clip), replicas, ready
        step = self.optimizer.step

        def recorded_step(*args, **kwargs):
            self.calls.append("step")
            return step(*args, **kwargs)

        self.optimizer.step = recorded_step  # type: ignore[method-assign]

    def begin_step(self, batches):
        self.calls.append("begin")
        super().begin_step(batches)

    def local_pass(self, batches, total):
        self.calls.append("local_pass")
        local = torch.zeros((), dtype=torch.float64)
        for b in batches:
            if b.share.rows:
                local += self.backward(F.cross_entropy(self.model(b.inputs), b.targets), b.share.rows, total)
        return local

    def finish_gradients(self):
        self.calls.append("finish")
        return self.ready

    def clip_grad_norm_(self, max_norm):
        self.calls.append("clip")
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def eval_step(self, inputs, targets):
        return replica_eval(self.model, self.comm, self.place, inputs, targets, torch.device("cpu"))

    def trained_model(self):
        return self.model

    def layout(self):
        return {}

    def state_dict(self):
        return {}

    def load_state_dict(self, read, saved_layout):
        pass


def _batch(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def _one_process(batches, clip: float | None = None, steps: int = 1) -> tuple[nn.Module, list[float]]:
    model = mlp()
    opt = sgd(model.parameters())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(torch.cat([x for x, _ in batches])), torch.cat([y for _, y in batches]))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return model, losses


# -- one process -------------------------------------------------------------------------------------
def test_step_runs_begin_local_pass_finish_clip_then_step_in_that_order(comm):
    t = Recording(comm, clip=0.1)
    t.train_step(*_batch(6))
    assert t.calls == ["begin", "local_pass", "finish", "clip", "step"]


def test_a_gradient_not_ready_at_finish_is_neither_clipped_nor_stepped(comm):
    t = Recording(comm, ready=False, clip=0.1)
    before = [p.detach().clone() for p in t.model.parameters()]
    t.train_step(*_batch(6))
    assert t.calls == ["begin", "local_pass", "finish"]
    assert all(torch.equal(a, b) for a, b in zip(before, t.model.parameters()))


def test_step_on_several_batches_is_one_process_step_on_their_concatenation_and_returns_its_mean_loss(comm):
    from mpitrain.strategies import slice_share

    t = Recording(comm, clip=0.05)
    batches = [_batch(5, 0), _batch(2, 1), _batch(4, 2)]
    shares = [slice_share(x, y, t.share(len(y))) for x, y in batches]
    loss = t.train_shares(shares, 11)
    ref, losses = _one_process(batches, clip=0.05)
    assert loss == pytest.approx(losses[0], abs=1e-14)
    assert all(torch.allclose(a, b, atol=1e-14) for a, b in zip(t.model.parameters(), ref.parameters()))


def test_scale_is_weight_times_replicas_over_the_step_weight_and_backward_returns_the_float64_weighted_sum(comm):
    t = Recording(comm, replicas=4)
    t.step_weight = 12  # what weigh() sets: the step's counted elements (here rows)
    assert t.scale(3, 12) == 3 * 4 / 12
    loss = torch.tensor(0.5, dtype=torch.float32, requires_grad=True)
    part = t.backward(loss, 3, 12)
    assert part.dtype == torch.float64 and part.item() == 1.5 and loss.grad.item() == 1.0


def test_a_finished_trainer_refuses_a_step_naming_its_strategy(comm):
    class Finished(Recording):
        closed = True  # type: ignore[assignment]

    with pytest.raises(RuntimeError, match="this recording trainer is finished"):
        Finished(comm).train_step(*_batch(4))


def test_defaults_read_the_dataset_itself_and_record_nothing(comm):
    t = Recording(comm)
    data = [1, 2, 3]
    assert t.rank_view(data) is data and t.record == {}  # type: ignore[arg-type]
    assert (t.share(7).start, t.share(7).stop) == (0, 7)


# -- MPI: every strategy's step ----------------------------------------------------------------------
def _trainer(kind: str, comm) -> StepTrainer:
    if kind == "data":
        from mpitrain.strategies.data_parallel import DataOptions

        return DataTrainer(mlp(), F.cross_entropy, sgd, comm, 2, DataOptions(), LoopSpec(grad_clip=0.2))
    if kind == "pipe-sgd":
        from mpitrain.strategies.pipesgd import PipeSGDOptions

        return PipeSGDTrainer(mlp(), F.cross_entropy, sgd, comm, PipeSGDOptions(staleness=1),
                              loop=LoopSpec(grad_clip=0.2))
    partitions = comm.size if kind == "model" else (2 if comm.size % 2 == 0 else 1)
    spec = FitSpec(strategy=kind, partitions=partitions, replicas=comm.size // partitions, micro_batches=2,
                   balance="params", options={"profile_passes": 1}, loop=LoopSpec(grad_clip=0.2))
    return pipeline_trainer(mlp(), F.cross_entropy, sgd, comm, spec)  # type: ignore[return-value]


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["data", "pipe-sgd", "model", "hybrid"])
def test_every_strategys_step_on_uneven_shares_of_several_batches_equals_one_process(comm, kind):
    from mpitrain.strategies import slice_share

    trainer = _trainer(kind, comm)
    batches = [_batch(7, 0), _batch(comm.size + 1, 1)]  # uneven at 2, 3, 4 ranks; a rank with one row
    losses = []
    for _ in range(2):
        shares = [slice_share(x, y, trainer.share(len(y))) for x, y in batches]
        losses.append(trainer.train_shares(shares, sum(len(y) for _, y in batches)))
    model = trainer.trained_model()
    ref, ref_losses = _one_process(batches, clip=0.2, steps=2)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close_all_ranks(comm, p.detach(), q.detach(), 1e-12, 0.0, f"{kind}: {name} after 2 steps")
    assert_close_all_ranks(comm, torch.tensor(losses), torch.tensor(ref_losses), 1e-12, 0.0, f"{kind}: losses")
    assert_all_ranks(comm, isinstance(trainer, StepTrainer), f"{kind}: {type(trainer).__name__}")


def test_a_data_trainer_closed_by_trained_model_refuses_the_next_step_naming_its_strategy(comm):
    from mpitrain.strategies.data_parallel import DataOptions

    t = DataTrainer(mlp(), F.cross_entropy, sgd, comm, 1, DataOptions(kvstore="local"))
    t.train_step(*_batch(4))
    t.trained_model()
    with pytest.raises(RuntimeError, match="this data-parallel trainer is finished"):
        t.train_step(*_batch(4))
