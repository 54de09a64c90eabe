"""Hugging Face transformers (captured with torch.export) against one process: fit and the loop API."""

from __future__ import annotations

import copy

import pytest
import torch

import mpitrain
from mpitrain.fit import fit
from mpitrain.perf.memory import step_memory
from mpitrain.strategies.pipeline._materialize import materialize
from tests.helpers import assert_all_ranks, assert_close_all_ranks

from .tiny_transformers import build, lm_batches, lm_loss

STEPS, ROWS = 2, 2  # steps per run; rows per micro-batch


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def micro_slices(inputs: dict, labels: torch.Tensor, slices: int):
    n = len(labels) // slices
    for i in range(slices):
        yield {k: v[i * n:(i + 1) * n] for k, v in inputs.items()}, labels[i * n:(i + 1) * n]


def backward_in_slices(model, inputs: dict, labels: torch.Tensor, slices: int) -> None:
    """One process: the gradients of the global batch's mean loss, as `slices` equal micro-batches,
    added to the parameters' ``.grad``."""
    dev = next(model.parameters()).device  # the loader's CPU rows go where the model is
    for x, y in micro_slices(inputs, labels, slices):
        (lm_loss(model(**{k: v.to(dev) for k, v in x.items()}), y.to(dev)) / slices).backward()


def reference_train(model, data, optimizer, slices: int):
    """One process: each global batch as `slices` equal micro-batches, gradients of the mean loss."""
    model = copy.deepcopy(model)
    opt = optimizer(model.parameters())
    for inputs, labels in data:
        opt.zero_grad()
        backward_in_slices(model, inputs, labels, slices)
        opt.step()
    return model


def compare(comm, got, want, what: str) -> None:
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        assert_close_all_ranks(comm, a.detach().cpu(), b.detach().cpu(), atol=1e-10, what=f"{what}: parameter {name}")


def layouts(size: int) -> list[tuple[int, int]]:
    """(P, R): the whole pipeline, and 2 x 2 on four ranks."""
    return [(size, 1)] + ([(2, size // 2)] if size == 4 else [])


# GPT-2 (embedding tied to the LM head: the tie spans the first and last partition) under the 1F1B
# family; BERT-MLM (its decoder tied to the word embedding) and Llama (untied) under two each, a
# zero-bubble one among them. GPT-2 under zb1p and zbv: the tied test below (the loop API, its tie's
# gradient sum after the weight halves) and the meta test (zbv through fit, model and hybrid).
CASES = [("gpt2", "gpipe"), ("gpt2", "1f1b"), ("gpt2", "interleaved-1f1b"),
         ("bert", "1f1b"), ("bert", "zbv"), ("llama", "interleaved-1f1b"), ("llama", "zb1p")]


@pytest.mark.mpi
@pytest.mark.parametrize("name, schedule", CASES)
def test_transformer_parameters_after_2_steps_equal_one_process(comm, device, name, schedule):
    """On `device` (the CPU here; the GPU suite runs this test again on CUDA: tests/gpu)."""
    model = build(name).to(device)
    for P, R in layouts(comm.size):
        M = P  # a multiple of P, as interleaved-1f1b needs
        data = lm_batches(R * M * ROWS, STEPS, seed=P + R)
        want = reference_train(model, data, sgd, R * M)
        result = fit(model, data, lm_loss, sgd, strategy="model" if R == 1 else "hybrid", partitions=P,
                     micro_batches=M, schedule=schedule, progress=False, balance="params")
        compare(comm, result.model, want, f"{name} {schedule} P={P} R={R}")
        model = build(name).to(device)  # fit trained `model` in place on the ranks that hold its parameters


# Built on the meta device, captured by torch.export (no rank runs or holds the whole model): GPT-2
# timing only its own partitions, BERT and Llama split by parameters, one schedule each; GPT-2 under
# zbv too (its tie on one rank).
META_CASES = [("gpt2", "1f1b", "time"), ("bert", "gpipe", "params"), ("llama", "interleaved-1f1b", "params"),
              ("gpt2", "zbv", "params")]
SEED = 3


@pytest.mark.mpi
@pytest.mark.parametrize("name, schedule, balance", META_CASES)
def test_meta_transformer_holds_only_its_partition_and_trains_like_one_process(comm, name, schedule, balance):
    """Each rank materialises only its partitions' tensors, initialised by the model's own
    ``_init_weights``; after 2 steps they equal one process that materialises the whole model with
    the same seed and init_fn and trains it with plain torch."""
    reference = build(name, meta=True)
    materialize(reference, seed=SEED, init_fn=reference._init_weights)
    for P, R in layouts(comm.size):
        M = P
        data = lm_batches(R * M * ROWS, STEPS, seed=P + R)
        want = reference_train(reference, data, sgd, R * M)
        model = build(name, meta=True)
        got = fit(model, data, lm_loss, sgd, strategy="model" if R == 1 else "hybrid", partitions=P,
                  micro_batches=M, schedule=schedule, progress=False, balance=balance, init_seed=SEED,
                  init_fn=model._init_weights).model
        compare_held(comm, got, want, f"meta {name} {schedule} balance={balance!r} P={P} R={R}")


def compare_held(comm, got, want, what: str) -> None:
    """Each rank holds some, and the ranks together all, of the parameters of `got` (a meta model
    materialised partition by partition); those it holds equal `want`'s to 1e-12."""
    params = dict(got.named_parameters())
    real = {k for k, q in params.items() if not q.is_meta}
    held = set().union(*comm.allgather_object(real))
    assert_all_ranks(comm, 0 < len(real) < len(params) and held == set(params),
                     f"{what}: rank {comm.rank} materialised {sorted(real)}; all ranks {sorted(held)}")
    # ranks hold different numbers of real parameters: one verdict per rank, one collective
    errors = {k: (a.detach() - b.detach()).abs().max().item()
              for (k, a), b in zip(got.named_parameters(), want.parameters()) if k in real}
    assert_all_ranks(comm, max(errors.values()) <= 1e-12, f"{what}: rank {comm.rank} errors {errors}")


@pytest.mark.mpi
def test_meta_transformer_in_the_loop_api_trains_and_evaluates_like_one_process(comm):
    """A meta GPT-2 in the user's own loop: AdamW built right after construction (before the set-up
    materialises anything), default balance="time"; the held weights after 2 steps and pipe.eval's
    logits on an uneven batch equal one process's."""
    model = build("gpt2", meta=True)
    want = build("gpt2", meta=True)
    materialize(want, seed=SEED, init_fn=want._init_weights)
    pipe = mpitrain.Pipeline(model, partitions=comm.size, micro_batches=2, comm=comm, seed=SEED,
                             init_fn=model._init_weights)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(want.parameters(), lr=1e-2)
    for inputs, labels in lm_batches(4, STEPS, seed=1):
        opt.zero_grad()
        pipe.step(inputs, labels, lm_loss)
        opt.step()
        ref_opt.zero_grad()
        backward_in_slices(want, inputs, labels, 2)
        ref_opt.step()
    compare_held(comm, pipe.trained_model(), want, "meta GPT-2, AdamW loop")
    x = {k: v[:5] for k, v in lm_batches(5, 1, seed=3)[0][0].items()}
    out = pipe.eval(x)
    with torch.no_grad():
        ref = want.eval()(**x)
    assert_close_all_ranks(comm, out.logits, ref.logits, atol=1e-12, what="meta GPT-2 eval logits")


@pytest.mark.mpi
@pytest.mark.parametrize("schedule", ["1f1b", "zb1p", "zbv"])
def test_tied_copies_get_the_summed_gradient_stay_identical_and_evaluate_like_one_process(comm, schedule):
    """GPT-2's wte/lm_head weight lives on the first and the last partition's rank (the last rank; rank
    0 under zbv: one tensor); after each step every holder has the one-process gradient (the sum of the
    two uses, after the weight halves of the zero-bubble schedules), so the copies stay equal after
    AdamW steps; pipe.eval's logits equal one process's."""
    model = build("gpt2")
    want = copy.deepcopy(model)
    pipe = mpitrain.Pipeline(model, partitions=comm.size, micro_batches=2, schedule=schedule, comm=comm,
                             balance="params", example=lm_batches(4, 1)[0][0])
    tied = model.lm_head.weight
    holders = comm.allgather_object(any(q is tied for q in pipe.parameters()))
    assert_all_ranks(comm, holders[0] and holders[pipe.last_rank], f"tied weight holders {holders}")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(want.parameters(), lr=1e-2)
    for inputs, labels in lm_batches(4, STEPS, seed=1):
        opt.zero_grad()
        pipe.step(inputs, labels, lm_loss)
        ref_opt.zero_grad()
        backward_in_slices(want, inputs, labels, 2)
        if holders[comm.rank]:
            assert_close_all_ranks(comm, tied.grad, want.lm_head.weight.grad, atol=1e-10, what="tied grad")
        else:
            assert_all_ranks(comm, True)
        opt.step()
        ref_opt.step()
    compare(comm, pipe.trained_model(), want, f"AdamW loop, {schedule}")
    x = {k: v[:5] for k, v in lm_batches(5, 1, seed=3)[0][0].items()}
    with torch.no_grad():
        ref = want.eval()(**x)
    assert_close_all_ranks(comm, pipe.eval(x).logits, ref.logits, atol=1e-10, what=f"eval logits, {schedule}")


@pytest.mark.mpi
def test_loop_api_eval_outputs_and_recomputation_equal_one_process(comm):
    """The user's own loop with checkpoint='always' trains exactly like one process; eval returns the
    model's ModelOutput for an uneven batch on every rank; recomputation holds fewer activations."""
    model = build("llama")
    want = copy.deepcopy(model)
    M = 4
    data = lm_batches(M * 8, STEPS, seed=2)  # GPipe keeps all M micro-batches' activations
    peaks = {}
    for policy in ("never", "always"):
        pipe = mpitrain.Pipeline(copy.deepcopy(model), partitions=comm.size, micro_batches=M, schedule="gpipe",
                                 comm=comm, checkpoint=policy, balance="params", example=data[0][0])
        peaks[policy] = step_memory(lambda pipe=pipe: pipe.step(*data[0], lm_loss))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for inputs, labels in data:
        opt.zero_grad()
        pipe.step(inputs, labels, lm_loss)
        opt.step()
    ref_opt = torch.optim.SGD(want.parameters(), lr=0.1)
    for inputs, labels in data:
        ref_opt.zero_grad()
        backward_in_slices(want, inputs, labels, M)
        ref_opt.step()
    compare(comm, pipe.trained_model(), want, "checkpoint='always'")
    # every rank saves; all ranks together keep at most 3/4 (a rank holding little more than the
    # embedding saves less than one holding whole layers)
    total = {k: sum(comm.allgather_object(v)) for k, v in peaks.items()}
    assert_all_ranks(comm, peaks["always"] < peaks["never"] and total["always"] < 0.75 * total["never"],
                     f"step memory with recomputation {peaks}, all ranks {total}")
    x = {k: v[:5] for k, v in lm_batches(5, 1, seed=3)[0][0].items()}
    out = pipe.eval(x)
    with torch.no_grad():
        ref = want.eval()(**x)
    assert_all_ranks(comm, type(out) is type(ref), f"eval returned {type(out).__name__}")
    assert_close_all_ranks(comm, out.logits, ref.logits, atol=1e-10, what="eval logits")
