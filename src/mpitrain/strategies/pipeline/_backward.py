"""One micro-batch's backward in two halves (the zero-bubble schedules' I and W), nothing computed twice.

:func:`input_gradients` runs the part of the autograd graph that leads from the partition's outputs to
its received activations (the partial errors the previous partition waits for) and returns a
:class:`WeightWork` that later runs the rest: the parameter gradients. How, on the graph autograd
recorded in the forward (the approach of torch.distributed.pipelining's stage_backward_input/weight):

* the *input closure* is every node from which a received activation's gradient accumulator can be
  reached; the input half is ``torch.autograd.backward(outputs, grads, inputs=leaves,
  retain_graph=True)``: the engine runs only the branches that lead to the leaves, and a node on
  both paths (``addmm`` of a linear layer: its input gradient and its weight gradient) computes only
  the outputs asked for (autograd's per-edge ``needed`` mask), so its weight GEMM is not run yet;
* the parameters of at most one dimension (biases, norm scales) count as inputs of the input half:
  their gradients are reductions it computes anyway, so the weight half holds only weight GEMMs;
* the nodes outside the input closure form the *weight region*; its connected pieces (joined by
  its own edges and by the edges that enter it from the closure) are the groups, one engine call
  each. A closure node with an edge into the region is an *intermediate*, where a weight path leaves
  the input paths; a pre-hook on each captures the gradient the engine hands it during the input half;
* the weight half re-enters the graph at a group's intermediates with the captured gradients,
  ``inputs=`` the group's parameters: the engine now runs only their weight branches. Where a group's
  intermediates lie on each other's input path (a weight used twice in one partition), the engine
  would carry a gradient from the upper one down into the lower one on top of the captured gradient:
  a pre-hook then replaces what reaches each intermediate by its captured gradient (correct; the
  input path in between is computed again, the only recomputation and only in that case);
* outputs outside the input closure (every output of a partition without differentiable inputs,
  such as the first one; an output computed from parameters alone) belong to the weight region:
  their group enters there too, with the outputs' given gradients. A partition without
  differentiable inputs has no input half at all: its weight half is the plain backward.

Saved activations stay alive between the halves (``retain_graph``) and are freed when the
:class:`WeightWork` is run and dropped. Gradients accumulate into ``.grad`` as one backward would:
the same kernels on the same inputs; only the order of a sum over several uses of one weight may
differ (float rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["WeightWork", "input_gradients"]


@dataclass
class _Group:
    """One connected piece of the weight region: where the weight half enters it (intermediates, with
    the gradients captured there, and outputs outside the input closure) and its parameters."""

    params: list[torch.Tensor] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)
    outputs: list[tuple[GradientEdge, torch.Tensor]] = field(default_factory=list)


class WeightWork:
    """The weight half of one micro-batch's backward; :meth:`run` once."""

    def __init__(self, groups: list[_Group], plain: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
                 ) -> None:
        self._groups, self._plain = groups, plain

    def run(self) -> None:
        if self._plain is not None:  # no input half: the whole backward, as one process runs it
            torch.autograd.backward(*self._plain)
        for g in self._groups:
            edges = [GradientEdge(n, i) for n in g.nodes for i, t in enumerate(g.captured.get(n, ())) if t is not None]
            grads = [t for n in g.nodes for t in g.captured.get(n, ()) if t is not None]
            edges += [e for e, _ in g.outputs]
            grads += [t for _, t in g.outputs]
            if not edges:
                continue  # no gradient reached the group
            entries = [n for n in g.nodes if n in g.captured]
            clamps = [n.register_prehook(lambda _, saved=g.captured[n]: saved) for n in entries] if len(
                entries) > 1 else []
            try:
                torch.autograd.backward(edges, grads, inputs=g.params, retain_graph=True)
            finally:
                for h in clamps:
                    h.remove()
        self._groups, self._plain = [], None  # the graph is freed once the caller drops its outputs too


def _parents(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Every node of the graph below `roots`, mapped to the nodes whose next edges point at it."""
    up: dict[Node, list[Node]] = {r: [] for r in roots}
    stack = list(up)
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in up:
                up[child] = []
                stack.append(child)
            up[child].append(node)
    return up


def _ancestors(starts: list[Node], up: dict[Node, list[Node]]) -> set[Node]:
    out = {n for n in starts if n in up}
    stack = list(out)
    while stack:
        for parent in up[stack.pop()]:
            if parent not in out:
                out.add(parent)
                stack.append(parent)
    return out


def _early(params: Sequence[torch.Tensor], up: dict[Node, list[Node]]) -> dict[torch.Tensor, Node]:
    """The parameters of at most one dimension that the graph uses (biases, norm scales), with their
    gradient accumulators: the input half computes their gradients. Each is a reduction over the
    batch of a gradient the input half computes anyway (an addmm's bias: the sum of its output's
    gradient; a LayerNorm's scale and shift: in the same kernel as its input gradient), so the weight
    half keeps only the GEMMs and runs no LayerNorm backward a second time, nor one engine call per
    norm."""
    small = {id(p): p for p in params if p.dim() <= 1}
    out: dict[torch.Tensor, Node] = {}
    for acc in up:
        p = getattr(acc, "variable", None) if type(acc).__name__ == "AccumulateGrad" else None
        if p is not None and id(p) in small:
            out[p] = acc
    return out


def _find(rep: dict[Node, Node], n: Node) -> Node:
    while rep.setdefault(n, n) is not n:
        rep[n] = rep[rep[n]]  # path halving
        n = rep[n]
    return n


def _groups(params: Sequence[torch.Tensor], up: dict[Node, list[Node]], closure: set[Node],
            outputs: list[tuple[GradientEdge, torch.Tensor]]) -> list[_Group]:
    """The weight region's pieces that hold parameters, each with its intermediates and the `outputs`
    (edge, seed) that lie in it."""
    rep: dict[Node, Node] = {}
    entry: dict[Node, None] = {}  # ordered (the walk's order): the same engine calls on every run
    for child, parents in up.items():
        if child in closure:
            continue
        for parent in parents:
            rep[_find(rep, parent)] = _find(rep, child)
            if parent in closure:
                entry[parent] = None
    groups: dict[Node, _Group] = {}
    wanted = {id(p) for p in params}
    # the graph's gradient accumulators name their parameters (get_gradient_edge per parameter costs
    # ~2.5 us each: 130 us for GPT-2's 50, against 8 us for this scan of a 140-node partition)
    for acc in up:
        if type(acc).__name__ != "AccumulateGrad" or acc in closure:
            continue
        p: torch.Tensor = getattr(acc, "variable")  # noqa: B009  (Node's stub lacks the accumulator's field)
        if id(p) in wanted:
            groups.setdefault(_find(rep, acc), _Group()).params.append(p)
    for n in entry:
        g = groups.get(_find(rep, n))
        if g is not None:
            g.nodes.append(n)
    for e, seed in outputs:
        g = groups.get(_find(rep, e.node)) if e.node not in closure else None
        if g is not None:
            g.outputs.append((e, seed))
    return list(groups.values())


def input_gradients(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                    inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> WeightWork:
    """Accumulate the gradients of `outputs` (seeded with `grads`; None: ones, for a scalar loss) into
    ``.grad`` of the leaves `inputs` and of the parameters of at most one dimension (:func:`_early`),
    and return the work that accumulates them into the other `params`.
    `outputs` require grad; `inputs` are leaves that require grad; `params` are the parameters to get
    gradients (a parameter the graph uses that is not among them gets none)."""
    seeds = [g if g is not None else torch.ones_like(t) for t, g in zip(outputs, grads)]
    if not outputs:
        return WeightWork([])
    if not inputs:
        return WeightWork([], (list(outputs), seeds))
    edges = [get_gradient_edge(t) for t in outputs]
    up = _parents([e.node for e in edges])
    early = _early(params, up)
    closure = _ancestors([get_gradient_edge(t).node for t in inputs] + list(early.values()), up)
    groups = _groups(params, up, closure, list(zip(edges, seeds)))
    handles = []
    for g in groups:
        for n in g.nodes:
            def capture(grad_outputs: tuple[torch.Tensor | None, ...], n: Node = n, g: _Group = g) -> None:
                g.captured[n] = tuple(grad_outputs)
            handles.append(n.register_prehook(capture))
    try:
        inside = [(t, g) for t, g, e in zip(outputs, seeds, edges) if e.node in closure]
        if inside:
            torch.autograd.backward([t for t, _ in inside], [g for _, g in inside],
                                    inputs=[*inputs, *early], retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return WeightWork(groups)
