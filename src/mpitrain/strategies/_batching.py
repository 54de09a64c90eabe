"""Slicing global mini-batches into per-replica and per-micro-batch pieces: equal ones (`shard`,
`chunks`) and, for uneven batches, blocks as even as possible by the project's one blocking rule
(:func:`~mpitrain.comm.base.split_sizes`); and how a batch's inputs call the model (`call_args`,
`call_model`); and what a sample or batch is (:func:`split_batch`: the one rule of fit's data and the
planner's sample batch, here, below both), with the keys of a mapping the model is not called with
(:func:`used_columns`: ``remove_unused_columns``, Hugging Face Trainer's rule, shared the same way).

The sharding rule (:func:`samples`): a batch's size is its inputs' dim 0 (n samples). Targets whose dim 0 is
n, or a multiple k·n (a language model's ``(B*T,)`` token targets against ``(B, T)`` ids), are cut k rows per
sample (:func:`target_rows`, :func:`split_pairs`); any other targets are refused with FitError naming both
shapes, on every rank (each holds the same global batch) before any message.

A batch's inputs are a tensor, a tuple/list (positional arguments) or a dict (keyword arguments, e.g.
``{"input_ids": ..., "attention_mask": ...}``; any other mapping, such as a tokenizer's ``BatchEncoding``,
is taken as the dict of its items: :func:`plain_inputs`), nested as ``torch.utils._pytree`` flattens them. Every
tensor leaf with a dimension is sliced along dim 0; other leaves (0-dim tensors, numbers, strings) pass
as they are."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from .._utils.flat import spans
from ..comm.base import Communicator, split_sizes
from ._device import CPU, as_float, to_device
from .base import Batch, BatchShare, FitError, Share

__all__ = ["ACCEPTED", "LABEL_ALIASES", "LABEL_KEYS", "split_batch", "plain_inputs", "Columns", "EVERY_COLUMN",
           "used_columns", "signature_module",
           "call_args", "call_model", "call_rows", "batch_size", "samples", "per_sample",
           "target_rows", "split_pairs", "shard", "chunks", "check_divisible", "rows", "even_share", "slice_share",
           "gather_rows", "gather_outputs", "DEFAULT_IGNORE_INDEX", "ignore_index_of", "integer_targets", "label_shift",
           "counted", "counted_rows", "zero_loss"]


def plain_inputs(inputs: Any) -> Any:
    """`inputs` where they are a mapping other than a dict -- a Hugging Face tokenizer's ``BatchEncoding``
    (a ``UserDict``), what ``tokenizer(texts, padding=True, return_tensors="pt")`` returns -- as the dict
    of its items; anything else unchanged. Why: pytree, which every slicing here goes through, flattens a
    dict into its tensors but takes another mapping for one opaque leaf (no batch dimension found); the
    model gets the same keyword arguments either way."""
    if isinstance(inputs, Mapping) and not isinstance(inputs, dict):
        return dict(inputs.items())
    return inputs


#: What a sample (a Dataset's item) or a batch (a collated batch, an iterable's element, ``plan``'s sample
#: batch) may be: the one rule of :func:`split_batch`, quoted in every refusal
ACCEPTED = ("(inputs, target), (input_1, ..., input_k, target), or a mapping holding "
            "\"labels\" (Hugging Face's convention: the model is called with every key, labels included, "
            "and the target is item[\"labels\"]; a \"label\" or \"label_ids\" key is renamed \"labels\", as "
            "Hugging Face's data collators rename it)")

#: The names Hugging Face datasets give a class column (``label``; ``label_ids``), which its data collators
#: (``default_data_collator``, ``DataCollatorWithPadding``) rename ``labels``, the models' keyword; in this order
LABEL_ALIASES = ("label", "label_ids")


def split_batch(batch: Any) -> tuple[Batch, Any]:
    """``(inputs, targets)`` of a sample or a batch by the one rule that fit (a Dataset's items and
    collated batches, an iterable's and eval_data's batches) and ``plan`` (its sample batch) share: a
    tuple/list ``(inputs, target)`` or ``(input_1, ..., input_k, target)`` (positional inputs), or a
    mapping holding ``"labels"`` -- then the inputs are the whole mapping as a dict (the model computes
    its own loss from the labels, e.g. ``loss_fn = lambda out, y: out.loss``) and the targets are
    ``batch["labels"]``, so per-sample slicing, eval weighting and the ``(B*T,)``/``(B, T)`` target rule
    apply to them. A mapping without ``"labels"`` but with one of :data:`LABEL_ALIASES` (a Hugging Face
    dataset's raw ``"label"`` column) has that key renamed ``"labels"``, as Hugging Face's collators do, so
    the model gets ``labels=``. Anything else: FitError naming what is accepted (local: every rank holding
    the same batch refuses alike)."""
    if isinstance(batch, Mapping):
        inputs = plain_inputs(batch)  # a BatchEncoding: its dict, so pytree slices its tensors
        if "labels" not in inputs:
            alias = next((k for k in LABEL_ALIASES if k in inputs), None)
            if alias is None:
                raise FitError(f"fit: a mapping item or batch must hold \"labels\" (its keys: "
                               f"{sorted(map(str, batch))}); fit takes {ACCEPTED}")
            inputs = {("labels" if k == alias else k): v for k, v in inputs.items()}
        return inputs, inputs["labels"]
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        if len(batch) == 2:
            return plain_inputs(batch[0]), batch[1]
        return tuple(batch[:-1]), batch[-1]
    size = f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""
    raise FitError(f"fit: got a {type(batch).__name__}{size} as an item or batch; fit takes {ACCEPTED}")


#: The keys ``remove_unused_columns`` keeps whatever the model's forward takes: the labels under each name
#: :func:`split_batch` reads them by (Hugging Face's Trainer keeps "label" and "label_ids" alike)
LABEL_KEYS = ("labels", *LABEL_ALIASES)


@dataclass(frozen=True)
class Columns:
    """Which keys of a mapping item or batch the model is called with (:func:`used_columns`): those in
    `taken` (the forward's parameters) and :data:`LABEL_KEYS`; every key when `taken` is None. Called on
    an item or batch, it returns it without the others (a new dict; anything not a mapping, or a mapping
    losing nothing, as it is). Frozen and plain, so it pickles into a DataLoader's worker processes."""

    taken: frozenset[str] | None = None
    #: the forward, for messages: ``BertForSequenceClassification.forward(input_ids, ...)``
    forward: str = "forward"

    def unused(self, batch: Any) -> list[Any]:
        """The keys of `batch` (a mapping; else none) that are dropped, in the batch's order."""
        if self.taken is None or not isinstance(batch, Mapping):
            return []
        return [k for k in batch if k not in self.taken and k not in LABEL_KEYS]

    def __call__(self, batch: Any) -> Any:
        unused = self.unused(batch)
        if not unused:
            return batch
        return {k: v for k, v in batch.items() if k not in unused}

    def check(self, batch: Any) -> list[str]:
        """The names of the keys of `batch` that are dropped; FitError (local: every rank holding the same
        item or batch refuses alike) when they are every key but the labels: the model would be called
        with nothing to compute from."""
        unused = self.unused(batch)
        if unused and all(k in LABEL_KEYS for k in batch if k not in unused):
            raise FitError(f"fit: remove_unused_columns=True would drop every column but the labels: "
                           f"{[str(k) for k in unused]} are not parameters of {self.forward}; rename them after "
                           f"its parameters, or pass remove_unused_columns=False to call the model with every key")
        return [str(k) for k in unused]


#: every key passed (``remove_unused_columns=False``, a forward taking ``**kwargs``)
EVERY_COLUMN = Columns()


def signature_module(model: object) -> object:
    """The module whose ``forward`` says what `model` takes, as Hugging Face's Trainer reads it: a peft
    model through ``get_base_model()`` (``PeftMixedModel``, which has none: ``base_model.model``; their
    own forward takes ``**kwargs`` and passes them on to the base model), a ``torch.compile``
    ``OptimizedModule`` through ``_orig_mod`` (its forward is ``(*args, **kwargs)``), repeatedly (a
    compiled peft model); any other module, a wrapper of yours included, is itself: its forward is what
    fit calls."""
    while True:
        if type(model).__module__.split(".")[0] == "peft" and hasattr(model, "base_model"):
            base = getattr(model, "get_base_model", None)
            model = base() if callable(base) else model.base_model.model
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod  # type: ignore[attr-defined]
        else:
            return model


def _hugging_face(model: object) -> bool:
    """Whether `model` is a transformers ``PreTrainedModel`` (by its classes' names: nothing is imported)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.split(".")[0] == "transformers"
               for c in type(model).__mro__)


def used_columns(model: object, remove_unused_columns: object = True) -> Columns:
    """fit's and ``plan``'s one rule for the keys of mapping items and batches (Hugging Face Trainer's
    ``remove_unused_columns``): with True, the keys that are parameters of the forward of
    :func:`signature_module` (by keyword: positional-or-keyword and keyword-only) and the labels
    (:data:`LABEL_KEYS`); every key with False, or when the forward takes ``**kwargs`` (it may read any
    key), or when its signature cannot be read. A transformers model is read by its named parameters
    alone, as Trainer reads it: since transformers 5 every model's forward takes ``**kwargs`` for the
    library's own options (attention flags, ``TransformersKwargs``), not for data, and silently ignores
    a key it does not know. FitError (local) unless `remove_unused_columns` is a bool."""
    if not isinstance(remove_unused_columns, bool):
        raise FitError(f"remove_unused_columns must be True or False, got {remove_unused_columns!r}")
    if not remove_unused_columns:
        return EVERY_COLUMN
    target: Any = signature_module(model)
    try:
        params = list(inspect.signature(getattr(target, "forward", target)).parameters.values())
    except (TypeError, ValueError):  # a builtin or C-implemented forward: nothing to read, nothing dropped
        return EVERY_COLUMN
    if any(p.kind is p.VAR_KEYWORD for p in params) and not _hugging_face(target):
        return EVERY_COLUMN
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return Columns(frozenset(named), f"{type(target).__name__}.forward({', '.join(named)})")


def call_args(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """How a batch's inputs call the model: a dict is keyword arguments, a tuple/list positional
    arguments, anything else the one positional argument."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def call_model(model: Callable[..., Any], inputs: Any, device: torch.device = CPU) -> Any:
    """``model(*args, **kwargs)`` for a batch's inputs as :func:`call_args` reads them, their tensors
    moved to `device` first (nothing is moved for the CPU)."""
    args, kwargs = call_args(to_device(inputs, device))
    return model(*args, **kwargs)


def call_rows(model: Callable[..., Any], inputs: Any, start: int, stop: int, device: torch.device = CPU) -> Any:
    """The model's outputs for rows ``[start, stop)`` of `inputs`. With no rows the model runs on the
    batch's first row and every tensor leaf of its outputs is cut to 0 rows: a rank without samples
    still gets the outputs' structure and trailing shapes for a gather (many models, transformers among
    them, refuse an empty batch)."""
    if stop > start:
        return call_model(model, rows(inputs, start, stop), device)
    return rows(call_model(model, rows(inputs, 0, 1), device), 0, 0)


def _sliced(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0


def batch_size(x: Any) -> int:
    """Dim-0 length of the first tensor leaf with a dimension of `x` (a tensor, tuple, list or dict)."""
    for t in pytree.tree_leaves(x):
        if _sliced(t):
            return len(t)
    raise FitError(f"the batch holds no tensor with a batch dimension (got {type(x).__name__})")


def _shapes(x: Any) -> str:
    """The shapes of `x`'s tensors in its structure, for messages (``{'input_ids': (4, 12)}``)."""
    return str(pytree.tree_map(lambda t: tuple(t.shape) if isinstance(t, torch.Tensor) else t, x))


def _has_rows(x: Any) -> bool:
    return any(_sliced(t) for t in pytree.tree_leaves(x))


def samples(inputs: Any, targets: Any) -> int:
    """The number of samples of the batch ``(inputs, targets)``: the inputs' dim 0 (of their first tensor
    with a dimension), once :func:`per_sample` accepts the targets. Inputs without such a tensor (a
    spatial RegionBatch, read lazily) count the targets' rows: their targets are per sample."""
    if not _has_rows(inputs):
        return batch_size(targets)
    n = batch_size(inputs)
    per_sample(n, targets, inputs)
    return n


def per_sample(n: int, targets: Any, inputs: Any = None) -> int:
    """k, the rows of `targets` per sample of a batch of `n` samples: their dim 0 must be n or k·n (k >= 1);
    anything else raises FitError naming both shapes (`inputs`, if given, for the message)."""
    m = batch_size(targets)
    if m == n or (n > 0 and m % n == 0):
        return m // n if n else 1
    held = f"inputs {_shapes(inputs)}" if inputs is not None else "inputs"
    raise FitError(f"targets of shape {_shapes(targets)} do not follow the batch of {n} samples ({held}): the "
                   f"batch size is the inputs' dim 0, and the targets' dim 0 must be {n} or a multiple of it (k "
                   f"rows per sample, e.g. a language model's (batch*tokens,) targets); got {m}")


def target_rows(targets: Any, n: int, start: int, stop: int) -> Any:
    """The rows of samples ``[start, stop)`` of `targets` that belong to a batch of `n` samples (k rows per
    sample, :func:`per_sample`), as views."""
    k = per_sample(n, targets)
    return rows(targets, start * k, stop * k)


def split_pairs(inputs: Any, targets: Any, parts: int) -> list[tuple[Any, Any]]:
    """``(inputs, targets)`` cut into `parts` blocks of samples as even as possible (:func:`split_sizes`;
    empty ones dropped), the targets k rows per sample."""
    n = batch_size(inputs)
    k = per_sample(n, targets, inputs)
    return [(rows(inputs, a, b), rows(targets, a * k, b * k)) for a, b in spans(split_sizes(n, parts)) if b > a]


def check_divisible(n: int, parts: int, what: str) -> None:
    """Refuse (FitError naming what to change) a batch of `n` that `parts` don't divide equally.

    Equal slices keep every strategy's mean loss equal to the one-process mean loss."""
    if parts < 1 or n % parts:
        raise FitError(f"a batch of {n} samples cannot be split equally into {parts} {what}; "
                         f"use a batch size divisible by {parts}")


def shard(x: Any, parts: int, index: int) -> Any:
    """Slice `index` of `parts` equal slices along dim 0 (views, no copy) of every tensor leaf."""
    n = batch_size(x)
    check_divisible(n, parts, "slices")
    step = n // parts
    return rows(x, index * step, (index + 1) * step)


def chunks(x: Any, parts: int) -> list[Any]:
    """All `parts` equal slices of `x` along dim 0."""
    return [shard(x, parts, i) for i in range(parts)]


def rows(x: Any, start: int, stop: int) -> Any:
    """Rows ``[start, stop)`` along dim 0 (views) of every tensor leaf of `x` with a dimension, in the
    same structure; other leaves passed as is."""
    return pytree.tree_map(lambda t: t[start:stop] if _sliced(t) else t, x)


def even_share(n: int, parts: int, index: int) -> Share:
    """Block `index` of `parts` blocks of `n` rows as even as possible (the first ``n % parts`` one longer)."""
    a, b = spans(split_sizes(n, parts))[index]
    return Share(a, b)


def slice_share(inputs: Batch, targets: torch.Tensor, share: Share) -> BatchShare:
    """The :class:`BatchShare` of a global batch held in full (an iterable of global batches): the share's
    samples of the inputs, and their rows of the targets (:func:`samples`' rule)."""
    n = samples(inputs, targets)
    if share.rows == 0:
        return BatchShare(None, None, n, share)
    return BatchShare(rows(inputs, share.start, share.stop) if share.inputs else None,
                      target_rows(targets, n, share.start, share.stop) if share.targets else None, n, share)


#: the ignore index of a loss that names none: Hugging Face models' own loss and ``F.cross_entropy``'s default
DEFAULT_IGNORE_INDEX = -100


def ignore_index_of(loss_fn: object) -> int | None:
    """The target value `loss_fn` does not count: its ``ignore_index`` (``nn.CrossEntropyLoss``,
    ``nn.NLLLoss``), else -100 (Hugging Face models' ``out.loss``, ``F.cross_entropy``). A loss whose
    ``ignore_index`` attribute is None opts out of token weighting (:func:`counted` then counts rows)."""
    return getattr(loss_fn, "ignore_index", DEFAULT_IGNORE_INDEX)


def integer_targets(targets: Any) -> bool:
    """Whether `targets` are a tensor of integers (class indices, token ids): what :func:`counted` counts."""
    return isinstance(targets, torch.Tensor) and not (targets.is_floating_point() or targets.is_complex()
                                                      or targets.dtype == torch.bool)


def label_shift(model: object, loss_fn: object) -> int:
    """The label positions at the start of each row that `loss_fn` does not see: 1 for a Hugging Face
    causal LM computing its own loss (its ``loss_function`` is ``ForCausalLMLoss``: ``labels[..., 1:]``
    are the targets of ``logits[..., :-1]``) when `loss_fn` names no ``ignore_index`` (``out.loss``);
    else 0 (a loss carrying ``ignore_index``, such as ``nn.CrossEntropyLoss``, counts the targets as given)."""
    if hasattr(loss_fn, "ignore_index"):
        return 0
    own = getattr(model, "loss_function", None)
    return 1 if getattr(own, "__name__", "") == "ForCausalLMLoss" else 0


def counted(targets: Any, rows: int, ignore_index: int | None, shift: int = 0) -> int:
    """The weight of a share of `rows` samples whose loss is a mean (fit's one rule for every strategy,
    micro-batch and accumulated batch): for integer targets, the number of their elements other than
    `ignore_index` -- what a token-mean loss (cross-entropy over labels padded or masked with -100)
    divides by, so weighting shares by it gives the mean over the counted elements of the whole step;
    for other targets (float, bool), or `ignore_index` None, `rows`. `shift` (:func:`label_shift`): the
    first positions of each row (of ``(B, T)`` targets) left out. Reads the count back to the host."""
    if ignore_index is None or not integer_targets(targets):
        return rows
    if shift and targets.dim() >= 2:
        targets = targets[..., shift:]
    return int((targets != ignore_index).sum())


def counted_rows(targets: Any, n: int, start: int, stop: int, ignore_index: int | None, shift: int = 0) -> int:
    """:func:`counted` of samples ``[start, stop)`` of a batch of `n` samples with `targets` (k target rows
    each, :func:`target_rows`): the weight of a block of rows (a micro-batch, a replica's eval block)."""
    return counted(target_rows(targets, n, start, stop), stop - start, ignore_index, shift)


def zero_loss(out: Any, loss: torch.Tensor) -> torch.Tensor:
    """A zero with the graph of `out` (the model's outputs) for a share that counts no target element:
    its loss is 0/0 = NaN, and back-propagating even ``0 * loss`` spreads NaN (0 * 1/0) into every
    gradient, so the share back-propagates zero through its non-scalar outputs instead; every parameter
    hook and pipeline send still runs, as for any share. `loss` times zero only when the outputs hold no
    such tensor."""
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim() > 0
              and t.requires_grad and t.is_floating_point()]
    if not leaves:
        return loss * 0
    return torch.stack([t.sum() for t in leaves]).sum() * 0


def gather_rows(comm: Communicator, out: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Collective: every rank's `out` (``sizes[rank]`` rows, the same trailing shape) concatenated in
    rank order, on every rank. Pads to the largest block for one allgather."""
    if len(set(sizes)) == 1:
        return comm.allgather(out.contiguous())
    top = max(sizes)
    padded = out.new_zeros((top, *out.shape[1:]))
    padded[:len(out)] = out
    blocks = comm.allgather(padded).reshape(len(sizes), top, *out.shape[1:])
    return torch.cat([blocks[r, :s] for r, s in enumerate(sizes)])


def _row_weighted_means(comm: Communicator, leaves: list[Any], sizes: list[int]) -> None:
    """Collective: every 0-dim floating tensor of `leaves` replaced, in place, by its mean over the ranks
    weighted by `sizes` (their rows, or their counted target elements, :func:`counted`; a rank weighing
    nothing contributes nothing, its NaN included), in its dtype, on the CPU. One allreduce for all of
    them; none if there are none (every rank's outputs have the same structure)."""
    at = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()]
    if not at:
        return
    mine = torch.stack([leaves[i].detach().cpu().double() for i in at])
    sums = mine * sizes[comm.rank] if sizes[comm.rank] else torch.zeros_like(mine)
    comm.allreduce(sums)
    for i, total in zip(at, sums.tolist()):
        leaves[i] = torch.tensor(total / max(sum(sizes), 1), dtype=leaves[i].dtype)


def gather_outputs(comm: Communicator, out: Any, sizes: list[int], weights: list[int] | None = None) -> Any:
    """Collective: :func:`gather_rows` of every tensor leaf of `out` with a dimension (a tensor, tuple,
    dict or ModelOutput, in leaf order: every rank's `out` has the same structure), in the same
    structure, on the CPU (fit compares them with its CPU targets); bf16/fp16 leaves come back as float32.
    A 0-dim floating leaf is a mean the model took over its rows (a Hugging Face model's ``out.loss``
    computed from ``labels`` among the inputs): it comes back as the mean over all rows, each rank's
    weighted by its `weights` (default: its rows; :func:`counted`), as fit weighs the training loss.
    Other leaves come back as this rank holds them."""
    def gather(t: Any) -> Any:
        if not _sliced(t):
            return t
        t = t.cpu()  # the same tensor for a CPU one
        return gather_rows(comm, as_float(t), sizes)
    leaves, spec = pytree.tree_flatten(out)
    _row_weighted_means(comm, leaves, sizes if weights is None else weights)
    return pytree.tree_unflatten([gather(t) for t in leaves], spec)
