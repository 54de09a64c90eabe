"""DataParallel and fit(strategy="data") against the same training in one process, every kvstore type."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mpitrain
from mpitrain.fit import fit
from mpitrain.strategies.data_parallel import COLLECTIVE_TYPES, DataParallel
from tests.helpers import assert_all_ranks, assert_close_all_ranks, calls_recorded

pytestmark = pytest.mark.mpi

PER_RANK = 4      # samples per rank and step
STEPS = 3
ATOL = 1e-5       # the bound for float32 after STEPS optimizer steps
# Tiny buckets (first <= 31 B, then <= 524 B): the CNN below spans five buckets (push order, overlap).
SMALL = {"bucket_mb": 0.0005, "first_bucket_mb": 0.00003}


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.conv2 = nn.Conv2d(4, 6, 3)
        self.fc = nn.Linear(6 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.conv2(F.relu(self.conv1(x)))).flatten(1))


class Branchy(nn.Module):
    """Tied weights (`head` reuses `embed`'s matrix), a branch used only when asked, a layer never used."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8, bias=False)
        self.branch = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor, use_branch: bool, skip_all: bool = False) -> torch.Tensor:
        if skip_all:  # no parameter at all gets a gradient on this rank
            return x * 2
        h = torch.tanh(self.embed(x))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def batches(size: int, steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    n = size * PER_RANK
    return [(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g))
            for _ in range(steps)]


def make_model(cls: type[nn.Module], comm) -> nn.Module:
    """The same model on every rank's reference copy; the replica starts rank-dependent on purpose."""
    torch.manual_seed(1234)
    ref = cls()
    torch.manual_seed(comm.rank)
    return ref


def rank0_copy(ref: nn.Module, comm) -> nn.Module:
    """`ref` on rank 0, other weights elsewhere: DataParallel/fit must broadcast rank 0's."""
    model = type(ref)()
    if comm.rank == 0:
        model.load_state_dict(ref.state_dict())
    return model


def optimizer_for(name: str):
    if name == "sgd":
        return lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01)
    return lambda ps: torch.optim.Adam(ps, lr=0.01)


def my_slice(t: torch.Tensor, comm) -> torch.Tensor:
    return t[comm.rank * PER_RANK:(comm.rank + 1) * PER_RANK]


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def assert_same_params(comm, model: nn.Module, ref: nn.Module, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close_all_ranks(comm, p.detach(), q.detach(), atol=ATOL, what=f"{what}: {name}")


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("kvstore", COLLECTIVE_TYPES)
def test_training_equals_one_process_on_concatenated_batch(comm, kvstore, opt):
    ref = make_model(SmallCNN, comm)
    replica = rank0_copy(ref, comm)
    dp = DataParallel(replica, kvstore=kvstore, overlap=opt == "sgd", **SMALL)  # both push modes
    assert_all_ranks(comm, len(dp.buckets) >= 3, f"expected several buckets, got {dp.buckets}")
    o, ro = optimizer_for(opt)(dp.parameters()), optimizer_for(opt)(ref.parameters())
    _train_side_by_side(comm, dp, ref, o, ro, batches(comm.size, STEPS))
    held, refused = dp.kv.held_bytes(), _pull_refusal(dp)
    dp.close()
    assert_same_params(comm, replica, ref, f"{kvstore}/{opt}")
    # the store keeps no copy of the buckets (registered pushpull_only), and says so when pulled
    assert_all_ranks(comm, held == 0 and "pushpull_only" in refused, f"store holds {held} B; pull: {refused!r}")


def _pull_refusal(dp: DataParallel) -> str:
    """The KVStoreError a pull of `dp`'s first bucket raises ('' if none): its key has no stored value."""
    from mpitrain.kvstore import KVStoreError

    b = dp.buckets[0]
    try:
        dp.kv.pull(b.key, torch.empty_like(b.buffer))
    except KVStoreError as e:
        return str(e)
    return ""


@pytest.mark.parametrize("kvstore", COLLECTIVE_TYPES)
def test_unused_and_tied_parameters_match_one_process(comm, kvstore):
    ref = make_model(Branchy, comm)
    replica = copy.deepcopy(ref)
    dp = DataParallel(replica, kvstore=kvstore, bucket_mb=0.0003, first_bucket_mb=0.0003, overlap=True)
    # weight decay makes "no gradient" (skipped) differ from "zero gradient" (decayed)
    o = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    ro = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    g = torch.Generator().manual_seed(5)
    for step in range(STEPS):
        x = torch.randn(comm.size, PER_RANK, 8, generator=g)
        # the branch is used on some ranks only (rank 1 only in step 0, then by parity), or by none
        use = [r == 1 if step == 0 else (r + step) % 2 == 0 for r in range(comm.size)]
        if step == STEPS - 1:
            use = [False] * comm.size
        o.zero_grad()
        dp(x[comm.rank], use[comm.rank]).square().mean().backward()
        ro.zero_grad()
        (sum(ref(x[r], use[r]).square().mean() for r in range(comm.size)) / comm.size).backward()
        for (name, p), q in zip(replica.named_parameters(), ref.parameters()):
            same = (p.grad is None) == (q.grad is None)
            assert_all_ranks(comm, same, f"step {step} {name}: None {p.grad is None} vs {q.grad is None}")
            if p.grad is not None:
                assert_close_all_ranks(comm, p.grad, q.grad, atol=1e-6, what=f"step {step} grad {name}")
        o.step()
        ro.step()
    dp.close()
    assert_same_params(comm, replica, ref, f"{kvstore} unused/tied")


@pytest.mark.parametrize("kvstore", ["dist_sync_mpi", "funnel"])
def test_rank_where_no_parameter_gets_a_gradient_still_synchronises(comm, kvstore):
    ref = make_model(Branchy, comm)
    replica = copy.deepcopy(ref)
    dp = DataParallel(replica, kvstore=kvstore, bucket_mb=0.0003, first_bucket_mb=0.0003)
    x = torch.randn(comm.size, PER_RANK, 8, generator=torch.Generator().manual_seed(9))
    skip = [r == 0 for r in range(comm.size)]
    dp(x[comm.rank].requires_grad_(), True, skip[comm.rank]).square().mean().backward()
    (sum(ref(x[r], True, skip[r]).square().mean() for r in range(comm.size)) / comm.size).backward()
    dp.close()
    for (name, p), q in zip(replica.named_parameters(), ref.parameters()):
        same = (p.grad is None) == (q.grad is None)
        assert_all_ranks(comm, same, f"{name}: None {p.grad is None} vs {q.grad is None}")
        if p.grad is not None:
            assert_close_all_ranks(comm, p.grad, q.grad, atol=1e-6, what=f"grad {name}")


@pytest.mark.parametrize("kvstore", ["dist_sync_mpi", "depchain"])
def test_buckets_are_pushed_during_backward_in_bucket_order(comm, kvstore):
    """Overlap: the first bucket leaves while autograd still owes gradients of earlier layers."""
    ref = make_model(SmallCNN, comm)
    dp = DataParallel(copy.deepcopy(ref), kvstore=kvstore, overlap=True, **SMALL)
    produced: list[int] = []
    pushes: list[tuple[str, int]] = []
    params = list(dp.parameters())
    for p in params:  # registered after DataParallel's hooks, so they run after them
        p.register_post_accumulate_grad_hook(lambda _p: produced.append(1))
    push = dp.kv.pushpull

    def recording_pushpull(key, ins, outs=None, priority=0):
        pushes.append((key, len(produced)))
        push(key, ins, outs, priority)

    dp.kv.pushpull = recording_pushpull
    x, y = batches(comm.size, 1)[0]
    F.cross_entropy(dp(my_slice(x, comm)), my_slice(y, comm)).backward()
    dp.kv.pushpull = push
    dp.close()
    keys = [k for k, _ in pushes]
    assert_all_ranks(comm, keys == [b.key for b in dp.buckets], f"push order {keys}")
    assert_all_ranks(comm, pushes[0][1] < len(params) - 1,
                     f"first bucket pushed after {pushes[0][1]} of {len(params)} gradients")


def test_parameter_server_kvstore_trains_like_one_process(comm):
    """dist_sync: the last rank serves, the others are the data-parallel workers."""
    from mpitrain import kvstore

    ref = make_model(SmallCNN, comm)
    kv = kvstore.create("dist_sync", comm=comm, num_servers=1)
    workers = comm.split(None if kv.is_server else 0, comm.rank)
    err, held, refused = 0.0, 0, "pushpull_only"
    if kv.is_server:
        kv.serve()  # until every worker has closed the store
    else:
        try:
            replica = rank0_copy(ref, workers)
            dp = DataParallel(replica, kvstore=kv, comm=workers, **SMALL)
            o, ro = optimizer_for("sgd")(dp.parameters()), optimizer_for("sgd")(ref.parameters())
            _train_side_by_side(workers, dp, ref, o, ro, batches(workers.size, STEPS, seed=11))
            held, refused = kv.held_bytes(), _pull_refusal(dp)
            dp.close()
            err = max_param_diff(replica, ref)
        finally:
            kv.close()
    assert_all_ranks(comm, err <= ATOL and held == 0 and "pushpull_only" in refused,
                     f"dist_sync: max parameter difference {err}; workers hold {held} B; pull: {refused!r}")


@pytest.mark.parametrize("kvstore", ["dist_sync_mpi", "depchain"])
def test_no_sync_accumulation_equals_one_process_sum(comm, kvstore):
    ref = make_model(SmallCNN, comm)
    replica = copy.deepcopy(ref)
    dp = DataParallel(replica, kvstore=kvstore, **SMALL)
    data = batches(comm.size, 3, seed=7)
    for x, y in data[:-1]:
        with dp.no_sync():
            F.cross_entropy(dp(my_slice(x, comm)), my_slice(y, comm)).backward()
    local = [p.grad.clone() for p in replica.parameters()]
    x, y = data[-1]
    F.cross_entropy(dp(my_slice(x, comm)), my_slice(y, comm)).backward()
    dp.close()
    for x, y in data:
        F.cross_entropy(ref(x), y).backward()
    for (name, p), q in zip(replica.named_parameters(), ref.parameters()):
        assert_close_all_ranks(comm, p.grad, q.grad, atol=1e-6, what=f"accumulated grad {name}")
    # inside no_sync nothing was reduced: the local sums differ between ranks
    every = comm.allgather(torch.cat([t.flatten() for t in local])[None])
    assert_all_ranks(comm, not torch.equal(every[0], every[1]),
                     "no_sync gradients were identical on ranks 0 and 1: were they reduced?")


@pytest.mark.parametrize("kvstore", COLLECTIVE_TYPES)
def test_fit_data_strategy_equals_one_process(comm, kvstore):
    ref = make_model(SmallCNN, comm)
    model = rank0_copy(ref, comm)
    data = batches(comm.size, STEPS, seed=3)
    result = fit(model, data, F.cross_entropy, optimizer_for("sgd"), strategy="data", progress=False,
                 kvstore=kvstore, micro_batches=2, **SMALL)
    ro = optimizer_for("sgd")(ref.parameters())
    losses = []
    for x, y in data:
        ro.zero_grad()
        loss = F.cross_entropy(ref(x), y)
        loss.backward()
        ro.step()
        losses.append(loss.item())
    assert_same_params(comm, result.model, ref, f"fit {kvstore}")
    assert_close_all_ranks(comm, torch.tensor(result.history[0]["loss"]),
                           torch.tensor(sum(losses) / len(losses)), atol=1e-6, what="mean training loss")


def test_fit_eval_returns_full_outputs_on_every_rank(comm):
    ref = make_model(SmallCNN, comm)
    data = batches(comm.size, 1, seed=4)
    result = fit(rank0_copy(ref, comm), data, F.cross_entropy, optimizer_for("adam"), strategy="data",
                 progress=False, eval_data=data, metrics=["accuracy"])
    ro = optimizer_for("adam")(ref.parameters())
    x, y = data[0]
    F.cross_entropy(ref(x), y).backward()
    ro.step()
    with torch.no_grad():
        expected = F.cross_entropy(ref(x), y).item()
    assert_close_all_ranks(comm, torch.tensor(result.history[0]["eval_loss"]), torch.tensor(expected),
                           atol=1e-5, what="eval loss over the full outputs")


def test_fit_refuses_bad_options_on_every_rank(comm):
    odd = [(torch.randn(comm.size * 2 + 1, 1, 8, 8), torch.zeros(comm.size * 2 + 1, dtype=torch.long))]

    def run(**kw):
        fit(SmallCNN(), odd, F.cross_entropy, optimizer_for("sgd"), strategy="data", progress=False, **kw)

    with pytest.raises(ValueError, match="does not take option"):
        run(staleness=2)
    with pytest.raises(ValueError, match="partitions"):
        run(partitions=2)


def test_mismatched_models_raise_on_every_rank_before_sending(comm):
    model = nn.Linear(4, 4 + (comm.rank == comm.size - 1))
    with pytest.raises(ValueError, match=rf"ranks \[{comm.size - 1}\] disagree"):
        DataParallel(model)
    with pytest.raises(ValueError, match="kvstore 'local'"):
        DataParallel(nn.Linear(2, 2), kvstore="local")
    with pytest.raises(ValueError, match="kv.serve"):
        DataParallel(nn.Linear(2, 2), kvstore="dist_sync")
    with pytest.raises(ValueError, match="unknown kvstore"):
        DataParallel(nn.Linear(2, 2), kvstore="nccl")


def test_broadcast_parameters_and_optimizer_state_from_every_root(comm):
    for root in range(comm.size):
        torch.manual_seed(100 + comm.rank)
        model = SmallCNN()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for _ in range(comm.rank):  # rank r has taken r steps: different states, some empty
            model(torch.randn(2, 1, 8, 8)).sum().backward()
            opt.step()
        mpitrain.broadcast_parameters(model.state_dict(), root_rank=root, comm=comm)
        mpitrain.broadcast_optimizer_state(opt, root_rank=root, comm=comm)
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        state = opt.state_dict()["state"]
        steps = float(state[0]["step"]) if state else 0.0
        moments = torch.cat([state[i]["exp_avg"].flatten() for i in sorted(state)] or [torch.zeros(0)])
        everyone = comm.allgather_object((flat, steps, moments))
        f0, s0, m0 = everyone[root]
        ok = all(torch.equal(f, f0) and s == s0 and torch.equal(m, m0) for f, s, m in everyone)
        assert_all_ranks(comm, ok and steps == root, f"root {root}: states differ, steps {steps}")


@pytest.mark.parametrize("op", ["avg", "sum"])
def test_allreduce_gradients_matches_closed_form(comm, op):
    from mpitrain._utils.flat import views
    from mpitrain.strategies.data_parallel import allreduce_gradients, start_allreduce_gradients

    shapes = [(3, 5), (7,), (2, 2, 2), (1,)]
    for start, joined in [(False, False), (True, False), (False, True), (True, True)]:
        params = [nn.Parameter(torch.zeros(s, dtype=torch.float32 if joined or i != 2 else torch.float64))
                  for i, s in enumerate(shapes)]
        for i, p in enumerate(params[:-1]):  # the last one has no gradient: it counts as zeros
            p.grad = torch.full_like(p, float(comm.rank + 1 + i))
        if joined:  # gradients already back to back in one buffer: reduced in place, still its views
            buffer = torch.zeros(sum(p.numel() for p in params[:-1]))
            for p, view in zip(params[:-1], views(buffer, [p.shape for p in params[:-1]])):
                p.grad = view.copy_(p.grad)
            where = [p.grad.data_ptr() for p in params[:-1]]
        if start:
            start_allreduce_gradients(params, comm, op, bucket_mb=0.00005).wait()
        else:
            allreduce_gradients(params, comm, op, bucket_mb=0.00005)
        total = comm.size * (comm.size + 1) / 2
        for i, p in enumerate(params):
            expected = 0.0 if i == len(params) - 1 else total + comm.size * i
            expected = expected / comm.size if op == "avg" else expected
            assert_close_all_ranks(comm, p.grad, torch.full_like(p, expected), atol=1e-6,
                                   what=f"{op} start={start} joined={joined} param {i}")
        if joined:
            assert_all_ranks(comm, [p.grad.data_ptr() for p in params[:-1]] == where, "gradients moved")


class _Tokens(torch.utils.data.Dataset):
    """Samples ``({"input_ids": ..., "attention_mask": ...}, labels)``: dict inputs through default collate."""

    def __init__(self, data) -> None:
        self.items = [({k: v[i] for k, v in x.items()}, y[i]) for x, y in data for i in range(len(y))]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def test_fit_data_strategy_slices_dict_inputs_of_a_transformer_like_one_process(comm):
    """GPT-2 (float64) called with keyword inputs: uneven global batches (the last one leaves a rank
    empty), micro-batches, the Dataset path (dict samples through default collate, the same global
    batches), and eval outputs gathered as a ModelOutput."""
    from tests.strategies.pipeline.tiny_transformers import build, lm_batches, lm_loss

    n = 2 * comm.size + 1  # a rank reads one row more than another
    data = lm_batches(n, 2, seed=5) + lm_batches(comm.size - 1, 1, seed=6)  # the last leaves a rank empty
    sgd = optimizer_for("sgd")
    ref = build("gpt2", seed=3)
    ro = sgd(ref.parameters())
    for x, y in data:
        ro.zero_grad()
        lm_loss(ref(**x), y).backward()
        ro.step()
    with torch.no_grad():
        want_eval = sum(lm_loss(ref(**x), y).item() * len(y) for x, y in data) / sum(len(y) for _, y in data)
    for source, extra in [(data, {}), (_Tokens(data), {"batch_size": n, "shuffle": False})]:
        result = fit(build("gpt2", seed=3), source, lm_loss, sgd, strategy="data", progress=False,
                     micro_batches=2, eval_data=data, **extra)
        what = "iterable" if source is data else "Dataset"
        for (name, p), q in zip(result.model.named_parameters(), ref.parameters()):
            assert_close_all_ranks(comm, p.detach(), q.detach(), atol=1e-10, what=f"{what}: {name}")
        assert_close_all_ranks(comm, torch.tensor(result.history[0]["eval_loss"]), torch.tensor(want_eval),
                               atol=1e-10, what=f"{what}: eval loss")


def test_dist_sync_mpi_reduces_the_declared_buckets_with_no_negotiation_float64(comm):
    """The default store is told the bucket order once (declare_order) and reduces the buckets through its
    gradient reducer: the parameters after STEPS steps equal one process's in float64, and the store's
    coordinator ran no negotiation cycle (its count is a real observable: every cycle increments it)."""
    torch.manual_seed(1234)
    ref = SmallCNN().double()
    replica = copy.deepcopy(ref) if comm.rank == 0 else SmallCNN().double()
    dp = DataParallel(replica, **SMALL)  # kvstore="dist_sync_mpi", the default
    o = torch.optim.SGD(dp.parameters(), lr=0.1, momentum=0.9)
    ro = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    _train_side_by_side(comm, dp, ref, o, ro, [(x.double(), y) for x, y in batches(comm.size, STEPS, seed=3)])
    declared, cycles, buckets = dp.kv._declared is not None, dp.kv.cycles, len(dp.buckets)
    dp.close()
    assert_all_ranks(comm, declared and cycles == 0 and buckets >= 3,
                     f"declared={declared}, {cycles} negotiation cycles, {buckets} buckets")
    for (name, p), q in zip(replica.named_parameters(), ref.parameters()):
        assert_close_all_ranks(comm, p.detach(), q.detach(), atol=1e-12, what=f"float64 {name}")


def test_a_store_object_declared_twice_is_refused_on_every_rank_before_gradients_move(comm):
    """A user-given dist_sync_mpi store takes the declared path too; a second DataParallel on it (other keys)
    cannot declare another order: KVStoreError on every rank, naming the ranks, at construction."""
    from mpitrain import kvstore as kvmod

    kv = kvmod.create("dist_sync_mpi", comm, lazy_thread=True)
    first = DataParallel(SmallCNN(), kvstore=kv, **SMALL)
    try:
        DataParallel(SmallCNN(), kvstore=kv, name="dp2", **SMALL)  # the same store declared twice
        msg = ""
    except Exception as e:  # noqa: BLE001 - the message is what is checked
        msg = f"{type(e).__name__}: {e}"
    first.close()
    kv.close()
    assert_all_ranks(comm, "KVStoreError" in msg and "already" in msg and f"rank {comm.size - 1}" in msg,
                     f"got {msg!r}")


def _train_side_by_side(comm: Any, dp: DataParallel, ref: nn.Module, o: torch.optim.Optimizer,
                        ro: torch.optim.Optimizer, data: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Step `dp` on this rank's slice of each batch and `ref` on the whole batch (cross-entropy)."""
    for x, y in data:
        o.zero_grad()
        F.cross_entropy(dp(my_slice(x, comm)), my_slice(y, comm)).backward()
        o.step()
        ro.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        ro.step()


def test_one_rank_dataparallel_registers_no_bucket_in_its_store_and_trains_as_plain_torch(comm):
    """On a one-rank communicator (each rank its own) the store DataParallel makes receives nothing: no
    registration of the buckets (a host copy of the whole gradient, per fit call on a GPU); one check of
    the settings is the only message. The step still equals plain torch's."""
    solo = comm.split(comm.rank)
    ref = make_model(SmallCNN, comm)
    with calls_recorded() as calls:
        dp = DataParallel(copy.deepcopy(ref), comm=solo, **SMALL)
    x, y = batches(1, 1)[0]
    F.cross_entropy(dp(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    dp.close()
    assert_all_ranks(comm, calls == ["allgather_object"], f"calls at construction: {calls}")
    for (name, p), q in zip(dp.module.named_parameters(), ref.parameters()):
        assert_close_all_ranks(comm, p.grad, q.grad, atol=0.0, what=f"grad {name}")
