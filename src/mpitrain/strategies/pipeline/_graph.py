"""Model generator (HyPar-Flow §5.1): capture an unmodified model as a graph, measure it, cut it.

Capture: ``torch.fx.symbolic_trace`` where it traces and records everything the forward does
(module-level graph, readable node names); otherwise (fx fails, or the forward switches gradients or
autocast inside, which fx does not record: :class:`_ModeTracer`) ``torch.export.export(..., strict=False)``
with a dynamic batch dimension, whose
``ExportedProgram.module()`` is an ATen-level graph (Hugging Face transformers, models with control
flow on shapes). Both give one ``fx.GraphModule`` whose placeholders are the *flat* model inputs
(the leaves of ``(args, kwargs)``) and whose output is the flat list of output leaves; `out_spec`
rebuilds the model's own output pytree (a tensor, a tuple, a ``ModelOutput``).

A captured model is a list of *compute nodes* in the graph's (topological) order. Partition k owns
the contiguous slice ``nodes[bounds[k]:bounds[k+1]]`` and becomes its own ``fx.GraphModule`` whose
placeholders are (1) the model inputs it reads and (2) the values it receives from earlier
partitions, and whose outputs are the values later partitions read. *Local* nodes -- parameter and
buffer reads (``get_attr``) and non-tensor values computed from the inputs alone (``x.size(0)``) --
never cross a boundary: every partition that reads one computes its own copy. A parameter read by
several partitions is therefore held by each of them (a tied weight: see :func:`tied_groups`). The
partition modules share parameter and buffer tensors with the user's model, so training a partition
trains the user's model in place.
"""

from __future__ import annotations

import copy
import inspect
import operator
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.nn import functional as F

from ..._utils.flat import group_by
from .._batching import call_args
from .._device import model_device, to_device
from ._backward import input_gradients

__all__ = ["TraceFailure", "ValueMeta", "Traced", "Partition", "capture", "trace", "export", "model_args",
           "profile", "measure", "measure_module", "check_shapes", "training_kwargs", "reference_seconds",
           "measure_loss", "measure_plain", "param_counts", "cut_points", "split", "mutated_placeholders",
           "local_nodes", "tied_groups", "set_training", "mutated_attrs", "retarget", "Clock", "work_clock"]

#: A clock read before and after a timed piece of work: seconds as a float (wall or CPU time)
Clock = Callable[[], float]


class TraceFailure(ValueError):
    """The model could not be captured as a graph; the message names what stopped it and what to do."""


@dataclass(frozen=True)
class ValueMeta:
    """What one graph value looks like for a given micro-batch: enough to allocate a receive buffer."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass
class Traced:
    """A captured model: `nodes` are the compute nodes (no placeholders/output) in execution order.

    `how` is "fx" or "export". `outputs` are the flat output leaves (nodes or constants) and `out_spec`
    their pytree structure. `in_spec` (export only) is the pytree structure of ``(args, kwargs)`` the
    graph was captured with; fx graphs take positional inputs (or a dict by argument name).
    `fixed_kwargs` are added to every batch's keyword inputs (:func:`training_kwargs`)."""

    gm: fx.GraphModule
    placeholders: list[fx.Node]
    nodes: list[fx.Node]
    output: fx.Node
    outputs: list[Any]
    out_spec: pytree.TreeSpec
    in_spec: pytree.TreeSpec | None = None
    how: str = "fx"
    fixed_kwargs: dict[str, Any] = field(default_factory=dict)
    #: the forward branches on ``self.training`` beyond the mode flags :func:`set_training` switches (fx
    #: only: :func:`_mode_branch`): the graph computes the captured mode's branch in both modes
    mode_branch: bool = False


@dataclass
class Partition:
    """One contiguous slice of the graph as a runnable module.

    `data_inputs` are indices into the model's flat inputs (read locally: every rank has the batch);
    `recv_inputs` and `outputs` are value names, in the module's argument/return order. The last
    partition returns the model's flat output leaves (a list)."""

    index: int
    module: fx.GraphModule
    data_inputs: list[int]
    recv_inputs: list[str]
    outputs: list[str]


def capture(model: nn.Module, sample: Any) -> Traced:
    """fx if it traces `model`, else torch.export on `sample` (a batch's inputs, as :func:`call_args`
    reads them) moved first to where `model`'s parameters are (CUDA, meta). Raises
    :class:`TraceFailure` naming both failures, or the custom ``torch.autograd.Function`` the forward
    applies (:func:`_applied_functions`)."""
    with _applied_functions() as applied:
        try:
            traced = trace(model)
        except TraceFailure as fx_error:
            try:
                # torch.export runs the forward on fake tensors that keep each input's device, and refuses
                # an op mixing two (a CUDA model's embedding of a loader's CPU token ids): trace where the
                # weights are, as training will run; tensors the forward creates from an input's device
                # are then baked on that device too (meta ones are retargeted by split)
                traced = export(model, to_device(sample, model_device(model)))
            except TraceFailure as e:
                raise TraceFailure(f"{e}\n(torch.fx failed first: {fx_error.__cause__!r})") from e
    if applied:
        names = ", ".join(sorted({f"{f.__module__}.{f.__qualname__}" for f in applied}))
        raise TraceFailure(f"cannot split {type(model).__name__} into partitions: its forward applies the custom "
                           f"autograd.Function {names}, whose backward a captured graph cannot keep (torch.fx and "
                           f"torch.export record the ops of its forward, and autograd would differentiate those, "
                           f"not run its backward); use strategy='data' (or 'pipe-sgd', 'spatial'), which run the "
                           f"forward as it is")
    return traced


@contextmanager
def _applied_functions() -> Iterator[list[type]]:
    """The custom ``torch.autograd.Function`` subclasses applied inside the block (a gradient reversal, a
    straight-through estimator): their own backward is lost in any captured graph, so training one
    silently computed other gradients. torch's own (reentrant checkpointing, refused with its own
    message by :func:`_refuse_no_grad_regions`) are left out."""
    applied: list[type] = []
    apply = torch.autograd.Function.__dict__["apply"]

    def recording(cls: type, *args: Any, **kwargs: Any) -> Any:
        if not cls.__module__.startswith("torch."):
            applied.append(cls)
        return apply.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(recording)  # type: ignore[method-assign,assignment]
    try:
        yield applied
    finally:
        torch.autograd.Function.apply = apply  # type: ignore[method-assign]


def _grad_and_autocast() -> tuple[bool, ...]:
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            *(torch.is_autocast_enabled(d) for d in ("cpu", "cuda")))


class _ModeTracer(fx.Tracer):
    """fx's tracer, noting a node created under another grad or autocast mode than the trace began in:
    fx runs a ``with torch.no_grad()`` / ``torch.autocast`` block of the forward while tracing but records
    no trace of it, so its graph would differentiate a frozen block or compute an autocast region in the
    outer precision (export keeps both as ``wrap_with_set_grad_enabled`` / ``wrap_with_autocast``)."""

    def __init__(self) -> None:
        super().__init__()
        self.mode = _grad_and_autocast()
        self.switched = False

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        self.switched |= _grad_and_autocast() != self.mode
        return super().create_node(*args, **kwargs)


@contextmanager
def _eager_mutations(model: nn.Module) -> Iterator[list[str]]:
    """The names of `model`'s parameters and buffers changed in place inside the block, each buffer put
    back as it was. fx proxies a tensor attribute only once an op mixes it with a traced value: ``self.count
    += 1`` or ``self.ema.mul_(0.9)`` runs on the real buffer while tracing (once), and the graph has no
    node for it (every step of the captured model would skip it). The version counter tells."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    versions = {k: t._version for k, t in tensors.items()}
    saved = {k: b.detach().clone() for k, b in model.named_buffers()}
    mutated: list[str] = []
    try:
        yield mutated
    finally:
        mutated += [k for k, t in tensors.items() if t._version != versions[k]]
        with torch.no_grad():
            for k in mutated:
                if k in saved:
                    tensors[k].copy_(saved[k])


def trace(model: nn.Module) -> Traced:
    """Symbolically trace `model` (unmodified). Raises :class:`TraceFailure` naming what stopped fx, or
    that the forward switches gradients or autocast inside (:class:`_ModeTracer`)."""
    tracer = _ModeTracer()
    try:
        with _eager_mutations(model) as mutated:
            graph = tracer.trace(model)
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        if tracer.switched:
            raise RuntimeError("the forward switches gradients or autocast inside (torch.no_grad, "
                               "torch.autocast, reentrant checkpointing), which fx does not record")
        scripted = [name for name, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)]
        if scripted:
            raise RuntimeError(f"{', '.join(scripted)} is torch.jit.script-ed: fx calls its compiled forward as an "
                               f"opaque object, whose parameters the graph does not hold")
        if mutated:
            raise RuntimeError(f"the forward changes {', '.join(mutated)} in place from no input (a step counter, "
                               f"an EMA), which fx runs once while tracing and does not record")
    except Exception as e:  # TraceError, TypeError, NotImplementedError...: depends on the construct
        raise TraceFailure(
            f"cannot split {type(model).__name__} into partitions: torch.fx could not trace it "
            f"({type(e).__name__}: {e}). Usual causes: Python control flow on tensor values "
            f"(`if x.sum() > 0`), "
            f"data-dependent shapes, or calls fx cannot see through; move them into a leaf module or use "
            f"strategy='data'.") from e
    nodes = list(gm.graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    flat, spec = pytree.tree_flatten(output.args[0])
    traced = _traced(model, gm, flat, spec, None, "fx")
    traced.mode_branch = _mode_branch(model, graph)
    return traced


def _mode_branch(model: nn.Module, graph: fx.Graph) -> bool:
    """Whether fx traces `model` with every module in the other mode to another graph than `graph`, the
    mode flags of :data:`_FX_MODE_ARGS` aside (:func:`set_training` switches those): a Python branch on
    ``self.training`` (``if self.training: x = x + noise``) that the captured graph keeps in both modes.
    The modes are set as attributes (a ``train()`` override is not run) and put back."""
    modes = {m: m.training for m in model.modules()}
    try:
        for m, training in modes.items():
            m.training = not training
        with _eager_mutations(model):
            other = fx.Tracer().trace(model)
    except Exception:  # noqa: BLE001 - the other mode does not even trace: it surely differs
        return True
    finally:
        for m, training in modes.items():
            m.training = training
    return _signature(other) != _signature(graph)


def _signature(graph: fx.Graph) -> list[str]:
    """`graph`'s nodes as text, without the mode flag of an :data:`_FX_MODE_ARGS` call."""
    out = []
    for n in graph.nodes:
        args, kwargs = list(n.args), dict(n.kwargs)
        if n.op == "call_function" and n.target in _FX_MODE_ARGS:
            i, name = _FX_MODE_ARGS[n.target]
            kwargs.pop(name, None)
            args = args[:i] + args[i + 1:]
        out.append(f"{n.op} {n.name} {n.target} {args} {kwargs}")
    return out


def export(model: nn.Module, sample: Any) -> Traced:
    """Capture `model` with ``torch.export.export(strict=False)`` on `sample`, every dimension of every
    tensor input dynamic (``Dim.AUTO``: it stays static where the model forces it, see
    :func:`check_shapes`), so one graph serves batches of other sizes, sequence lengths and image
    sizes. A forward that takes ``use_cache`` is called with ``use_cache=False`` unless the batch sets
    it (:func:`training_kwargs`)."""
    args, kwargs = call_args(sample)
    fixed = training_kwargs(model, args, kwargs)
    kwargs = {**kwargs, **fixed}
    # torch.export leaves a weak reference on every tensor it traces, and torch.utils.swap_tensors
    # (how a meta model gains storage in place) refuses such a tensor: trace a copy (free on meta) and
    # point the graph at the model's own tensors afterwards
    on_meta = any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    try:
        with _cache_off(model, args, kwargs):
            try:
                ep = _export(copy.deepcopy(model) if on_meta else model, args, kwargs, every_dim=True)
            except Exception:  # where a dynamic length fails outright, the batch dimension alone
                ep = _export(copy.deepcopy(model) if on_meta else model, args, kwargs, every_dim=False)
    except Exception as e:
        hint = ("leave use_cache out of the batch or set it False (a cache object is no tensor to send)"
                if "not a known type" in str(e) or "pytree" in str(e) else
                "make the forward traceable by torch.export or use strategy='data'")
        raise TraceFailure(f"cannot split {type(model).__name__} into partitions: torch.export could not "
                           f"capture it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                           f"{hint}") from e
    unlifted = ep.module()
    assert isinstance(unlifted, fx.GraphModule)
    graph = unlifted.graph
    if model.training:
        _refuse_no_grad_regions(model, graph)
    for n in list(graph.nodes):
        # the input-shape guard module checks what our slicing guarantees; and export asserts the dtype
        # each ``.to()`` / ``.float()`` saw while capturing (float32), where fit runs the graph under bf16 or
        # fp16 autocast and the eager forward sees the lower dtype: the casts themselves stay in the graph,
        # so without the asserts it computes what the forward computes under autocast (GPT-2's
        # ``logits.float()`` before its loss, Llama's RMSNorm in float32)
        if (n.op == "call_module" and n.target == "_guards_fn") or \
                (n.op == "call_function" and n.target is torch.ops.aten._assert_tensor_metadata.default):
            graph.erase_node(n)
    graph.eliminate_dead_code()
    # A plain GraphModule over the same graph and tensors: flat inputs and outputs (no pytree codegen),
    # and train()/eval() allowed (the ATen graph itself keeps the mode it was captured in).
    graph._codegen = fx.graph.CodeGen()
    gm = fx.GraphModule(unlifted, graph)
    if on_meta:
        _rebind(gm, model)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    traced = _traced(model, gm, list(output.args[0]), ep.call_spec.out_spec, ep.call_spec.in_spec, "export")
    traced.fixed_kwargs = fixed
    return traced


def _refuse_no_grad_regions(model: nn.Module, graph: fx.Graph) -> None:
    """TraceFailure if the training forward turned gradients off inside the captured graph
    (``wrap_with_set_grad_enabled(False, ...)``). Reentrant activation checkpointing
    (``torch.utils.checkpoint(..., use_reentrant=True)``, transformers'
    ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})``) runs its
    function under ``no_grad`` inside an autograd.Function that torch.export does not keep: the graph would
    train nothing inside those regions (the last partition's loss then has no grad_fn). Only such regions:
    where the model turned checkpointing on (a module's ``gradient_checkpointing``, as transformers marks
    it) or whose nodes were traced through ``torch.utils.checkpoint`` (their stack trace); a ``no_grad``
    block the forward means (a frozen teacher's pass) is captured alike and must stay allowed."""
    marked = any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
    for n in graph.nodes:
        if n.op == "call_function" and getattr(n.target, "__name__", None) == "wrap_with_set_grad_enabled" \
                and n.args and n.args[0] is False and (marked or _through_checkpoint(n)):
            raise TraceFailure(
                f"cannot split {type(model).__name__} into partitions: its training forward turns gradients "
                f"off inside the graph (reentrant activation checkpointing, use_reentrant=True, does this), so "
                f"the captured graph would not train those layers; use use_reentrant=False (transformers' "
                f"default: gradient_checkpointing_enable() without kwargs) or the pipeline's own recomputation "
                f"(fit's checkpoint='always')")


def _through_checkpoint(region: fx.Node) -> bool:
    """Whether a graph region's outputs were computed inside ``torch.utils.checkpoint`` (the file in the
    stack trace export records on each node)."""
    import torch.utils.checkpoint as ckpt

    return any(ckpt.__file__ in str(u.meta.get("stack_trace") or "") for u in region.users)


def _export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], every_dim: bool) -> Any:
    """``torch.export.export`` with every dimension (or only the batch dimension) of every tensor input
    dynamic; ``Dim.AUTO`` lets the model keep a dimension static where its code needs it."""
    from torch.export import Dim

    def dims(t: Any) -> dict[int, Any] | None:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return None
        return {d: Dim.AUTO for d in range(t.dim() if every_dim else 1)}

    try:  # torch.export wants the specs keyed by the forward's parameter names
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
        dynamic: dict[str, Any] | None = {k: pytree.tree_map(dims, v) for k, v in bound.items()}
    except (TypeError, ValueError):
        dynamic = None  # no signature to bind: shapes as in the sample
    return torch.export.export(model, args, kwargs, strict=False, dynamic_shapes=dynamic)


def training_kwargs(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments the pipeline adds to every call of `model`: ``use_cache=False`` when its
    forward takes ``use_cache`` and the batch does not give it. A Hugging Face model's config defaults
    to ``use_cache=True``, which makes its forward return a key/value cache object: of no use in
    training (nobody generates from a training step), no tensor to send between partitions, and more
    memory; so the pipeline trains as a user who never asked for a cache expects."""
    try:
        signature = inspect.signature(model.forward)
        given = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in signature.parameters and "use_cache" not in given else {}


@contextmanager
def _cache_off(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """While capturing: ``model.config.use_cache`` False when the forward has no ``use_cache`` of its own but
    passes ``**kwargs`` on to a model that has (peft's ``PeftModel``, whose ``config`` is the wrapped model's).
    :func:`training_kwargs` cannot pass ``use_cache=False`` through such a forward: torch.export (2.13) then
    mismatches the dynamic shapes of a forward's ``**kwargs`` with its own inputs. The flag is read in Python
    while tracing, so the captured graph has no cache output and the config is restored at once; a batch
    that sets ``use_cache`` itself is left as it is."""
    config = getattr(model, "config", None)
    try:
        signature = inspect.signature(model.forward)
        given = signature.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        given, signature = {}, None
    passes_on = signature is not None and "use_cache" not in signature.parameters and any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    if not (passes_on and getattr(config, "use_cache", None) and "use_cache" not in {**given, **kwargs}):
        yield
        return
    before, config.use_cache = config.use_cache, False  # type: ignore[union-attr]
    try:
        yield
    finally:
        config.use_cache = before  # type: ignore[union-attr]


def check_shapes(traced: Traced, inputs: Sequence[Any]) -> None:
    """Refuse (ValueError naming the input, the dimension and both lengths) flat `inputs` whose shape
    differs from the captured one in a dimension that torch.export kept static because the model's
    code depends on its length (a dynamic dimension may take any length)."""
    for ph, a in zip(traced.placeholders, inputs):
        val = ph.meta.get("val")
        if not isinstance(val, torch.Tensor) or not isinstance(a, torch.Tensor):
            continue
        if a.dim() != val.dim():
            raise ValueError(f"input {ph.name!r} has {a.dim()} dimensions; the model was captured with "
                             f"{val.dim()} ({tuple(val.shape)})")
        for d, (size, got) in enumerate(zip(val.shape, a.shape)):
            want = size if isinstance(size, int) else size.node.maybe_as_int()  # a SymInt that export fixed
            if want is not None and d > 0 and want != got:
                raise ValueError(
                    f"input {ph.name!r} has length {got} in dimension {d}, but torch.export specialised "
                    f"the captured model to {want} there (its code depends on that length, so one graph "
                    f"cannot serve both); give every batch length {want} in dimension {d} (pad), or train "
                    f"with strategy='data'")


def _rebind(gm: fx.GraphModule, model: nn.Module) -> None:
    """Make every parameter and buffer of `gm` the tensor of the same qualified name in `model` (the
    graph was exported from a copy of `model`; an alias of a tied tensor is rebound under each name).
    A tensor the graph holds and the model does not (a constant the forward creates) stays the
    copy's; on meta it could never run, which raises :class:`TraceFailure` naming it."""
    tensors = {**dict(model.named_parameters(remove_duplicate=False)),
               **dict(model.named_buffers(remove_duplicate=False))}
    for name, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]:
        if name not in tensors:
            if t.is_meta:
                raise TraceFailure(f"cannot split {type(model).__name__} into partitions: its exported graph "
                                   f"holds a meta tensor {name!r} that is no parameter or buffer of the model "
                                   f"(a constant created in the forward); register it as a buffer, or build "
                                   f"the model on the CPU")
            continue
        holder, _, attr = name.rpartition(".")
        mod = gm.get_submodule(holder)
        slots: dict[str, Any] = mod._parameters if attr in mod._parameters else mod._buffers
        slots[attr] = tensors[name]


def _traced(model: nn.Module, gm: fx.GraphModule, outputs: list[Any], out_spec: pytree.TreeSpec,
            in_spec: pytree.TreeSpec | None, how: str) -> Traced:
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    compute = [n for n in nodes if n.op not in ("placeholder", "output")]
    if not compute:
        raise TraceFailure(f"{type(model).__name__} traced to an empty graph: nothing to partition")
    return Traced(gm, placeholders, compute, output, outputs, out_spec, in_spec, how)


def local_nodes(traced: Traced, meta: dict[str, ValueMeta | None]) -> set[str]:
    """Nodes every partition computes for itself instead of receiving them: parameter/buffer reads,
    non-tensor values (shapes) computed by functions of the model inputs and local nodes only, and
    *input constants*: tensors without gradient that pure ATen ops compute from the model inputs,
    buffers and other input constants (no parameter) -- the attention masks, position ids and rotary
    tables of a transformer. An input constant is recomputed by each partition that reads it (from the
    inputs it reads: a later partition receives those, e.g. an integer attention mask, instead of the
    mask itself), which measured faster than sending it (docs/pipeline.md) and lets a boolean mask
    stay where it is used. Not local: random ops (each partition would draw its own numbers), ops that
    mutate, tensors that a later op mutates in place, and uninitialised memory (``empty``)."""
    ph = {n.name for n in traced.placeholders}
    local: set[str] = set()
    constant: set[str] = set(ph)  # values that depend on no parameter: inputs, buffers, input constants
    for n in traced.nodes:
        m = meta.get(n.name)
        reads_local = all(a.name in ph or a.name in local for a in n.all_input_nodes)
        if n.op == "get_attr":
            local.add(n.name)
            if not isinstance(_get_attr(traced.gm, str(n.target)), nn.Parameter):
                constant.add(n.name)
        elif n.op in ("call_function", "call_method") and m is None and reads_local:
            local.add(n.name)
            constant.add(n.name)  # a shape: it depends on no parameter's value
        elif (m is not None and not m.requires_grad and _pure(n) and not _mutated(n)
              and all(a.name in constant for a in n.all_input_nodes)):
            local.add(n.name)
            constant.add(n.name)
    return local


def _pure(n: fx.Node) -> bool:
    """An ATen op (an exported graph's) whose result is a function of its arguments alone: no
    mutation, no random numbers, no uninitialised memory; or ``getitem`` of such a result."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return True
    if not isinstance(n.target, torch._ops.OpOverload):
        return False  # a Python function of an fx graph: purity unknown, its result is sent
    op = n.target
    return (not op._schema.is_mutable and torch.Tag.nondeterministic_seeded not in op.tags
            and "empty" not in op._schema.name)


def _mutated(n: fx.Node) -> bool:
    """Some user of `n` writes into it in place (its copy in another partition would not see that)."""
    for u in n.users:
        if u.op == "call_function" and isinstance(u.target, torch._ops.OpOverload):
            for a, arg in zip(u.args, u.target._schema.arguments):
                if a is n and arg.alias_info is not None and arg.alias_info.is_write:
                    return True
        elif u.op == "call_method" and str(u.target).endswith("_") and u.args and u.args[0] is n:
            return True
    return False


def model_args(traced: Traced, inputs: Any) -> list[Any]:
    """The value of every placeholder for a batch's `inputs` (see :func:`call_args`): fx graphs take
    positional inputs (or keywords by argument name) and the forward's defaults; exported graphs take
    the leaves of ``(args, kwargs)`` in the structure they were captured with."""
    args, kwargs = call_args(inputs)
    kwargs = {**kwargs, **{k: v for k, v in traced.fixed_kwargs.items() if k not in kwargs}}
    if traced.in_spec is not None:
        want = traced.in_spec.child(1).context if traced.in_spec.num_children == 2 else []
        if kwargs and set(kwargs) == set(want):
            kwargs = {k: kwargs[k] for k in want}  # the captured key order
        flat, spec = pytree.tree_flatten((args, kwargs))
        if spec != traced.in_spec:
            raise ValueError(f"the batch's inputs have structure {spec} but the model was captured with "
                             f"{traced.in_spec}; give every batch the same inputs (tensor, tuple or dict)")
        return flat
    names = [str(ph.target) for ph in traced.placeholders]
    unknown = set(kwargs) - set(names)
    if unknown:
        raise ValueError(f"the data gives keyword input(s) {sorted(unknown)} that the model's forward does "
                         f"not take; it takes {names}")
    out = list(args)
    for ph in traced.placeholders[len(out):]:
        if str(ph.target) in kwargs:
            out.append(kwargs[str(ph.target)])
        elif ph.args:
            out.append(ph.args[0])
        else:
            raise ValueError(f"the model's forward takes argument {ph.target!r} but the data gives only "
                             f"{len(args) + len(kwargs)} input(s); yield (inputs, targets) batches whose "
                             f"inputs are a tuple or a dict of the forward's arguments")
    if len(args) > len(traced.placeholders):
        raise ValueError(f"the data gives {len(args)} inputs but the model's forward takes "
                         f"{len(traced.placeholders)}")
    return out


class _Recorder(fx.Interpreter):
    """Runs the graph node by node, recording each node's output meta, forward seconds and (with
    `stamp`) a hook on each differentiable output that notes when backward reaches it."""

    def __init__(self, gm: fx.GraphModule, stamp: bool = False, clock: Clock = time.perf_counter) -> None:
        super().__init__(gm)
        self.meta: dict[str, ValueMeta | None] = {}
        self.seconds: dict[str, float] = {}
        self.stamps: list[tuple[float, str]] = []
        self._stamp, self._clock = stamp, clock

    def run_node(self, n: fx.Node) -> Any:
        t0 = self._clock()
        out = super().run_node(n)
        self.seconds[n.name] = self._clock() - t0
        is_tensor = isinstance(out, torch.Tensor)
        self.meta[n.name] = ValueMeta(tuple(out.shape), out.dtype, out.requires_grad) if is_tensor else None
        if self._stamp and is_tensor and out.requires_grad:
            out.register_hook(lambda g, name=n.name: self.stamps.append((self._clock(), name)))
        return out


def profile(traced: Traced, inputs: Sequence[Any], grad: bool = True,
            fake: bool = False) -> dict[str, ValueMeta | None]:
    """`inputs`: the flat placeholder values (:func:`model_args`).

    Per-value meta (None: not a tensor) of one forward on `inputs` in eval mode, so BatchNorm
    statistics and the RNG are not touched; with `grad` the metas tell which values carry gradients.
    With `fake` the forward runs on fake tensors (``FakeTensorMode``: shapes and dtypes propagated,
    nothing computed or allocated, the model's tensors read as fakes of themselves), so the metas of
    another input shape cost no forward of the model."""
    with _undisturbed(traced.gm, train=False), torch.set_grad_enabled(grad):
        rec = _Recorder(traced.gm)
        if fake:
            from torch._subclasses.fake_tensor import FakeTensorMode

            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                rec.run(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in inputs])
        else:
            rec.run(*inputs)
    return rec.meta


def measure(traced: Traced, inputs: Sequence[Any], passes: int = 3) -> list[float]:
    """Seconds of forward plus backward per compute node of the whole graph on `inputs` (the flat
    placeholder values), for balancing partitions by time; see :func:`measure_module`."""
    times = measure_module(traced.gm, inputs, passes)
    return [times.get(n.name, 0.0) for n in traced.nodes]


def measure_module(gm: fx.GraphModule, inputs: Sequence[Any], passes: int = 3,
                   clock: Clock = time.perf_counter) -> dict[str, float]:
    """Seconds of forward plus backward per node of `gm` by node name (the fastest of `passes`
    training-mode passes on `inputs`, its placeholder values). A partition module's nodes keep the
    names of the captured graph's, so a partition can be measured alone. The module's buffers,
    gradients and RNG state are restored afterwards, so measuring changes nothing a step would see. A
    module that cannot run a training pass on `inputs` (BatchNorm1d on one sample) is measured by
    eval-mode forwards instead.

    A node's backward time runs from backward reaching its output until it reaches the next value
    (hooks on every differentiable output; backward starts from every differentiable output leaf): exact
    on a chain, an apportioning on branches; balancing only uses sums over the contiguous node ranges
    that partitions are. `clock`: what a second is (:func:`work_clock`; default wall time)."""
    try:
        fwd, bwd = _timed_passes(gm, inputs, passes, train=True, clock=clock)
    except RuntimeError:
        fwd, bwd = _timed_passes(gm, inputs, passes, train=False, clock=clock)
    return {name: t + bwd.get(name, 0.0) for name, t in fwd.items()}


def measure_loss(gm: fx.GraphModule, inputs: Sequence[Any], loss: Callable[[list[Any]], torch.Tensor],
                 passes: int = 3, clock: Clock = time.perf_counter) -> float:
    """Seconds of `loss` (a function of `gm`'s flat outputs: the user's loss on the model's outputs and
    targets) forward plus backward down to those outputs, the fastest of `passes`: the work the
    partition that holds the model's output does per micro-batch besides its nodes. `gm` runs once, in
    training mode, without gradients; its buffers, gradients and RNG state are restored afterwards.
    `clock`: as :func:`measure_module`'s."""
    with _undisturbed(gm, train=True), torch.no_grad():
        out = gm(*inputs)
    leaves = [t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
              for t in pytree.tree_leaves(out)]
    best = float("inf")
    with torch.random.fork_rng(devices=[]):
        for _ in range(max(passes, 1)):
            t0 = clock()
            value = loss(leaves)
            if value.requires_grad:
                value.backward()
            _finish([value])
            best = min(best, clock() - t0)
            for t in leaves:
                if isinstance(t, torch.Tensor):
                    t.grad = None
    return best


def measure_plain(gm: fx.GraphModule, inputs: Sequence[Any], passes: int = 3, split: bool = False,
                  clock: Clock = time.perf_counter) -> float:
    """Seconds of `gm`'s forward plus backward run as a step runs it (compiled, no per-node timing:
    what :func:`measure_module`'s per-node times add up to, less their instrumentation), the fastest of
    `passes` on `inputs`. `split`: the backward as the zero-bubble schedules run it, input half then
    weight half (:mod:`._backward`; a partition without differentiable inputs has no input half: its
    weight half is the plain backward). `gm`'s buffers, gradients and RNG state are restored afterwards.
    `clock`: as :func:`measure_module`'s."""
    diff = [isinstance(a, torch.Tensor) and a.requires_grad for a in inputs]
    best = float("inf")
    with _undisturbed(gm, train=True):
        _scratch_grads(gm)
        params = [q for q in gm.parameters() if q.requires_grad]
        for _ in range(max(passes, 1)):
            leaves = [a.detach().requires_grad_() if d else a for a, d in zip(inputs, diff)]
            t0 = clock()
            out = gm(*[t.clone() if d else t for t, d in zip(leaves, diff)])  # as received: in-place ops allowed
            roots = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            seeds = [torch.ones_like(t) for t in roots]
            if split:
                input_gradients(roots, seeds, [t for t, d in zip(leaves, diff) if d], params).run()
            elif roots:
                torch.autograd.backward(roots, seeds)
            _finish([*roots, *leaves])
            best = min(best, clock() - t0)
    return best


def _finish(tensors: Sequence[Any]) -> None:
    """Wait for the kernels queued on the CUDA device of `tensors` (if any): a timing ends when the
    work does, not when it is queued."""
    dev = next((t.device for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cuda"), None)
    if dev is not None:
        torch.cuda.synchronize(dev)


def work_clock(device: torch.device) -> Clock:
    """The clock that times a partition's work for balancing on `device`. On the CPU with one intra-op
    thread (the launcher's default, ``--threads 1``) the calling thread's CPU time
    (``time.thread_time``): time a rank spends waiting for a core while other processes run is not
    taken for work (on the shared 2-core VM, wall-time cuts of the benchmark's GPT-2 moved from node
    231 to 234-272 under load while CPU-time cuts stayed at 231-232, docs/pipeline.md). Otherwise wall
    time (``time.perf_counter``): an accelerator's kernels are not this process's CPU time (each timing
    ends with the device's queue), and with several intra-op threads one thread's CPU time misses the
    others' work while the process's counts their spin-waits between parallel regions."""
    if device.type == "cpu" and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def reference_seconds(passes: int = 5, clock: Clock = time.perf_counter) -> float:
    """Seconds of a fixed small workload (matrix products driven from Python, like a graph's nodes;
    the fastest of `passes`): this process's speed at this moment. Per-node times measured by
    different ranks at different moments are divided by it before they are compared, so a rank slowed
    by a neighbour during its measurement does not look like costlier nodes. `clock`: the one that timed
    those nodes."""
    a = torch.ones(64, 64)
    best = float("inf")
    for _ in range(max(passes, 1)):
        t0 = clock()
        for _ in range(20):
            a = torch.mm(a, a).clamp_(-1.0, 1.0)
        best = min(best, clock() - t0)
    return best


def _timed_passes(gm: fx.GraphModule, inputs: Sequence[Any], passes: int,
                  train: bool, clock: Clock = time.perf_counter) -> tuple[dict[str, float], dict[str, float]]:
    """Fastest forward and (when `train`) backward seconds per node over `passes` passes."""
    fwd: dict[str, float] = {}
    bwd: dict[str, float] = {}
    with _undisturbed(gm, train=train), torch.set_grad_enabled(train):
        if train:
            _scratch_grads(gm)
        for _ in range(max(passes, 1)):
            rec = _Recorder(gm, stamp=train, clock=clock)
            out = rec.run(*inputs)
            fwd = {k: min(v, fwd.get(k, v)) for k, v in rec.seconds.items()}
            roots = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if roots:
                torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
                events = [*sorted(rec.stamps), (clock(), "")]
                spent: dict[str, float] = {}
                for (t, name), (t_next, _) in zip(events, events[1:]):
                    spent[name] = spent.get(name, 0.0) + t_next - t
                bwd = {k: min(v, bwd.get(k, v)) for k, v in spent.items()}
    return fwd, bwd


def _scratch_grads(gm: nn.Module) -> None:
    """Give every trainable parameter of `gm` a ``.grad`` that is a view of one zeroed scratch buffer
    per dtype and device, as long as its largest parameter, shared by all of them: the timing passes
    run the training's kernels (autograd adds each weight gradient into ``.grad`` in place) while the
    sums they leave are meaningless and dropped (:func:`_undisturbed` puts the old gradients back).
    Why: real gradients would be a partition's worth of memory, freed after the timing; in the heap
    (glibc keeps freed memory there, the launcher's MALLOC_* settings) they leave holes that the
    small allocations made meanwhile split, which the training's own gradients then cannot reuse."""
    params = list({id(p): p for p in gm.parameters() if p.requires_grad}.values())
    for (dtype, device), group in group_by(params, lambda p: (p.dtype, p.device)).items():
        scratch = torch.zeros(max(p.numel() for p in group), dtype=dtype, device=device)
        for p in group:
            p.grad = scratch[:p.numel()].view(p.shape)


@contextmanager
def _undisturbed(gm: nn.Module, train: bool) -> Iterator[None]:
    """Run `gm` in train/eval mode (its graph's mode flags too: :func:`set_training`) and put back its
    modes, buffers, parameter gradients and RNG state."""
    modes = {m: m.training for m in gm.modules()}
    buffers = [(b, b.detach().clone()) for b in gm.buffers()]
    grads = [(p, p.grad) for p in gm.parameters()]
    for p, _ in grads:
        p.grad = None  # backward would accumulate into the saved tensors in place
    gm.train(train)
    if isinstance(gm, fx.GraphModule):
        set_training(gm, train)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        for m, training in modes.items():
            m.train(training)
        if isinstance(gm, fx.GraphModule):
            set_training(gm, modes[gm])
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g


def param_counts(traced: Traced) -> list[float]:
    """Parameter elements per compute node: a call_module's parameters, and each get_attr tensor counted
    at its first reader (exported graphs read every weight at the top)."""
    index = {n.name: i for i, n in enumerate(traced.nodes)}
    out = [0.0] * len(traced.nodes)
    for i, n in enumerate(traced.nodes):
        if n.op == "call_module":
            out[i] += float(sum(p.numel() for p in traced.gm.get_submodule(str(n.target)).parameters()))
        elif n.op == "get_attr":
            attr = _get_attr(traced.gm, str(n.target))
            users = [index[u.name] for u in n.users if u.name in index]
            out[min(users, default=i)] += float(attr.numel()) if isinstance(attr, torch.Tensor) else 0.0
    return out


def _get_attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _last_use(traced: Traced, local: set[str]) -> dict[str, int]:
    """For each non-local value: index of the last compute node reading it, directly or through local
    nodes (len(nodes) when the output reads it)."""
    index = {n.name: i for i, n in enumerate(traced.nodes)}
    last: dict[str, int] = {}
    for n in reversed([*traced.nodes, traced.output]):
        at = last.get(n.name, -1) if n.name in local else index.get(n.name, len(traced.nodes))
        for a in n.all_input_nodes:
            last[a.name] = max(last.get(a.name, -1), at)
    return {k: v for k, v in last.items() if k not in local}


def cut_points(traced: Traced, meta: dict[str, ValueMeta | None]) -> list[int]:
    """Positions c (1 <= c < len(nodes)) where the graph may be cut: every non-local value defined
    before c and read at or after c is a tensor (a shape such as ``h.size(0)`` of an activation never
    crosses a boundary) whose shape follows from the inputs' shapes alone (not the rows that
    ``x[x > 0]`` selects: a receive buffer is sized from the shapes), and not between two reads of a
    parameter or buffer the graph writes in place (:func:`_written_spans`)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    local = local_nodes(traced, meta)
    last = _last_use(traced, local)
    sized = {n.name for n in traced.nodes
             if not (isinstance(n.meta.get("val"), torch.Tensor) and free_unbacked_symbols(n.meta["val"]))}
    spans = _written_spans(traced)
    live: set[str] = set()
    out = []
    for c, n in enumerate(traced.nodes[:-1], start=1):
        if n.name not in local:
            live.add(n.name)
        live = {v for v in live if last.get(v, -1) >= c}
        if all(meta.get(v) is not None and v in sized for v in live) and not any(a < c <= b for a, b in spans):
            out.append(c)
    return out


def _written_spans(traced: Traced) -> list[tuple[int, int]]:
    """For each parameter or buffer the graph writes in place (a step counter, an EMA), the positions
    of the first and last node reading it or a value read back from a write (``ema.mul_(0.9)``, whose
    result ``.add_(...)`` writes again). A cut inside would leave a partition reading its own copy that
    another partition's writes never reach, or writing into a copy it received (the EMA never moved)."""
    written = _written_attrs(traced)
    index = {n.name: i for i, n in enumerate(traced.nodes)}
    spans = []
    for n in traced.nodes:
        if n.op == "get_attr" and _mutated(n):
            group, stack = {n.name}, [n]
            while stack:  # the buffer and the writes' results that alias it
                for u in stack.pop().users:
                    if u.name in written and u.name not in group:
                        group.add(u.name)
                        stack.append(u)
            at = [index[u.name] for v in traced.nodes if v.name in group for u in v.users if u.name in index]
            if at:
                spans.append((min(at), max(at)))
    return spans


def _written_attrs(traced: Traced) -> set[str]:
    """Values that are a parameter or buffer the graph writes in place, read back from a write."""
    written: set[str] = set()
    for n in traced.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            targets = [a for a, arg in zip(n.args, n.target._schema.arguments)
                       if arg.alias_info is not None and arg.alias_info.is_write]
        elif n.op == "call_method" and str(n.target).endswith("_") and n.args:
            targets = [n.args[0]]
        else:
            continue
        if any(isinstance(a, fx.Node) and (a.op == "get_attr" or a.name in written) for a in targets):
            written.add(n.name)
    return written


def split(traced: Traced, bounds: Sequence[int], meta: dict[str, ValueMeta | None],
          device: torch.device | None = None) -> list[Partition]:
    """Cut the graph at `bounds` (``[0, c1, ..., len(nodes)]``) into runnable partition modules; each
    gets copies of the local nodes (parameter reads, input shapes) it needs. `device` (a meta model's:
    where it is materialised): the partitions create on it the tensors the captured graph creates on
    meta (:func:`retarget`); `traced` itself is left as it is."""
    local = local_nodes(traced, meta)
    index = {n.name: i for i, n in enumerate(traced.nodes)}
    ph_index = {n.name: i for i, n in enumerate(traced.placeholders)}
    last = _last_use(traced, local)
    parts = []
    for k in range(len(bounds) - 1):
        lo, hi = bounds[k], bounds[k + 1]
        final = k == len(bounds) - 2
        mine = [n for n in traced.nodes[lo:hi] if n.name not in local] + ([traced.output] if final else [])
        needed: set[str] = set()
        stack = [a for n in mine for a in n.all_input_nodes]
        while stack:  # the local nodes this partition reads, directly or through other local nodes
            a = stack.pop()
            if a.name in local and a.name not in needed:
                needed.add(a.name)
                stack.extend(a.all_input_nodes)
        own = sorted([n for n in traced.nodes if n.name in needed] + mine[:len(mine) - final],
                     key=lambda n: index[n.name]) + mine[len(mine) - final:]
        reads: dict[str, fx.Node] = {}
        for n in own:
            for a in n.all_input_nodes:
                if a.name in ph_index or (a.name not in local and index[a.name] < lo):
                    reads.setdefault(a.name, a)
        data = sorted((v for v in reads if v in ph_index), key=ph_index.__getitem__)
        recv = sorted((v for v in reads if v not in ph_index), key=index.__getitem__)
        outs = [] if final else [n.name for n in traced.nodes[lo:hi]
                                 if n.name not in local and last.get(n.name, -1) >= hi]
        module = _build(traced, own, [*data, *recv], outs, final)
        if device is not None:
            retarget(module, device)
        parts.append(Partition(k, module, [ph_index[v] for v in data], recv, outs))
    return parts


_META = torch.device("meta")


def retarget(gm: fx.GraphModule, device: torch.device) -> None:
    """Make the nodes of `gm` that name the meta device in their arguments (``arange(..., device=meta)``,
    ``x.to(device=meta)``, ``full``, ``zeros``... and the device checks torch.export inserts) name
    `device` instead, in place.

    A graph exported from a model on the meta device bakes ``device=meta`` into every tensor the
    forward creates (position ids, causal masks): right for the meta profile, wrong once the partition
    holds real tensors. A graph captured on a real device names no meta device and is left as it is.
    A nested graph (the body of a higher-order op such as ``wrap_with_autocast``, read by a get_attr)
    is shared with the graph `gm` was split from: it is replaced by a retargeted copy."""
    changed = False
    for n in gm.graph.nodes:
        sub = _get_attr(gm, str(n.target)) if n.op == "get_attr" else None
        if isinstance(sub, fx.GraphModule):
            own = fx.GraphModule(sub, copy.deepcopy(sub.graph))
            retarget(own, device)
            holder, _, attr = str(n.target).rpartition(".")
            setattr(gm.get_submodule(holder), attr, own)
            changed = True

    def swap(a: Any) -> Any:
        return device if isinstance(a, torch.device) and a == _META else a

    for n in gm.graph.nodes:
        if any(isinstance(a, torch.device) and a == _META for a in pytree.tree_leaves((n.args, n.kwargs))):
            n.args, n.kwargs = fx.node.map_aggregate(n.args, swap), fx.node.map_aggregate(n.kwargs, swap)
            changed = True
    if changed:
        gm.recompile()


def _build(traced: Traced, own: list[fx.Node], inputs: list[str], outputs: list[str],
           last: bool) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_name = {n.name: n for n in [*traced.placeholders, *traced.nodes]}
    for name in inputs:
        env[by_name[name]] = g.placeholder(name)
    for n in own:
        if n.op != "output":
            env[n] = g.node_copy(n, lambda a: env[a])
    if last:  # the flat output leaves; Traced.out_spec rebuilds the model's output structure
        g.output([env[v] if isinstance(v, fx.Node) else v for v in traced.outputs])
    else:
        g.output(tuple(env[by_name[v]] for v in outputs))
    return fx.GraphModule(traced.gm, g)


#: ATen ops of an exported graph whose behaviour depends on the mode, and the index of their `train` flag
_MODE_ARGS = {"aten::dropout": 2, "aten::feature_dropout": 2, "aten::alpha_dropout": 2,
              "aten::feature_alpha_dropout": 2, "aten::batch_norm": 5}
#: ATen ops given a dropout probability that the model's Python chose by its mode while it was captured
#: (transformers' attention: ``dropout_p=self.attention_dropout if self.training else 0.0``): the index and
#: name of that argument; 0 in eval mode, the captured value in training mode
_DROPOUT_P_ARGS = {"aten::scaled_dot_product_attention": (4, "dropout_p")}
#: Python-level calls an fx graph records with the mode flag the forward passed while it was traced
#: (``F.dropout(x, p, self.training)`` becomes ``training=True`` for good): the index and name of that flag
_FX_MODE_ARGS: dict[Any, tuple[int, str]] = {
    **{f: (2, "training") for f in (F.dropout, F.alpha_dropout, F.feature_alpha_dropout, F.dropout1d,
                                     F.dropout2d, F.dropout3d)},
    **{f: (2, "train") for f in (torch.dropout, torch.alpha_dropout, torch.feature_dropout,
                                  torch.feature_alpha_dropout)},
    F.batch_norm: (5, "training"), torch.batch_norm: (5, "training"), F.rrelu: (3, "training"),
}


def set_training(gm: fx.GraphModule, train: bool) -> None:
    """Switch the mode flag of the dropout and batch-norm ops of an exported (ATen) graph, which
    ``module.train()``/``eval()`` cannot reach (export bakes the mode into the op's arguments), the
    attention's dropout probability (:data:`_DROPOUT_P_ARGS`, kept in the node's meta to be put back),
    and the training flag of an fx graph's functional dropout / batch-norm calls (:data:`_FX_MODE_ARGS`:
    False in eval mode, the captured value in training mode). Other Python branches on ``self.training``
    stay as they were when the model was captured."""
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in _FX_MODE_ARGS:
            changed |= _set_mode_arg(n, *_FX_MODE_ARGS[n.target], train)
        elif n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            i = _MODE_ARGS.get(n.target._schema.name)
            if i is not None and len(n.args) > i and n.args[i] is not train:
                n.update_arg(i, train)
                changed = True
            changed |= _set_dropout_p(n, train)
    if changed:
        gm.recompile()


def _set_mode_arg(n: fx.Node, i: int, name: str, train: bool) -> bool:
    """Set the mode flag of an fx graph's functional call (argument `i` or keyword `name`, its default
    when absent: True, as ``F.dropout``'s) to its captured value in training mode and to False in eval
    mode; whether it changed."""
    return _set_captured_arg(n, i, name, True, "mpitrain_train_flag", train, False)


def _set_dropout_p(n: fx.Node, train: bool) -> bool:
    """Set `n`'s dropout probability (:data:`_DROPOUT_P_ARGS`) for the mode; whether it changed."""
    where = _DROPOUT_P_ARGS.get(n.target._schema.name)  # type: ignore[union-attr]
    return where is not None and _set_captured_arg(n, *where, 0.0, "mpitrain_train_dropout_p", train, 0.0)


def _set_captured_arg(n: fx.Node, i: int, name: str, default: bool | float, key: str, train: bool,
                      eval_value: bool | float) -> bool:
    """Set `n`'s argument `i` or keyword `name` (`default` when absent) to the value it was captured with
    (kept in ``n.meta[key]``) in training mode and to `eval_value` in eval mode; whether it changed. A
    value computed by the graph (a node) is left alone."""
    by_position = len(n.args) > i
    now = n.args[i] if by_position else n.kwargs.get(name, default)
    if isinstance(now, fx.Node):
        return False
    captured = n.meta.setdefault(key, now)
    want: Any = captured if train else eval_value  # the captured one: a bool or a float
    if now == want:
        return False
    if by_position:
        n.update_arg(i, want)
    else:
        n.update_kwarg(name, want)
    return True


def tied_groups(parts: list[Partition]) -> list[tuple[tuple[int, ...], list[nn.Parameter]]]:
    """Parameters held by more than one partition, grouped by the partitions holding them: a list of
    (partition indices, parameters in the first holder's order), in one order every rank computes."""
    holders: dict[int, list[int]] = {}
    first: dict[int, nn.Parameter] = {}
    for p in parts:
        for q in p.module.parameters():
            holders.setdefault(id(q), []).append(p.index)
            first.setdefault(id(q), q)
    groups: dict[tuple[int, ...], list[nn.Parameter]] = {}
    for key, ks in holders.items():
        if len(ks) > 1:
            groups.setdefault(tuple(ks), []).append(first[key])
    return sorted(groups.items())


def mutated_attrs(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The parameters and buffers `gm`'s graph writes in place (a step counter, an EMA, BatchNorm's
    statistics): the partition holding such a write holds their current value, every other partition
    reading them a copy it never updates."""
    return [_get_attr(gm, str(n.target)) for n in gm.graph.nodes if n.op == "get_attr" and _mutated(n)]


def mutated_placeholders(gm: fx.GraphModule) -> set[str]:
    """Placeholders that some node modifies in place (``relu(inplace=True)``, ``x += y``, ``x.add_``),
    directly or through a value that may share its memory (:func:`_alias`: an ``Identity``, a view).

    A received activation is a leaf of the partition's autograd graph, which torch forbids mutating (a
    view of it too); these inputs are cloned first so the partition runs the same in-place code as the
    whole model (timm's MobileNetV3: ``bn1.drop``, an Identity, then ``bn1.act``, an in-place Hardswish)."""
    out = set()
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        seen, todo = {n}, [n]
        while todo and n.name not in out:
            v = todo.pop()
            for u in v.users:
                if u.args and u.args[0] is v and _in_place(gm, u):
                    out.add(n.name)
                elif u not in seen and _alias(gm, u, v):
                    seen.add(u)
                    todo.append(u)
    return out


#: Methods and functions whose result may share its first argument's memory (a view, or the tensor itself).
_VIEWS = {"view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "transpose", "permute", "squeeze",
          "unsqueeze", "expand", "expand_as", "narrow", "t", "contiguous", "detach", "as_strided", "split",
          "chunk", "unbind", "movedim", "swapaxes", "select", "diagonal", "getitem", "__getitem__", "type_as", "to"}


def _alias(gm: fx.GraphModule, n: fx.Node, of: fx.Node) -> bool:
    """Whether `n`'s value may share the memory of its input `of` (conservative: a clone costs a copy, a
    missed alias an autograd error)."""
    if not n.args or n.args[0] is not of:
        return False
    if n.op == "call_module":
        return isinstance(gm.get_submodule(str(n.target)), nn.Identity)
    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):  # ATen: ask its schema
        return any(r.alias_info is not None for r in n.target._schema.returns)
    if n.op in ("call_method", "call_function"):
        return str(getattr(n.target, "__name__", n.target)) in _VIEWS
    return False


def _in_place(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_module":
        return bool(getattr(gm.get_submodule(str(n.target)), "inplace", False))
    if n.op == "call_method":
        return str(n.target).endswith("_") and not str(n.target).endswith("__")
    if n.op == "call_function":
        if isinstance(n.target, torch._ops.OpOverload):  # an ATen op (exported graph): ask its schema
            args = n.target._schema.arguments
            return bool(args and args[0].alias_info is not None and args[0].alias_info.is_write)
        name = getattr(n.target, "__name__", "")
        return bool(n.kwargs.get("inplace")) or name.startswith("i") and name in _INPLACE_OPERATORS or (
            name.endswith("_") and not name.endswith("__"))
    return False


_INPLACE_OPERATORS = {"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor",
                      "ilshift", "irshift", "imatmul"}
