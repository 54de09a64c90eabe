"""Pipe-SGD: fit(strategy="pipe-sgd") equals a one-process run of Algorithm 1; compression converges."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

from mpitrain.comm.codecs import Codec, get_codec
from mpitrain.fit import FitError, FitSpec, fit
from mpitrain.strategies.pipesgd import LinkEmulation, PipeSGDError, make_trainer
from tests.helpers import assert_all_ranks, assert_close_all_ranks, run_job

BATCH = 12  # divisible by 2, 3 and 4 ranks


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(6, 3, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(BATCH, 6, generator=g)
        out.append((x, (x @ w).argmax(1)))
    return out


def _sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.5)


def _adam(params):
    return torch.optim.Adam(params, lr=0.02)


def _simulate(model: nn.Module, batches, K: int, warmup: int, optimizer) -> tuple[nn.Module, list[float]]:
    """Algorithm 1 in one process on the global batches: step t applies the gradient of t-K (none for
    t <= K after warm-up), then computes the gradient at the new weights. Warm-up / K=1 steps are D-Sync."""
    opt, params = optimizer(model.parameters()), list(model.parameters())
    pending: collections.deque = collections.deque()
    losses = []
    for t, (x, y) in enumerate(batches, 1):
        sync = K == 1 or t <= warmup
        if not sync and pending and pending[0][0] == t - K:
            for p, g in zip(params, pending.popleft()[1]):
                p.grad = g
            opt.step()
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads = [p.grad.clone() for p in params]
        if sync:
            for p, g in zip(params, grads):
                p.grad = g
            opt.step()
        else:
            pending.append((t, grads))
    return model, losses


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.mpi
@pytest.mark.parametrize("K,warmup,optimizer", [(1, 0, _sgd), (2, 0, _sgd), (3, 0, _sgd), (2, 3, _sgd),
                                                (3, 0, _adam)])
def test_uncompressed_pipesgd_equals_one_process_algorithm_1(comm, K, warmup, optimizer):
    batches = _batches(8)
    result = fit(_model(), batches, nn.functional.cross_entropy, optimizer, strategy="pipe-sgd", staleness=K,
                 warmup_steps=warmup, progress=False, comm=comm)
    expected, _ = _simulate(_model(), batches, K, warmup, optimizer)
    assert_close_all_ranks(comm, _flat(result.model), _flat(expected), atol=1e-5, rtol=1e-5,
                           what=f"w[T] K={K} warmup={warmup}")


@pytest.mark.mpi
def test_train_step_returns_the_global_mean_loss_of_this_iteration(comm):
    batches = _batches(5, seed=4)
    trainer = make_trainer(_model(), nn.functional.cross_entropy, _sgd, comm,
                           FitSpec(strategy="pipe-sgd", options={"staleness": 2}))
    losses = torch.tensor([trainer.train_step(x, y) for x, y in batches], dtype=torch.float64)
    trainer.trained_model()
    _, expected = _simulate(_model(), batches, 2, 0, _sgd)
    assert_close_all_ranks(comm, losses, torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=1e-5,
                           what="losses")


@pytest.mark.mpi
@pytest.mark.parametrize("compression,error_feedback", [("bf16", False), ("int8", True)])
def test_compressed_pipesgd_converges_close_to_uncompressed(comm, compression, error_feedback):
    batches = _batches(40, seed=5)
    common = dict(strategy="pipe-sgd", staleness=2, progress=False, comm=comm)
    plain = fit(_model(3), batches, nn.functional.cross_entropy, _sgd, **common).history[0]["loss"]
    res = fit(_model(3), batches, nn.functional.cross_entropy, _sgd, compression=compression,
              error_feedback=error_feedback, **common)
    x = torch.cat([b[0] for b in batches[-10:]])
    y = torch.cat([b[1] for b in batches[-10:]])
    with torch.no_grad():
        start = nn.functional.cross_entropy(_model(3)(x), y).item()
        end = nn.functional.cross_entropy(res.model(x), y).item()
    ok = end < 0.5 * start and abs(res.history[0]["loss"] - plain) < 0.1 * plain
    assert_all_ranks(comm, ok, f"{compression}: loss {start:.3f} -> {end:.3f}, mean {res.history[0]['loss']:.3f}"
                               f" vs uncompressed {plain:.3f}")
    ranks_params = comm.allgather(_flat(res.model).reshape(1, -1))
    assert_all_ranks(comm, all(torch.equal(ranks_params[0], r) for r in ranks_params), "replicas diverged")


class _FailingCodec(Codec):
    """bf16-rne that fails at its 3000th encode (the test aligns it with the first encode of an allreduce,
    which every rank reaches before sending anything, so every rank fails the same iteration)."""

    name = "failing"

    def __init__(self) -> None:
        self.calls = 0
        self.inner = get_codec("bf16-rne")
        self.payload_dtype = self.inner.payload_dtype

    def encode(self, t, out=None):
        self.calls += 1
        if self.calls == 3 * 1000:
            raise ArithmeticError("injected codec failure")
        return self.inner.encode(t, out)

    def decode(self, payload, out):
        return self.inner.decode(payload, out)


@pytest.mark.mpi
def test_comm_thread_failure_is_raised_on_the_compute_thread(comm):
    codec = _FailingCodec()
    trainer = make_trainer(_model(), nn.functional.cross_entropy, _sgd, comm,
                           FitSpec(strategy="pipe-sgd", options={"staleness": 2, "compression": codec,
                                                                 "chunk_bytes": 1 << 30}))
    codec.calls = 3 * 1000 - 2 * comm.size - 1  # an allreduce encodes `size` times per rank: fail the 3rd
    errors = []
    try:
        for x, y in _batches(6):
            trainer.train_step(x, y)
    except PipeSGDError as e:
        errors.append(e)
    ok = len(errors) == 1 and isinstance(errors[0].__cause__, ArithmeticError)
    assert_all_ranks(comm, ok, f"got {errors!r}")
    trainer._closed = True  # the ring is broken on purpose; don't drain it


@pytest.mark.mpi
@pytest.mark.parametrize("options", [{"staleness": 0}, {"warmup_steps": -1}, {"compression": "zip"},
                                     {"lr": 0.1}, {"emulate_link": (1.0,)}])
def test_bad_options_raise_on_every_rank_before_any_message(comm, options):
    try:
        make_trainer(_model(), nn.functional.cross_entropy, _sgd, comm, FitSpec(strategy="pipe-sgd",
                                                                                options=options))
        raised = False
    except FitError:
        raised = True
    assert_all_ranks(comm, raised, f"{options} accepted")


def test_link_emulation_charges_the_ring_cost_of_the_wire_bytes():
    link = LinkEmulation(alpha=1e-3, beta=1e-6)
    assert link.delay(4000, 1) == 0.0
    assert link.delay(4000, 4) == pytest.approx(2 * 3 * 1e-3 + 2 * 3 / 4 * 4000 * 1e-6)


_DYING_RANK = """
import torch, mpitrain
from torch import nn
from mpitrain.fit import fit
comm = mpitrain.init()
calls = [0]
def loss_fn(out, y):
    calls[0] += 1
    if comm.rank == 1 and calls[0] == 3:
        raise RuntimeError("injected failure on rank 1")
    return nn.functional.cross_entropy(out, y)
class PlainSGD:  # duck-typed: a fresh process importing torch.optim pays ~10 s (torch._dynamo) on this box
    def __init__(self, params):
        self.params = list(params)
    def step(self):
        with torch.no_grad():
            for p in self.params:
                p -= 0.1 * p.grad
torch.manual_seed(0)  # the same global batches on every rank (fit checks the first one)
batches = [(torch.randn(4, 3), torch.tensor([0, 1, 0, 1])) for _ in range(20)]
fit(nn.Linear(3, 2), batches, loss_fn, PlainSGD, strategy="pipe-sgd", staleness=2, compression="int8",
    progress=False)
"""


def test_a_rank_dying_mid_pipeline_ends_the_whole_job_nonzero():
    proc = run_job(_DYING_RANK, timeout=240)  # a hang never ends
    assert proc.returncode != 0 and "injected failure on rank 1" in proc.stdout + proc.stderr
