"""Hugging Face transformers (captured with torch.export) against one process: fit and the loop API."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch

import mpitrain
from mpitrain.fit import fit
from mpitrain.perf.memory import step_memory
from mpitrain.strategies.pipeline._materialize import materialize
from tests.helpers import assert_all_ranks, assert_close_all_ranks

from .tiny_transformers import (
    DROPOUT,
    ENCODER_DECODER,
    FLOAT32,
    NORM_IN_FLOAT32,
    SEQUENCE_CLASSIFIERS,
    TRANSFORMERS,
    build,
    encoded,
    lm_batches,
    lm_loss,
    own_loss,
)

STEPS, ROWS = 2, 2  # steps per run; rows per micro-batch


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def micro_slices(inputs: dict, labels: torch.Tensor, slices: int):
    """`slices` equal pieces of the inputs' rows, and of the labels' (``(B, T)`` or flattened ``(B*T,)``)."""
    n, k = len(inputs["input_ids"]) // slices, len(labels) // slices
    for i in range(slices):
        yield {key: v[i * n:(i + 1) * n] for key, v in inputs.items()}, labels[i * k:(i + 1) * k]


def kept_tokens(model, loss_fn, labels: torch.Tensor) -> int:
    """The labels a token-mean loss averages over: those other than -100; the model's own loss of a causal
    LM (transformers' ForCausalLMLoss) scores ``labels[..., 1:]`` only."""
    causal = loss_fn is own_loss and getattr(model.loss_function, "__name__", "") == "ForCausalLMLoss"
    return int((labels[..., 1:] if causal and labels.dim() > 1 else labels).ne(-100).sum())


def backward_in_slices(model, inputs: dict, labels: torch.Tensor, slices: int, loss_fn=lm_loss) -> None:
    """One process: the gradients of the global batch's mean loss over its kept tokens, as `slices`
    equal micro-batches each weighted by its kept tokens (1/slices without -100 labels), added to the
    parameters' ``.grad``."""
    dev = next(model.parameters()).device  # the loader's CPU rows go where the model is
    pieces = list(micro_slices(inputs, labels, slices))
    kept = [kept_tokens(model, loss_fn, y) for _, y in pieces]
    for (x, y), c in zip(pieces, kept):
        (loss_fn(model(**{k: v.to(dev) for k, v in x.items()}), y.to(dev)) * c / sum(kept)).backward()


def reference_train(model, data, optimizer, slices: int, loss_fn=lm_loss):
    """One process: each global batch as `slices` equal micro-batches, gradients of the mean loss."""
    model = copy.deepcopy(model)
    opt = optimizer(model.parameters())
    for inputs, labels in data:
        opt.zero_grad()
        backward_in_slices(model, inputs, labels, slices, loss_fn)
        opt.step()
    return model


def compare(comm, got, want, what: str, atol: float = 1e-10) -> None:
    """Every parameter within `atol` of one process's (1e-6 at least for a float32 model)."""
    for (name, a), b in zip(got.named_parameters(), want.parameters()):
        tol = atol if a.dtype == torch.float64 else max(atol, 1e-6)
        assert_close_all_ranks(comm, a.detach().cpu(), b.detach().cpu(), atol=tol, what=f"{what}: parameter {name}")


def layouts(size: int) -> list[tuple[int, int]]:
    """(P, R): the whole pipeline, and 2 x 2 on four ranks."""
    return [(size, 1)] + ([(2, size // 2)] if size == 4 else [])


# The conformance suite: every family of tiny_transformers from its default config (dropout 0 only for
# the comparison), under data, model and hybrid, over batches whose length changes (12 then 8 tokens),
# with the external cross-entropy on the logits against targets flattened to (B*T,) (the sharding rule
# of strategies/_batching: k target rows per sample) and the model's own loss (labels among the inputs).
# One process runs the same `size` micro-batches: data shares (R = size), a pipeline of P = size with
# M = size, and hybrid 2 x 2 with M = 2 all cut a batch of size x ROWS rows that way. Under `make test`
# each model runs one pipeline schedule per world size, rotating (model i at size s: schedule (i + s) mod 5),
# so that at every size every schedule runs for two models and each model runs three schedules over 2, 3
# and 4 ranks (a capture per schedule costs seconds); MPITRAIN_CONFORMANCE=full runs every schedule at
# every size (the table of docs/transformers.md).
CONFORMANCE = sorted(TRANSFORMERS)
LENGTHS = (12, 8)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb1p", "zbv")
LOSS = {"gpipe": "ce", "1f1b": "own", "interleaved-1f1b": "ce", "zb1p": "own", "zbv": "ce"}


def runs(name: str, size: int) -> list[tuple[str, int, str, str]]:
    """(strategy, partitions, schedule, loss) of one model's conformance fits on `size` ranks."""
    full = os.environ.get("MPITRAIN_CONFORMANCE") == "full"
    schedules = SCHEDULES if full else [SCHEDULES[(CONFORMANCE.index(name) + size) % len(SCHEDULES)]]
    out = [("data", 1, "-", "ce"), ("data", 1, "-", "own")] + [("model", size, s, LOSS[s]) for s in schedules]
    return out + ([("hybrid", 2, "1f1b", "own")] if size == 4 else [])


@pytest.mark.mpi
@pytest.mark.parametrize("name", CONFORMANCE)
def test_default_config_transformer_trains_like_one_process_under_every_strategy_and_schedule(comm, device, name):
    """On `device` (the CPU here; the GPU suite runs this test again on CUDA: tests/gpu)."""
    size = comm.size
    decoder = name in ENCODER_DECODER
    data = {loss: lm_batches(size * ROWS, STEPS, seed=size, lengths=LENGTHS, decoder=decoder, labels=loss == "own")
            for loss in ("ce", "own")}
    data["ce"] = [(x, y.reshape(-1)) for x, y in data["ce"]]  # LM targets flattened to (B*T,), as HF's losses do
    losses = {"ce": lm_loss, "own": own_loss}
    model = build(name).to(device)
    want = {loss: reference_train(model, data[loss], sgd, size, losses[loss]) for loss in losses}
    (x16, y16), = lm_batches(size * ROWS + 1, 1, seed=7, lengths=(16,), decoder=decoder)  # eval: another length
    y16 = y16.reshape(-1)
    with torch.no_grad():
        eval_want = lm_loss(want["ce"].eval()(**{k: v.to(device) for k, v in x16.items()}), y16.to(device)).item()
    for strategy, P, schedule, loss in runs(name, size):
        options = {} if strategy == "data" else {"partitions": P, "micro_batches": size // (size // P),
                                                 "schedule": schedule, "balance": "params"}
        evaluate = {"eval_data": [(x16, y16)]} if strategy != "data" and loss == "ce" else {}
        result = fit(build(name).to(device), data[loss], losses[loss], sgd, strategy=strategy, progress=False,
                     **options, **evaluate)
        what = f"{name} {strategy} P={P} {schedule} loss={loss} on {size} ranks"
        # a causal LM's own loss is computed in float32 (transformers' `logits.float()`), so the
        # 1/M (or rows/total) scale of each micro-batch's loss is rounded in float32 before backward;
        # likewise in a norm computed in float32 (NORM_IN_FLOAT32)
        exact = loss == "ce" and name not in NORM_IN_FLOAT32
        compare(comm, result.model, want[loss], what, atol=1e-10 if exact else 1e-7)
        if evaluate:
            got = result.history[-1]["eval_loss"]
            tol = 1e-10 if name not in FLOAT32 else 1e-5
            assert_all_ranks(comm, abs(got - eval_want) < tol, f"{what}: eval loss {got} vs {eval_want}")


# Sequence classification heads from the same default configs (num_labels 3; pad_token_id = eos where the
# config has none, as HF's examples do), on batches whose padded tails hold the pad token: GPT-2 and
# Llama pick each row's last non-pad token from input_ids (an index computed from the data, on the last
# partition). Data with cross-entropy on the logits against (B,) classes (and eval), a pipeline with the
# model's own loss (labels among the inputs; one schedule per world size, rotating), hybrid 2 x 2 with
# cross-entropy. fit gets the inputs as a tokenizer returns them (BatchEncoding, a mapping but no dict).
CLASSIFIERS = sorted(SEQUENCE_CLASSIFIERS)


@pytest.mark.mpi
@pytest.mark.parametrize("name", CLASSIFIERS)
def test_sequence_classifier_on_padded_batches_trains_like_one_process(comm, name):
    """Parameters after 2 steps (and the data run's eval loss) equal one process's under data, the
    pipeline and hybrid."""
    size = comm.size
    data = {loss: lm_batches(size * ROWS, STEPS, seed=size, lengths=LENGTHS, classify=True, labels=loss == "own")
            for loss in ("ce", "own")}
    losses = {"ce": lm_loss, "own": own_loss}
    model = build(name, classify=True)
    want = {loss: reference_train(model, data[loss], sgd, size, losses[loss]) for loss in losses}
    schedule = SCHEDULES[(CLASSIFIERS.index(name) + size) % len(SCHEDULES)]
    fits = [("data", 1, "-", "ce"), ("model", size, schedule, "own")]
    (x, y), = lm_batches(size * ROWS + 1, 1, seed=7, classify=True)  # eval: uneven rows
    with torch.no_grad():
        eval_want = lm_loss(want["ce"].eval()(**x), y).item()
    # Llama normalises in float32: the 1/3 loss scale rounds differently (docs/transformers.md)
    tol = 1e-7 if name in NORM_IN_FLOAT32 else 1e-10
    for strategy, P, schedule, loss in fits + ([("hybrid", 2, "1f1b", "ce")] if size == 4 else []):
        options = {} if strategy == "data" else {"partitions": P, "micro_batches": size // (size // P),
                                                 "schedule": schedule, "balance": "params"}
        evaluate = {"eval_data": encoded([(x, y)])} if strategy == "data" else {}
        result = fit(build(name, classify=True), encoded(data[loss]), losses[loss], sgd, strategy=strategy,
                     progress=False, **options, **evaluate)
        what = f"{name} classifier {strategy} P={P} {schedule} loss={loss}"
        compare(comm, result.model, want[loss], what, atol=tol)
        if evaluate:
            got = result.history[-1]["eval_loss"]
            assert_all_ranks(comm, abs(got - eval_want) < tol, f"{what}: eval loss {got} vs {eval_want}")


# the models whose default config has dropout, and Mixtral: the one with data-dependent routing, whose
# default balance="time" cannot time a partition on stand-ins (the split stays by parameters); the
# others' default configs differ from the conformance's only in float32 and the balance
DEFAULT_CONFIG = sorted([name for name in CONFORMANCE if DROPOUT[name]] + ["mixtral"])


@pytest.mark.mpi(sizes=(2,))
@pytest.mark.parametrize("name", DEFAULT_CONFIG)
def test_fully_default_config_transformer_trains_with_dropout_under_the_pipeline(comm, name):
    """The config exactly as transformers makes it (dropout on, float32, default balance) trains
    through the pipeline over changing lengths: a finite loss, and every rank's parameters moved."""
    model = build(name, dropout=True, dtype=torch.float32)
    before = [q.detach().clone() for q in model.parameters()]
    data = lm_batches(4, 2, lengths=LENGTHS, decoder=name in ENCODER_DECODER)
    result = fit(model, data, lm_loss, sgd, strategy="model", partitions=comm.size, micro_batches=2,
                 progress=False)
    moved = [not torch.equal(a, b) for a, b in zip(result.model.parameters(), before)]
    assert_all_ranks(comm, math.isfinite(result.history[-1]["loss"]) and any(moved),
                     f"{name}: loss {result.history[-1]['loss']}, moved {sum(moved)}/{len(moved)}")


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
    materialises anything), default balance="time", inputs as a tokenizer's BatchEncoding; the held
    weights after 2 steps and pipe.eval's logits on an uneven batch equal one process's."""
    model = build("gpt2", meta=True)
    want = build("gpt2", meta=True)
    materialize(want, seed=SEED, init_fn=want._init_weights)
    pipe = mpitrain.Pipeline(model, partitions=comm.size, micro_batches=2, comm=comm, seed=SEED,
                             init_fn=model._init_weights)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(want.parameters(), lr=1e-2)
    for inputs, labels in encoded(lm_batches(4, STEPS, seed=1)):  # captured from a BatchEncoding
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
