"""Model generator (HyPar-Flow §5.1): trace an unmodified model into an fx graph, measure it, cut it.

A traced model is a list of *compute nodes* in the graph's (topological) order. Partition k owns the
contiguous slice ``nodes[bounds[k]:bounds[k+1]]`` and becomes its own ``fx.GraphModule`` whose
placeholders are (1) the model inputs it reads and (2) the values it receives from earlier
partitions, and whose outputs are the values later partitions read (the last partition returns the
model's output). The partition modules share parameter and buffer tensors with the user's model, so
training a partition trains the user's model in place.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

__all__ = ["TraceFailure", "ValueMeta", "Traced", "Partition", "trace", "model_args", "profile", "measure",
           "param_counts", "cut_points", "split", "mutated_placeholders"]


class TraceFailure(ValueError):
    """The model could not be traced into a graph; the message names the construct that stopped it."""


@dataclass(frozen=True)
class ValueMeta:
    """What one graph value looks like for a given micro-batch: enough to allocate a receive buffer."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass
class Traced:
    """A traced model: `nodes` are the compute nodes (no placeholders/output) in execution order."""

    gm: fx.GraphModule
    placeholders: list[fx.Node]
    nodes: list[fx.Node]
    output: fx.Node


@dataclass
class Partition:
    """One contiguous slice of the graph as a runnable module.

    `data_inputs` are indices into the model's positional inputs (read locally: every rank has the
    batch); `recv_inputs` and `outputs` are value names, in the module's argument/return order."""

    index: int
    module: fx.GraphModule
    data_inputs: list[int]
    recv_inputs: list[str]
    outputs: list[str]


def trace(model: nn.Module) -> Traced:
    """Symbolically trace `model` (unmodified). Raises :class:`TraceFailure` naming what stopped fx."""
    try:
        gm = fx.symbolic_trace(model)
    except Exception as e:  # TraceError, TypeError, NotImplementedError...: depends on the construct
        raise TraceFailure(
            f"cannot split {type(model).__name__} into partitions: torch.fx could not trace it "
            f"({type(e).__name__}: {e}). Usual causes: Python control flow on tensor values "
            f"(`if x.sum() > 0`), "
            f"data-dependent shapes, or calls fx cannot see through; move them into a leaf module or use "
            f"strategy='data'.") from e
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    compute = [n for n in nodes if n.op not in ("placeholder", "output")]
    if not compute:
        raise TraceFailure(f"{type(model).__name__} traced to an empty graph: nothing to partition")
    return Traced(gm, placeholders, compute, output)


def model_args(traced: Traced, inputs: Sequence[Any]) -> list[Any]:
    """The value of every placeholder: the given inputs, then the forward's defaults."""
    args = list(inputs)
    for ph in traced.placeholders[len(args):]:
        if not ph.args:
            raise ValueError(f"the model's forward takes argument {ph.target!r} but the data gives only "
                             f"{len(inputs)} input(s); yield (inputs_tuple, targets) batches")
        args.append(ph.args[0])
    if len(args) > len(traced.placeholders):
        raise ValueError(f"the data gives {len(inputs)} inputs but the model's forward takes "
                         f"{len(traced.placeholders)}")
    return args


class _Recorder(fx.Interpreter):
    """Runs the graph node by node, recording each node's output meta, forward seconds and (with
    `stamp`) a hook on each differentiable output that notes when backward reaches it."""

    def __init__(self, gm: fx.GraphModule, stamp: bool = False) -> None:
        super().__init__(gm)
        self.meta: dict[str, ValueMeta | None] = {}
        self.seconds: dict[str, float] = {}
        self.stamps: list[tuple[float, str]] = []
        self._stamp = stamp

    def run_node(self, n: fx.Node) -> Any:
        t0 = time.perf_counter()
        out = super().run_node(n)
        self.seconds[n.name] = time.perf_counter() - t0
        is_tensor = isinstance(out, torch.Tensor)
        self.meta[n.name] = ValueMeta(tuple(out.shape), out.dtype, out.requires_grad) if is_tensor else None
        if self._stamp and is_tensor and out.requires_grad:
            out.register_hook(lambda g, name=n.name: self.stamps.append((time.perf_counter(), name)))
        return out


def profile(traced: Traced, inputs: Sequence[Any], grad: bool = True) -> dict[str, ValueMeta | None]:
    """Per-value meta (None: not a tensor) of one forward on `inputs` in eval mode, so BatchNorm
    statistics and the RNG are not touched; with `grad` the metas tell which values carry gradients."""
    with _undisturbed(traced.gm, train=False), torch.set_grad_enabled(grad):
        rec = _Recorder(traced.gm)
        rec.run(*model_args(traced, inputs))
    return rec.meta


def measure(traced: Traced, inputs: Sequence[Any], passes: int = 3) -> list[float]:
    """Seconds of forward plus backward per compute node (the fastest of `passes` training-mode passes
    on `inputs`), for balancing partitions by time. The model's buffers, gradients and RNG state are
    restored afterwards, so measuring changes nothing a step would see. A model that cannot run a
    training pass on `inputs` (BatchNorm1d on one sample) is measured by eval-mode forwards instead.

    A node's backward time runs from backward reaching its output until it reaches the next value
    (hooks on every differentiable output): exact on a chain, an apportioning on branches; balancing
    only uses sums over the contiguous node ranges that partitions are."""
    try:
        fwd, bwd = _timed_passes(traced, inputs, passes, train=True)
    except RuntimeError:
        fwd, bwd = _timed_passes(traced, inputs, passes, train=False)
    return [fwd.get(n.name, 0.0) + bwd.get(n.name, 0.0) for n in traced.nodes]


def _timed_passes(traced: Traced, inputs: Sequence[Any], passes: int,
                  train: bool) -> tuple[dict[str, float], dict[str, float]]:
    """Fastest forward and (when `train`) backward seconds per node over `passes` passes."""
    fwd: dict[str, float] = {}
    bwd: dict[str, float] = {}
    with _undisturbed(traced.gm, train=train), torch.set_grad_enabled(train):
        for _ in range(max(passes, 1)):
            rec = _Recorder(traced.gm, stamp=train)
            out = rec.run(*model_args(traced, inputs))
            fwd = {k: min(v, fwd.get(k, v)) for k, v in rec.seconds.items()}
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.backward(torch.ones_like(out))
                events = [*sorted(rec.stamps), (time.perf_counter(), "")]
                spent: dict[str, float] = {}
                for (t, name), (t_next, _) in zip(events, events[1:]):
                    spent[name] = spent.get(name, 0.0) + t_next - t
                bwd = {k: min(v, bwd.get(k, v)) for k, v in spent.items()}
    return fwd, bwd


@contextmanager
def _undisturbed(gm: nn.Module, train: bool) -> Iterator[None]:
    """Run `gm` in train/eval mode and put back its modes, buffers, parameter gradients and RNG state."""
    modes = {m: m.training for m in gm.modules()}
    buffers = [(b, b.detach().clone()) for b in gm.buffers()]
    grads = [(p, p.grad) for p in gm.parameters()]
    for p, _ in grads:
        p.grad = None  # backward would accumulate into the saved tensors in place
    gm.train(train)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        for m, training in modes.items():
            m.train(training)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g


def param_counts(traced: Traced) -> list[float]:
    """Parameter elements each compute node owns (call_module's parameters, get_attr tensors)."""
    out = []
    for n in traced.nodes:
        if n.op == "call_module":
            out.append(float(sum(p.numel() for p in traced.gm.get_submodule(n.target).parameters())))
        elif n.op == "get_attr":
            attr = _get_attr(traced.gm, n.target)
            out.append(float(attr.numel()) if isinstance(attr, torch.Tensor) else 0.0)
        else:
            out.append(0.0)
    return out


def _get_attr(gm: nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _last_use(traced: Traced) -> dict[str, int]:
    """For each value: index of the last compute node reading it (len(nodes) when the output reads it)."""
    index = {n.name: i for i, n in enumerate(traced.nodes)}
    last: dict[str, int] = {}
    for n in [*traced.nodes, traced.output]:
        at = index.get(n.name, len(traced.nodes))
        for a in n.all_input_nodes:
            last[a.name] = max(last.get(a.name, -1), at)
    return last


def cut_points(traced: Traced, meta: dict[str, ValueMeta | None]) -> list[int]:
    """Positions c (1 <= c < len(nodes)) where the graph may be cut: every value defined before c and
    read at or after c is a tensor (non-tensors such as ``x.size(0)`` never cross a boundary)."""
    last = _last_use(traced)
    live: set[str] = set()
    out = []
    for c, n in enumerate(traced.nodes[:-1], start=1):
        live.add(n.name)
        live = {v for v in live if last.get(v, -1) >= c}
        if all(meta.get(v) is not None for v in live):
            out.append(c)
    return out


def split(traced: Traced, bounds: Sequence[int]) -> list[Partition]:
    """Cut the graph at `bounds` (``[0, c1, ..., len(nodes)]``) into runnable partition modules."""
    index = {n.name: i for i, n in enumerate(traced.nodes)}
    ph_index = {n.name: i for i, n in enumerate(traced.placeholders)}
    last = _last_use(traced)
    parts = []
    for k in range(len(bounds) - 1):
        lo, hi = bounds[k], bounds[k + 1]
        own = traced.nodes[lo:hi] + ([traced.output] if hi == len(traced.nodes) else [])
        reads: dict[str, fx.Node] = {}
        for n in own:
            for a in n.all_input_nodes:
                if a.name in ph_index or index[a.name] < lo:
                    reads.setdefault(a.name, a)
        data = sorted((v for v in reads if v in ph_index), key=ph_index.__getitem__)
        recv = sorted((v for v in reads if v not in ph_index), key=index.__getitem__)
        final = k == len(bounds) - 2
        outs = [] if final else [n.name for n in traced.nodes[lo:hi] if last.get(n.name, -1) >= hi]
        parts.append(Partition(k, _build(traced, own, [*data, *recv], outs, final),
                               [ph_index[v] for v in data], recv, outs))
    return parts


def _build(traced: Traced, own: list[fx.Node], inputs: list[str], outputs: list[str],
           last: bool) -> fx.GraphModule:
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_name = {n.name: n for n in [*traced.placeholders, *traced.nodes]}
    for name in inputs:
        env[by_name[name]] = g.placeholder(name)
    for n in own:
        if n.op == "output":
            g.output(fx.map_arg(n.args[0], lambda a: env[a]))
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
    if not last:
        g.output(tuple(env[by_name[v]] for v in outputs))
    return fx.GraphModule(traced.gm, g)


def mutated_placeholders(gm: fx.GraphModule) -> set[str]:
    """Placeholders that some node modifies in place (``relu(inplace=True)``, ``x += y``, ``x.add_``).

    A received activation is a leaf of the partition's autograd graph, which torch forbids mutating;
    these inputs are cloned first so the partition runs the same in-place code as the whole model."""
    out = set()
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        for u in n.users:
            if u.args and u.args[0] is n and _in_place(gm, u):
                out.add(n.name)
    return out


def _in_place(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_module":
        return bool(getattr(gm.get_submodule(n.target), "inplace", False))
    if n.op == "call_method":
        return n.target.endswith("_") and not n.target.endswith("__")
    if n.op == "call_function":
        name = getattr(n.target, "__name__", "")
        return bool(n.kwargs.get("inplace")) or name.startswith("i") and name in _INPLACE_OPERATORS or (
            name.endswith("_") and not name.endswith("__"))
    return False


_INPLACE_OPERATORS = {"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor",
                      "ilshift", "irshift", "imatmul"}
