"""Parameter-efficient fine-tuning as users bring it: LoRA adapters from ``peft`` on tiny Hugging Face models
from their default configs (GPT-2 and Llama causal LMs, a BERT sequence classifier; peft's default target
modules for each architecture), and a torchvision ResNet-18 whose backbone is frozen with
``requires_grad_(False)`` (only ``fc`` trains). Over real MPI at 2, 3 and 4 ranks:

* after 2 steps the trainable parameters equal one process's (float64, ``lora_dropout=0`` for the
  comparison) under data (zero 0-3), model, hybrid (4 ranks) and auto (2 ranks), with an optimizer instance
  built on ``filter(lambda p: p.requires_grad, ...)`` or a factory handed every parameter, and the frozen ones
  are bit for bit as they started;
* DataParallel gives frozen parameters no gradient bucket (so no message) and no gradient;
* a stopped run with frozen parameters resumes bit-identical (default ``lora_dropout``: its random stream);
* ``FitResult.model`` is still a ``PeftModel``: ``save_pretrained`` writes the trained adapters,
  ``merge_and_unload`` folds them into the base model."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from mpitrain import DataParallel, checkpoint
from mpitrain.fit import fit
from mpitrain.spatial.models import torchvision_module
from tests.helpers import assert_all_ranks, assert_close_all_ranks, bitwise_equal
from tests.strategies.pipeline.models import batches, reference_train
from tests.strategies.pipeline.tiny_transformers import build, lm_batches, lm_loss, own_loss

pytestmark = pytest.mark.mpi

STEPS, ROWS = 2, 6  # global batches of 6 sequences: shares of 3/3, 2/2/2 and 2/2/1/1


def lora(name: str, dropout: float = 0.0) -> nn.Module:
    """Tiny `name` (gpt2, llama: the LM head; bert: the sequence classifier) wrapped as peft's docs show:
    ``get_peft_model(model, LoraConfig(task_type=..., r=8, lora_alpha=..., lora_dropout=...))``, target
    modules peft's default for the architecture (GPT-2 ``c_attn``, Llama ``q_proj``/``v_proj``, BERT
    ``query``/``value``; the classifier head trained whole, peft's ``modules_to_save``)."""
    model = build(name, classify=name == "bert")  # imports transformers first (without torchvision's C++ ops)
    from peft import LoraConfig, TaskType, get_peft_model

    task, alpha = (TaskType.SEQ_CLS, 16) if name == "bert" else (TaskType.CAUSAL_LM, 32)
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(task_type=task, r=8, lora_alpha=alpha, lora_dropout=dropout))


def data(name: str, steps: int = STEPS) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """(inputs, targets) batches; the classifier's with ``labels`` among the inputs (it trains on its own
    loss, computed in float64). The LMs train on :func:`lm_loss` of their logits: their own loss is computed
    in float32 (transformers' ``logits.float()``), which would round each rank's share differently."""
    return lm_batches(ROWS, steps, seed=4, labels=name == "bert", classify=name == "bert")


def loss_of(name: str) -> Any:
    return own_loss if name == "bert" else lm_loss


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def lora_sgd(params: Any) -> torch.optim.Optimizer:
    """Weight decay too: a frozen parameter, which has no gradient, must not decay. (Not Adam: its update
    g / sqrt(v) turns the last bits of a gradient that nearly cancels into whole steps.)"""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9, weight_decay=0.01)


def one_process(model: nn.Module, name: str) -> nn.Module:
    model = copy.deepcopy(model)
    opt = lora_sgd(trainable(model))
    for x, y in data(name):
        opt.zero_grad()
        loss_of(name)(model(**x), y).backward()
        opt.step()
    return model


def check(comm, got: nn.Module, want: nn.Module, start: nn.Module, what: str, atol: float) -> None:
    """Trainable parameters close to one process's and moved; frozen ones bit for bit as at the start."""
    moved = False
    for (name, a), b, s in zip(got.named_parameters(), want.parameters(), start.parameters()):
        if a.requires_grad:
            assert_close_all_ranks(comm, a.detach(), b.detach(), atol=atol, what=f"{what}: {name}")
            moved = moved or not torch.equal(a, s)
        else:
            assert_all_ranks(comm, torch.equal(a, s), f"{what}: frozen {name} moved")
    assert_all_ranks(comm, moved, f"{what}: no trainable parameter moved")


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_lora_gpt2_under_data_trains_like_one_process_and_stays_a_peft_model(comm, zero, tmp_path):
    """The optimizer instance as peft users write it, on the trainable parameters only. zero=3 gathers the
    adapters back whole into the user's PeftModel, which then saves them and merges them."""
    start = lora("gpt2")
    want = one_process(start, "gpt2")
    model = copy.deepcopy(start)
    opt = lora_sgd(filter(lambda p: p.requires_grad, model.parameters()))
    result = fit(model, data("gpt2"), lm_loss, opt, strategy="data", zero=zero, bucket_mb=0.001, progress=False)
    got = result.model
    check(comm, got, want, start, f"gpt2 data zero={zero}", 1e-10)
    assert_all_ranks(comm, type(got).__name__ == "PeftModelForCausalLM", f"result.model is {type(got).__name__}")
    if zero == 3:
        from peft import PeftModel

        out = Path(tmp_path) / f"rank{comm.rank}"
        got.save_pretrained(out)
        loaded = PeftModel.from_pretrained(copy.deepcopy(start).get_base_model(), out)
        same = all(torch.equal(a, b) for (_, a), (_, b) in zip(loaded.named_parameters(), got.named_parameters()))
        x = data("gpt2", 1)[0][0]["input_ids"]
        with torch.no_grad():
            got.eval()
            logits = got(input_ids=x).logits
            merged = got.merge_and_unload()(input_ids=x).logits
        assert_all_ranks(comm, same, "save_pretrained/from_pretrained lost the trained adapters")
        assert_close_all_ranks(comm, merged, logits, atol=1e-10, what="merge_and_unload")


def pipelines(size: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(model, strategy, options): Llama under model; BERT's classifier under hybrid 2 x 2 (4 ranks) or
    model; GPT-2 under auto at 2 ranks (the planner's choice, any)."""
    rows = [("llama", "model", {"partitions": size, "micro_batches": 2})]
    rows.append(("bert", "hybrid", {"partitions": 2, "replicas": 2, "micro_batches": 2}) if size == 4 else
                ("bert", "model", {"partitions": size, "micro_batches": 2}))
    return rows + ([("gpt2", "auto", {})] if size == 2 else [])


def test_lora_under_model_hybrid_and_auto_trains_like_one_process(comm):
    """The pipeline captures the PeftModel with torch.export (its forward passes ``**kwargs`` on: the cache
    is turned off through its config); the partitions hold frozen and adapter weights alike."""
    for name, strategy, options in pipelines(comm.size):
        start = lora(name)
        want = one_process(start, name)
        model = copy.deepcopy(start)
        opt = lora_sgd(filter(lambda p: p.requires_grad, model.parameters()))
        got = fit(model, data(name), loss_of(name), opt, strategy=strategy, progress=False,
                  balance="params", **options).model
        # Llama normalises in float32 (tiny_transformers.NORM_IN_FLOAT32): its gradients round there
        check(comm, got, want, start, f"{name} {strategy}", 1e-7 if name == "llama" else 1e-10)
        assert_all_ranks(comm, type(got).__name__.startswith("PeftModel"), f"result.model is {type(got).__name__}")


def frozen_resnet18() -> nn.Module:
    torch.manual_seed(0)
    model = torchvision_module("models.resnet").resnet18(num_classes=5).double()
    model.requires_grad_(False)
    model.fc.requires_grad_(True)
    return model


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def test_frozen_resnet18_backbone_trains_its_head_like_one_process_with_a_factory_handed_every_parameter(comm):
    """The factory gets every parameter, frozen ones too (as ``sgd(model.parameters())`` in one process):
    ZeRO leaves those out of its shards and groups; a pipeline partition may hold no trainable parameter.
    BatchNorm normalises with each rank's (micro-)batch statistics: the reference slices alike."""
    layouts: list[tuple[str, dict[str, Any], int]] = [
        ("data", {"zero": 1}, comm.size),  # zero=3 with frozen parameters: the LoRA test above
        ("model", {"partitions": comm.size, "micro_batches": comm.size}, comm.size)]
    if comm.size == 4:
        layouts.append(("hybrid", {"partitions": 2, "replicas": 2, "micro_batches": 2, "zero": 2}, 4))
    for strategy, options, slices in layouts:
        start = frozen_resnet18()
        batches_ = [(x.double(), y) for x, y in batches((3, 16, 16), 2 * slices, STEPS, classes=5, seed=1)]
        want = reference_train(start, batches_, sgd, slices)
        got = fit(copy.deepcopy(start), batches_, nn.CrossEntropyLoss(), sgd, strategy=strategy, progress=False,
                  balance="params", **options).model
        check(comm, got, want, start, f"resnet18 {strategy} {options}", 1e-10)


def test_data_parallel_gives_frozen_parameters_no_bucket_and_no_gradient(comm):
    """Only the adapters are bucketed (what is reduced: frozen weights send nothing) and get a gradient."""
    model = lora("gpt2")
    dp = DataParallel(model, comm=comm, bucket_mb=0.001)
    try:
        x, y = data("gpt2", 1)[0]
        lm_loss(dp(**x), y).backward()
        adapters = trainable(model)
        bucketed = [p for b in dp.buckets for p in b.params]
        sizes = sum(b.buffer.numel() for b in dp.buckets)
        ok = {id(p) for p in bucketed} == {id(p) for p in adapters} and len(bucketed) == len(adapters)
        assert_all_ranks(comm, ok and sizes == sum(p.numel() + 1 for p in adapters),
                         f"buckets hold {len(bucketed)} tensors, {sizes} elements, for {len(adapters)} adapters")
        grads = [p.grad is None for p in model.parameters() if not p.requires_grad]
        assert_all_ranks(comm, all(grads) and all(p.grad is not None for p in adapters), "gradients of frozen weights")
        held = dp.held_bytes()
        assert_all_ranks(comm, held["params"] == sum(p.numel() * p.element_size() for p in adapters), f"{held}")
    finally:
        dp.close()


# the pipeline's three runs capture the model three times: at 2 ranks only, to keep the suite's time
@pytest.mark.parametrize("strategy", ["data", pytest.param("model", marks=pytest.mark.mpi(sizes=(2,)))])
def test_stopped_lora_run_with_frozen_weights_resumes_bit_identical(comm, tmp_path, strategy):
    """Default lora_dropout (0.1): the resumed run must continue its random stream too. The consolidated
    checkpoint loads into a fresh PeftModel."""
    root = comm.broadcast_object(str(tmp_path))  # rank 0's directory: every rank sees it
    options: dict[str, Any] = ({"zero": 2} if strategy == "data" else
                               {"partitions": comm.size, "micro_batches": 2, "balance": "params"})

    def train(directory: str, **kw: Any) -> Any:
        torch.manual_seed(100 + comm.rank)
        model = lora("gpt2", dropout=0.1)
        return fit(model, data("gpt2", 4), lm_loss, lora_sgd(trainable(model)), strategy=strategy, progress=False,
                   checkpoint_dir=directory, checkpoint_every=2, **options, **kw)

    full = train(f"{root}/{strategy}-full")
    stopped = train(f"{root}/{strategy}-part", on_step_end=lambda s: s.step == 3)
    resumed = train(f"{root}/{strategy}-part", resume=True)
    ok = bitwise_equal(resumed.model.state_dict(), full.model.state_dict())
    ok = ok and [h["loss"] for h in resumed.history] == [h["loss"] for h in full.history]
    assert_all_ranks(comm, ok and stopped.history != [], f"{strategy}: resumed run differs from the uninterrupted")
    fresh = lora("gpt2", dropout=0.1)
    fresh.load_state_dict(checkpoint.load_checkpoint(f"{root}/{strategy}-part"))
    assert_all_ranks(comm, bitwise_equal(fresh.state_dict(), full.model.state_dict()), f"{strategy}: load_checkpoint")
