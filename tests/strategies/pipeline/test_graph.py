"""Model generator in one process: tracing, cut points, balancing, and partitions that keep the maths."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

from mpitrain.strategies.pipeline._graph import TraceFailure, capture, cut_points, measure, profile, split, trace
from mpitrain.strategies.pipeline._partition import balanced_bounds, explicit_bounds
from mpitrain.strategies.pipeline._stage import make_edges

from .models import MODELS


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a node that is cheap forward and costly backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.02)
        return g


def slow_backward(x):
    return _SlowBackward.apply(x)


torch.fx.wrap("slow_backward")  # one graph node, as a leaf module's call would be


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(slow_backward(nn.functional.dropout(self.bn(self.fc1(x)), 0.5)))


def run_partitions(traced, parts, flat):
    """Run the partitions one after another in one process, passing values by name; the model's output
    rebuilt in its own structure."""
    values: dict[str, torch.Tensor] = {}
    out = None
    for p in parts:
        out = p.module(*[flat[i] for i in p.data_inputs], *[values[v] for v in p.recv_inputs])
        if p.outputs:
            values.update(zip(p.outputs, out))
    return pytree.tree_unflatten(out, traced.out_spec)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("P", [2, 3, 4])
def test_partitions_run_in_sequence_give_the_model_output_and_grads(name, P):
    cls, shape = MODELS[name]
    torch.manual_seed(0)
    model = cls().eval()
    x = torch.randn(6, *shape)
    traced = trace(model)
    meta = profile(traced, [x])
    parts = split(traced, balanced_bounds([1.0] * len(traced.nodes), cut_points(traced, meta), P), meta)
    expected = model(x)
    expected.sum().backward()
    want = [q.grad.clone() for q in model.parameters()]
    model.zero_grad()
    got = run_partitions(traced, parts, [x])
    got.sum().backward()
    assert torch.equal(got, expected)
    for g, w in zip([q.grad for q in model.parameters()], want):
        assert torch.allclose(g, w, atol=1e-6)


def test_skip_model_has_an_edge_over_a_whole_partition_read_by_two_partitions():
    cls, shape = MODELS["skip"]
    traced = trace(cls())
    meta = profile(traced, [torch.randn(4, *shape)])
    cuts = cut_points(traced, meta)
    names = [n.name for n in traced.nodes]
    bounds = [0, names.index("l2") + 1, names.index("l3") + 1, names.index("add") + 1, len(names)]
    assert all(b in cuts for b in bounds[1:-1])
    edges = make_edges(split(traced, bounds, meta), meta)
    a_edges = [(e.src, e.dst) for e in edges if e.value == "tanh"]
    assert a_edges == [(0, 2), (0, 3)]
    kinds = {e.value: e.grad for e in edges}
    assert kinds["argmax"] is False and kinds["float_1"] is False and kinds["tanh"] is True


class _ShapeOfActivation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        n = h.size(0)
        return self.l3(torch.relu(self.l2(h))).view(n, -1) + x.size(1)


def test_a_shape_of_an_activation_never_crosses_a_boundary_and_an_input_shape_is_recomputed():
    traced = trace(_ShapeOfActivation())
    x = torch.randn(4, 4)
    meta = profile(traced, [x])
    names = [n.name for n in traced.nodes]
    cuts = cut_points(traced, meta)
    assert not any(names.index("size") < c <= names.index("view") for c in cuts)
    parts = split(traced, [0, cuts[-1], len(names)], meta)  # size_1 = x.size(1) is read after the cut
    assert all("size_1" not in p.recv_inputs for p in parts)
    assert torch.equal(run_partitions(traced, parts, [x]), traced.gm(x))


def test_balanced_bounds_minimise_the_costliest_partition_like_brute_force():
    g = torch.Generator().manual_seed(1)
    for n, P in [(7, 2), (8, 3), (9, 4)]:
        costs = torch.rand(n, generator=g).tolist()
        cuts = [c for c in range(1, n) if c != 3]
        got = balanced_bounds(costs, cuts, P)
        best = min(max(sum(costs[a:b]) for a, b in zip([0, *cs], [*cs, n]))
                   for cs in itertools.combinations(cuts, P - 1))
        assert max(sum(costs[a:b]) for a, b in zip(got, got[1:])) == pytest.approx(best)
        assert all(c in cuts for c in got[1:-1]) and got[0] == 0 and got[-1] == n


def test_balance_refuses_more_partitions_than_cut_points_and_bad_lists():
    with pytest.raises(ValueError, match="partitions <= 4"):
        balanced_bounds([1.0] * 4, [1, 2, 3], 5)
    with pytest.raises(ValueError, match="summing to"):
        explicit_bounds([2, 1], 4, [1, 2, 3])
    with pytest.raises(ValueError, match="non-tensor"):
        explicit_bounds([2, 2], 4, [1, 3])


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x
        return -x


def test_untraceable_model_error_names_the_construct():
    with pytest.raises(TraceFailure, match="control flow|TraceError"):
        trace(DataDependent())


class NoGradBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x = self.a(x)
        return x + 1


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class AppliesAFunction(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Twice.apply(x)


def test_fx_refuses_a_forward_that_switches_gradients_and_export_keeps_the_block():
    with pytest.raises(TraceFailure, match="switches gradients or autocast"):
        trace(NoGradBlock())
    traced = capture(NoGradBlock(), torch.randn(2, 4))
    assert traced.how == "export"
    assert not traced.gm(torch.randn(2, 4))[0].requires_grad  # the block's output is as the forward's


def test_capture_refuses_a_custom_autograd_function_and_restores_apply():
    apply = torch.autograd.Function.__dict__["apply"]
    with pytest.raises(TraceFailure, match="custom autograd.Function .*_Twice"):
        capture(AppliesAFunction(), torch.randn(2, 4))
    assert torch.autograd.Function.__dict__["apply"] is apply
    assert _Twice.apply(torch.ones(1, requires_grad=True)).grad_fn is not None


def test_measure_counts_backward_time_on_the_node_that_spends_it():
    traced = trace(_Net())
    costs = dict(zip([n.name for n in traced.nodes], measure(traced, [torch.randn(5, 4)], passes=2)))
    assert costs["slow_backward"] >= 0.015, costs  # forward is a copy; the 20 ms are its backward's
    assert all(c >= 0 for c in costs.values())


def test_measure_leaves_buffers_gradients_modes_and_rng_untouched():
    torch.manual_seed(0)
    model = _Net()
    model.fc1.weight.grad = torch.ones_like(model.fc1.weight)
    model.eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    traced = trace(model)
    x = torch.randn(5, 4)
    rng = torch.get_rng_state()
    measure(traced, [x], passes=2)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())  # BN statistics too
    assert torch.equal(model.fc1.weight.grad, torch.ones_like(model.fc1.weight)) and model.fc2.weight.grad is None
    assert not any(m.training for m in traced.gm.modules())


def _partitions_give_the_models_logits_and_grads(model, traced, parts, flat, inputs, labels) -> None:
    """The partitions run in sequence and back-propagated give bitwise the model's own output type,
    logits and parameter gradients on the same batch."""
    from .tiny_transformers import lm_loss

    got = run_partitions(traced, parts, flat)
    lm_loss(got, labels).backward()
    got_grads = [q.grad.clone() for q in model.parameters()]
    model.zero_grad()
    want = model(**inputs)
    lm_loss(want, labels).backward()
    assert type(got) is type(want) and torch.equal(got.logits, want.logits)
    assert all(torch.equal(a, q.grad) for a, q in zip(got_grads, model.parameters()))


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_exported_transformer_partitions_in_sequence_give_its_output_and_grads_exactly(name):
    """fx cannot trace these; torch.export can, and partitions of its graph change no bit."""
    from mpitrain.strategies.pipeline._graph import capture, model_args, param_counts, tied_groups

    from .tiny_transformers import build, lm_batches

    model = build(name)
    (inputs, labels), = lm_batches(4, 1)
    traced = capture(model, inputs)
    flat = model_args(traced, inputs)
    meta = profile(traced, flat)
    parts = split(traced, balanced_bounds(param_counts(traced), cut_points(traced, meta), 3), meta)
    assert traced.how == "export"
    _partitions_give_the_models_logits_and_grads(model, traced, parts, flat, inputs, labels)
    tied = [holders for holders, _ in tied_groups(parts)]
    assert tied == ([] if name == "llama" else [(0, 2)])  # embedding and LM head: first and last partition
    # the default (sdpa) attention's boolean mask, position ids, rotary tables: recomputed, never sent
    crossing = {v: meta[v] for p in parts for v in p.recv_inputs}
    assert crossing and all(m is not None and m.requires_grad for m in crossing.values()), crossing


def test_a_forward_taking_use_cache_is_captured_without_a_cache_unless_the_batch_asks():
    """A default Hugging Face config says use_cache=True: the capture calls the forward with
    use_cache=False (no cache object in the outputs), and every batch's inputs get the same; a
    model without that argument, or a batch that sets it, is left as it is."""
    from mpitrain.strategies.pipeline._graph import capture, model_args, training_kwargs

    from .tiny_transformers import build, lm_batches

    model = build("gpt2")
    assert model.config.use_cache
    (inputs, _), = lm_batches(4, 1)
    traced = capture(model, inputs)
    assert traced.fixed_kwargs == {"use_cache": False}
    out = pytree.tree_unflatten(traced.gm(*model_args(traced, inputs)), traced.out_spec)
    assert out.past_key_values is None and out.logits.shape == (4, 8, 100)
    assert training_kwargs(model, (), {**inputs, "use_cache": True}) == {}
    assert training_kwargs(build("bert"), (), inputs) == {}  # BertForMaskedLM takes no use_cache


class _InputConstants(nn.Module):
    """Values computed from the input alone: a pure mask (recomputed where read), random noise and a
    tensor later written in place (both must cross, computed once)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x > 0
        noise = torch.rand_like(x)
        count = torch.zeros_like(x)
        h = torch.tanh(self.a(x))
        count.add_(1.0)
        return self.b(h).masked_fill(mask, 0.0) + noise + count


def test_input_constants_are_recomputed_but_random_or_mutated_values_are_not():
    from mpitrain.strategies.pipeline._graph import export, local_nodes, model_args

    traced = export(_InputConstants(), torch.randn(4, 4))  # ATen ops: purity is known
    x = torch.randn(4, 4)
    meta = profile(traced, model_args(traced, x))
    local = local_nodes(traced, meta)
    targets = {n.name: str(n.target) for n in traced.nodes}
    assert any("gt" in targets[v] for v in local)  # the mask
    assert not any("rand" in targets[v] or "zeros" in targets[v] for v in local), sorted(local)


class _Selected(nn.Module):
    """`picked` has as many rows as `x` has positive entries: a shape no sample tells."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        picked = h[h > 0]
        return self.b(torch.tanh(h)).sum() + (picked * 2).sum()


def test_a_value_whose_shape_depends_on_the_data_never_crosses_a_boundary():
    from mpitrain.strategies.pipeline._graph import export, model_args

    traced = export(_Selected(), torch.randn(4, 4))
    x = torch.randn(4, 4)
    meta = profile(traced, model_args(traced, x))
    names = [n.name for n in traced.nodes]
    picked = next(i for i, n in enumerate(traced.nodes) if "index" in str(n.target))
    reader = max(i for i, n in enumerate(traced.nodes) if any(a.name == names[picked] for a in n.all_input_nodes))
    cuts = cut_points(traced, meta)
    assert cuts and not any(picked < c <= reader for c in cuts)


class _FixedLength(nn.Module):
    """Mixes the sequence dimension through a Linear(8, 8): its length is part of the model."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x.transpose(1, 2)).transpose(1, 2).sum(-1)


def test_one_exported_graph_serves_other_lengths_and_a_length_the_model_fixes_is_refused():
    """Llama captured on 8 tokens runs 12 and 3 exactly as the model does (the rotary tables and the
    mask follow the length); a model whose code fixes a length refuses another, naming it."""
    from mpitrain.strategies.pipeline._graph import capture, check_shapes, export, model_args

    from .tiny_transformers import build, lm_batches

    model = build("llama").eval()
    traced = capture(model, lm_batches(4, 1)[0][0])  # 8 tokens
    for length in (12, 3):
        x = {k: v[:, :1].repeat(3, length) for k, v in lm_batches(4, 1, seed=length)[0][0].items()}
        flat = model_args(traced, x)
        check_shapes(traced, flat)
        # the metas of another length, propagated on fake tensors, are the real forward's
        assert profile(traced, flat, grad=False, fake=True) == profile(traced, flat, grad=False)
        with torch.no_grad():
            got = pytree.tree_unflatten(traced.gm(*flat), traced.out_spec)
            assert torch.equal(got.logits, model(**x).logits)
    fixed = export(_FixedLength(), torch.randn(2, 8, 3))
    check_shapes(fixed, [torch.randn(5, 8, 7)])  # batch and features are free
    with pytest.raises(ValueError, match="length 6 in dimension 1.*specialised the captured model to 8"):
        check_shapes(fixed, [torch.randn(2, 6, 3)])


class _ModeDependent(nn.Module):
    """Dropout and BatchNorm behind a shape branch fx cannot trace: captured by torch.export."""

    def __init__(self) -> None:
        super().__init__()
        self.l, self.drop, self.bn = nn.Linear(4, 4), nn.Dropout(0.5), nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1:
            x = x * 2
        return self.bn(self.drop(self.l(x)))


def test_an_exported_graph_follows_eval_mode_for_dropout_and_batch_norm():
    from mpitrain.strategies.pipeline._graph import capture, set_training

    torch.manual_seed(0)
    model = _ModeDependent()
    x = torch.randn(6, 4)
    traced = capture(model, x)
    assert traced.how == "export"
    set_training(traced.gm, False)
    with torch.no_grad():
        assert torch.equal(traced.gm(x)[0], model.eval()(x))


def _names_meta(gm: torch.fx.GraphModule) -> bool:
    """Some node of `gm`, or of a graph nested in it (a higher-order op's body), names the meta device."""
    meta = torch.device("meta")
    return any(isinstance(a, torch.device) and a == meta for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes for a in pytree.tree_leaves((n.args, n.kwargs)))


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_a_meta_transformer_is_exported_on_its_own_tensors_and_its_partitions_run_on_the_cpu(name):
    """Exported on the meta device, the graph reads the model's own Parameter objects, which can then
    be materialised in place; partitions split with device=cpu create on the CPU what the graph creates
    on meta and give the materialised model's output and gradients exactly; the captured graph itself
    keeps naming meta (the meta profile runs on it)."""
    from mpitrain.strategies.pipeline._graph import capture, model_args, param_counts
    from mpitrain.strategies.pipeline._materialize import materialize

    from .tiny_transformers import build, lm_batches

    model = build(name, meta=True)
    (inputs, labels), = lm_batches(4, 1)
    traced = capture(model, inputs)
    assert traced.how == "export" and _names_meta(traced.gm)
    mine = {id(t) for t in [*model.parameters(), *model.buffers()]}
    assert all(id(t) in mine for t in [*traced.gm.parameters(), *traced.gm.buffers()])
    flat = model_args(traced, inputs)
    meta = profile(traced, [a.to("meta") if isinstance(a, torch.Tensor) else a for a in flat])  # use_cache=False
    materialize(model, init_fn=model._init_weights)  # swap_tensors: no weak reference left by export
    parts = split(traced, balanced_bounds(param_counts(traced), cut_points(traced, meta), 3), meta,
                  torch.device("cpu"))
    assert not any(_names_meta(p.module) for p in parts) and _names_meta(traced.gm)
    _partitions_give_the_models_logits_and_grads(model, traced, parts, flat, inputs, labels)


class _Embedder(nn.Module):
    """Token ids through an embedding, behind a shape branch fx cannot trace: captured by torch.export."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.l = nn.Embedding(10, 4), nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[0] > 1:
            ids = ids.flip(0)
        return self.l(self.emb(ids)).sum(1)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_export_traces_a_loaders_cpu_rows_where_the_parameters_are(device):
    """torch.export's fake tensors refuse an embedding of CUDA weights by CPU ids, so capture moves the
    sample to the parameters' device first; the meta device stands in for CUDA here (the GPU suite
    checks CUDA: tests/gpu). The caller's rows stay where they were."""
    from mpitrain.strategies.pipeline._graph import capture

    model = _Embedder().to(device)
    ids = torch.randint(0, 10, (4, 5))
    traced = capture(model, ids)
    assert traced.how == "export"
    assert [p.meta["val"].device.type for p in traced.placeholders] == [device]
    assert ids.device.type == "cpu"


class _ThroughAlias(nn.Module):
    """Partition-like forwards whose input reaches an in-place op directly, through an Identity (timm's
    ``bn1.drop`` before its in-place ``bn1.act``) or through a view, or only through a copy."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.drop, self.act = how, nn.Identity(), nn.Hardswish(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "identity":
            return self.act(self.drop(x))
        if self.how == "view":
            return x.view(-1).relu_()
        if self.how == "getitem":
            return x[0].add_(1)
        return x.clone().relu_()  # "copy": the input itself is never written


@pytest.mark.parametrize("how, mutated", [("identity", True), ("view", True), ("getitem", True), ("copy", False)])
def test_an_input_written_in_place_through_an_alias_is_cloned_and_runs_as_received(how, mutated):
    """A received activation is an autograd leaf: writing it, or a view of it, in place raises. The stage
    clones exactly the inputs some node writes through an alias (and runs as torch would on a copy)."""
    from mpitrain.strategies.pipeline._graph import mutated_placeholders

    gm = torch.fx.symbolic_trace(_ThroughAlias(how))
    assert mutated_placeholders(gm) == ({"x"} if mutated else set())
    x = torch.randn(2, 3, requires_grad=True)  # as a stage receives it
    gm(x.clone() if mutated else x).sum().backward()
    assert x.grad is not None
