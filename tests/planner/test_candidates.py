"""The planner's candidate pricing on given measurements: feasibility, reasons, and the choices the
cost models imply (no clock: the measurements are stated)."""

from __future__ import annotations

import json

import pytest

from mpitrain.perf.calibrate import Calibration, LinkCost, Network
from mpitrain.perf.spatial import ConvShape
from mpitrain.planner._candidates import STRATEGY_NAMES, TIE_MARGIN, Measured, candidates, machinery, mixed_path
from mpitrain.planner._plan import parse_bytes
from mpitrain.planner._profile import ModelProfile, profile_from_dict, profile_to_dict

CAL = Calibration(alpha=1e-5, beta=1e-9, gamma=1e-10, S=1e-6, codec_per_byte={"None": 0.0, "bf16": 1e-9},
                  wire_ratio={"None": 1.0, "bf16": 0.5})


def _net(alpha: float = 1e-5, beta: float = 1e-9) -> Network:
    link = LinkCost(alpha, beta)
    return Network("world", 4, link, link, link)


def _profile(batch: int, seconds_per_sample: float, param_bytes: int, hw: int = 256) -> ModelProfile:
    nodes = 4
    return ModelProfile(batch=batch, step_at=[(1.0, seconds_per_sample), (2.0, 2 * seconds_per_sample)],
                        forward_share=0.33, param_bytes=param_bytes, activation_bytes_per_sample=1e6,
                        output_bytes_per_sample=40.0, input_shape=(batch, 3, hw, hw),
                        node_share=[0.4, 0.1, 0.4, 0.1], node_bytes_per_sample=[1e5] * nodes,
                        node_param_bytes=[param_bytes // 2, 0, param_bytes // 2, 0],
                        node_is_conv=[True, False, True, False],
                        crossing_bytes_per_sample=[0.0] + [1e5] * nodes, cuts=[1, 2, 3],
                        convs=[ConvShape(batch, 3, hw, hw, 8, 3), ConvShape(batch, 8, hw, hw, 8, 3)],
                        switch_points=[(1, "1", hw), (2, "2", hw), (3, "3", hw)])


def _measured(prof: ModelProfile, world: int = 4, net: Network | None = None, spatial_ok: bool = True) -> Measured:
    return Measured(prof, net or _net(), CAL, world, 0, lambda g, s: None if spatial_ok else "no spatial form")


def test_compute_bound_model_with_a_divisible_batch_picks_data_parallel_first():
    plans, _ = candidates(_measured(_profile(32, 0.01, 10_000)), set(STRATEGY_NAMES), 1e12)
    assert plans[0].strategy in ("data", "pipe-sgd")
    keys = [p.step_s * (1 + TIE_MARGIN * machinery(p)) for p in plans]
    assert keys == sorted(keys)
    data = next(p for p in plans if p.strategy == "data")
    assert data.step_s == pytest.approx(sum(data.breakdown.values()))


def test_one_sample_cannot_be_split_by_samples_so_spatial_wins_and_data_says_why():
    plans, dropped = candidates(_measured(_profile(1, 0.5, 10_000)), set(STRATEGY_NAMES), 1e12)
    assert plans[0].strategy == "spatial"
    reasons = {d.strategy: d.reason for d in dropped}
    assert "does not split into 4 equal slices" in reasons["data"]
    assert "replicas" in reasons["hybrid"] or any(p.strategy == "model" for p in plans)


def test_every_plan_over_the_memory_limit_is_dropped_with_the_limit_named():
    plans, dropped = candidates(_measured(_profile(32, 0.01, 10_000)), set(STRATEGY_NAMES), 1000)
    assert plans == []
    assert any("exceeds the memory limit" in d.reason for d in dropped)


def test_unconvertible_model_drops_spatial_with_the_spatial_reason():
    plans, dropped = candidates(_measured(_profile(8, 0.01, 10_000), spatial_ok=False), {"spatial"}, 1e12)
    assert plans == [] and all(d.reason == "no spatial form" for d in dropped if d.strategy == "spatial")


def test_hybrid_options_run_under_fit_and_partitions_divide_the_world():
    plans, _ = candidates(_measured(_profile(32, 0.01, 10_000)), {"model", "hybrid"}, 1e12)
    layouts = {(p.strategy, p.options["partitions"], p.options.get("replicas")) for p in plans}
    assert layouts == {("hybrid", 2, 2), ("model", 4, None)}
    for p in plans:
        R = p.options.get("replicas", 1)
        assert 32 % (R * p.options["micro_batches"]) == 0


def test_mixed_path_goes_spatial_then_sample_when_shuffles_are_free():
    # a slow network makes halos expensive: the path stays sample-parallel everywhere
    _, path = mixed_path(_measured(_profile(8, 0.01, 10_000), net=_net(1.0, 1e-3)))
    assert set(path) == {"sample"}
    # the spatial -> sample order is the only switch the graph allows
    _, path = mixed_path(_measured(_profile(8, 0.01, 10_000)))
    assert path == sorted(path, key=lambda d: d != "spatial")


def test_profile_round_trips_through_the_cache_format():
    prof = _profile(8, 0.01, 10_000)
    assert profile_from_dict(json.loads(json.dumps(profile_to_dict(prof)))) == prof


def test_parse_bytes_reads_binary_units():
    assert parse_bytes("8G") == 8 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes(1e9) == 1e9
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_near_ties_go_to_the_plan_with_less_machinery():
    plans, _ = candidates(_measured(_profile(32, 0.01, 10)), {"data", "pipe-sgd"}, 1e12)
    # with negligible communication every pipe-sgd plan is within the margin of data: data comes first
    assert plans[0].strategy == "data"
    assert machinery(plans[0]) == 0 and {machinery(p) for p in plans[1:]} <= {1, 2}


def test_the_best_mix_is_a_runnable_spatial_plan_switching_at_a_module():
    # 6 samples on 4 ranks: data cannot split them; the mix computes the late nodes on whole samples
    plans, dropped = candidates(_measured(_profile(6, 0.01, 10_000)), {"data", "mixed"}, 1e12)
    assert [p.strategy for p in plans] == ["spatial"]
    opts = plans[0].options
    assert opts["grid"] == (4, 1) and opts["samples"] == 1 and opts["switch_at"] in ("1", "2", "3")
    assert plans[0].step_s == pytest.approx(sum(plans[0].breakdown.values()))
    assert any(d.strategy == "data" for d in dropped)


def test_a_model_without_a_switch_point_has_no_mixed_plan_and_says_why():
    prof = _profile(8, 0.01, 10_000)
    prof.switch_points = []
    plans, dropped = candidates(_measured(prof), {"mixed"}, 1e12)
    assert plans == [] and "module to switch at" in dropped[0].reason


def test_the_mixed_path_switches_only_at_a_switch_point_into_a_tall_enough_block():
    prof = _profile(8, 0.01, 10_000, hw=2)  # 2 rows cannot be split over 4 ranks
    prof.switch_points = [(2, "2", 2)]
    assert mixed_path(_measured(prof), switch=True) is None
    prof.switch_points = [(2, "2", 256)]
    _, path = mixed_path(_measured(prof), switch=True)
    assert path == ["spatial", "spatial", "sample", "sample"]


def test_one_host_levels_price_exactly_as_one_level():
    prof = _profile(32, 0.01, 10_000)
    one = candidates(_measured(prof), set(STRATEGY_NAMES), 1e12)[0]
    m = _measured(prof)
    levels = Measured(m.prof, m.net, m.cal, m.world, 0, m.spatial_check, intra=m.net, hosts=(0, 0, 0, 0))
    assert [p.to_dict() for p in candidates(levels, set(STRATEGY_NAMES), 1e12)[0]] == [p.to_dict() for p in one]


def test_patterns_inside_a_host_are_priced_on_the_intra_host_network():
    prof = _profile(4, 0.01, 10_000)
    slow, fast = _net(1e-3, 1e-7), _net(1e-6, 1e-10)
    m = Measured(prof, slow, CAL, 4, 0, lambda g, s: None, intra=fast, hosts=(0, 0, 1, 1))
    plans, _ = candidates(m, {"spatial"}, 1e12)
    halo = {(p.options["grid"], p.options["samples"]): p.breakdown["halo"] for p in plans}
    # two samples of a (2, 1) grid each on one host: halos on the fast level; (4, 1) crosses hosts
    assert halo[((2, 1), 2)] < halo[((4, 1), 1)] / 100
    assert m.level([range(0, 2), range(2, 4)]) is fast and m.level([range(4)]) is slow


def test_switch_points_name_whole_residual_blocks_not_the_convs_inside_them():
    import torch
    from torch import nn

    from mpitrain.planner._profile import measure_model

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return x + self.conv(x)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Block(), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(4, 2))
    batch = (torch.randn(4, 3, 8, 8), torch.randint(0, 2, (4,)))
    prof = measure_model(model, nn.functional.cross_entropy, batch, [2, 4], repeats=1)
    names = [name for _, name, _ in prof.switch_points]
    assert names == ["1", "2", "3"] and all(h == 8 for _, _, h in prof.switch_points)


def test_pipelines_price_every_schedule_that_can_run_and_keep_the_fastest():
    """4 graph nodes, 3 cuts: P = 2 may cut 4 partitions (interleaved, zbv), P = 4 only 1F1B and zb1p.
    The bubble is the schedule simulated on the partitions' times: balanced, the zero-bubble schedules
    win with a cheap network; with the last node holding half the time (an LM head), zbv's four
    partitions cannot balance its two ranks and zb1p wins at P = 2."""
    from mpitrain.planner._candidates import _pipelines, _schedules

    assert _schedules(2, 4, 3) == ["1f1b", "interleaved-1f1b", "zb1p", "zbv"]
    assert _schedules(4, 4, 3) == ["1f1b", "zb1p"] and _schedules(2, 3, 3) == ["1f1b", "zb1p", "zbv"]
    fast = _net(1e-9, 1e-15)
    for shares, want in (([0.25] * 4, {2: "zbv", 4: "zb1p"}), ([0.15, 0.15, 0.2, 0.5], {2: "zb1p", 4: "zb1p"})):
        prof = _profile(32, 0.01, 10_000)
        prof.node_share = shares
        plans = list(_pipelines(_measured(prof, net=fast)))
        assert {p.options["partitions"]: p.options.get("schedule", "1f1b") for p in plans} == want, plans
        for p in plans:
            assert p.step_s == pytest.approx(sum(p.breakdown.values())) and p.breakdown["bubble"] >= 0
