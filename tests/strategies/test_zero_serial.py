"""ZeRO's layout and checkpoints by name in one process: every element of every parameter belongs to
exactly one rank's block; optimizer state and tensors saved in pieces by one layout load into another,
and a checkpoint that does not cover what a rank holds is refused naming it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpitrain.strategies._reshard import Held, assemble, load_named, optimizer_entries, tensor_entries, whole
from mpitrain.strategies._zero import FlatShard, check_optimizer, check_stage


def params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(*s, dtype=torch.float64)) for s in ((3, 5), (7,), (2, 2, 2), (1,))]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
def test_each_element_is_in_exactly_one_ranks_piece_and_the_reduce_rows(size):
    originals = [p.detach().clone() for p in params()]
    owner = [torch.zeros(p.numel(), dtype=torch.int64) for p in originals]
    for rank in range(size):
        ps = [nn.Parameter(t.clone()) for t in originals]
        shard = FlatShard(0, ps, size, rank, stage=2)
        assert all(torch.equal(p, t) for p, t in zip(ps, originals))  # same values, now views of `flat`
        assert all(p.untyped_storage().data_ptr() == shard.flat.untyped_storage().data_ptr() for p in ps)
        for c, q in zip(shard.pieces, shard.piece_params):
            owner[c.param][c.start:c.stop] += 1
            assert torch.equal(q.detach(), originals[c.param].reshape(-1)[c.start:c.stop])
        for i, segs in enumerate(shard.segments):  # the reduce buffer's rows hold each element once
            assert sum(t - s for s, t, _ in segs) == originals[i].numel()
            assert all(off % shard.row + (t - s) <= shard.block for s, t, off in segs)
    assert all(bool((o == 1).all()) for o in owner)


def test_stage3_releases_the_whole_parameters_and_keeps_its_block():
    ps = params()
    shard = FlatShard(0, ps, 2, 1, stage=3)
    assert not shard.gathered and shard.shard.numel() == shard.block
    shard.allocate()
    assert shard.gathered
    shard.release()
    assert shard.flat.untyped_storage().nbytes() == 0


def test_element_wise_optimizers_only_and_stages_zero_to_three():
    p = [nn.Parameter(torch.zeros(2))]
    for opt in (torch.optim.SGD(p, lr=0.1), torch.optim.AdamW(p), torch.optim.Adagrad(p)):
        check_optimizer(opt)
    for opt in (torch.optim.LBFGS(p), torch.optim.Adafactor(p)):
        with pytest.raises(ValueError, match=f"cannot shard {type(opt).__name__}"):
            check_optimizer(opt)
    for bad in (4, -1, True, "1"):
        with pytest.raises(ValueError, match="zero must be one of"):
            check_stage(bad)


def stepped(ps: list[nn.Parameter]) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(ps, lr=0.1)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def test_state_saved_in_pieces_loads_whole_and_in_other_pieces():
    """Save Adam's state of 3 ranks' pieces, load it whole and as 2 ranks' pieces: the same numbers."""
    names = ["w", "b", "c", "d"]
    full = params()
    reference = stepped(full)
    ref_state = {n: reference.state[p] for n, p in zip(names, full)}
    saved = []
    for rank in range(3):
        ps = [nn.Parameter(p.detach().clone()) for p in params()]
        shard = FlatShard(0, ps, 3, rank, stage=2)
        opt = stepped(shard.piece_params)
        held = {id(q): Held(names[c.param], c.start, c.stop, tuple(ps[c.param].shape))
                for c, q in zip(shard.pieces, shard.piece_params)}
        model, pieces = tensor_entries([(q, h) for q in shard.piece_params for h in [held[id(q)]]])
        saved.append({"model": model, "model_pieces": pieces, "optim": optimizer_entries(opt, held)})
    merged = assemble(saved)
    assert all(torch.equal(merged[n], p.detach()) for n, p in zip(names, full))
    # whole, one process
    target = params()
    opt = torch.optim.Adam(target, lr=0.5)
    load_named(lambda r: saved[r], range(3), [(p, whole(n, p)) for n, p in zip(names, target)], opt,
               {id(p): whole(n, p) for n, p in zip(names, target)})
    for n, p in zip(names, target):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], ref_state[n][k]), (n, k)
        assert torch.equal(p.detach(), dict(zip(names, full))[n].detach())
    assert opt.param_groups[0]["lr"] == 0.1  # the saved hyperparameters
    # other pieces: 2 ranks
    for rank in range(2):
        ps = params()
        shard = FlatShard(0, ps, 2, rank, stage=2)
        opt = torch.optim.Adam(shard.piece_params)
        held = {id(q): Held(names[c.param], c.start, c.stop, tuple(ps[c.param].shape))
                for c, q in zip(shard.pieces, shard.piece_params)}
        load_named(lambda r: saved[r], range(3), [], opt, held)
        for c, q in zip(shard.pieces, shard.piece_params):
            want = ref_state[names[c.param]]["exp_avg_sq"].reshape(-1)[c.start:c.stop]
            assert torch.equal(opt.state[q]["exp_avg_sq"], want)


def test_a_checkpoint_missing_what_a_rank_holds_is_refused_naming_it():
    saved = [{"model": {"a": torch.zeros(3)}, "model_pieces": {}, "optim": {"groups": [], "state": {}}}]
    with pytest.raises(Exception, match="does not hold \\['b'\\]"):
        load_named(lambda r: saved[r], [0], [(torch.zeros(3), whole("a", torch.zeros(3))),
                                             (torch.zeros(2), whole("b", torch.zeros(2)))])
