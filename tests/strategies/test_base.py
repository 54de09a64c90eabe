"""strategies.base: typed strategy options (unknown and bad ones refused with FitError on every rank
before any message) and fit's one pair of stall keywords with their deprecated spellings."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn

from mpitrain._utils.stall import StallPolicy
from mpitrain.fit import STRATEGIES, FitError, FitSpec, fit, stall_policy
from mpitrain.strategies.base import StrategyOptions, is_int
from mpitrain.strategies.data_parallel import DataOptions
from mpitrain.strategies.pipesgd import LinkEmulation, PipeSGDOptions
from tests.helpers import assert_all_ranks

BATCH = 12  # divisible by 2, 3 and 4 ranks


@dataclass(frozen=True)
class RoundsOptions(StrategyOptions):
    strategy: ClassVar[str] = "rounds"
    rounds: int = 1
    mode: str = "ring"

    def __post_init__(self) -> None:
        self.require("rounds", is_int(self.rounds) and self.rounds >= 1, "an int >= 1")


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)) for _ in range(steps)]


# -- StrategyOptions ----------------------------------------------------------------------------------
def test_options_take_defaults_and_given_values_and_summarise_them_for_the_cross_rank_check():
    opts = RoundsOptions.from_spec(FitSpec(strategy="rounds", options={"rounds": 3}))
    assert (opts.rounds, opts.mode) == (3, "ring")
    assert RoundsOptions.names() == ("rounds", "mode")
    assert opts.signature() == (("rounds", "3"), ("mode", "'ring'"))


def test_unknown_option_raises_fit_error_listing_the_known_ones():
    with pytest.raises(FitError, match=r"does not take option\(s\) \['round'\]; it takes \['rounds', 'mode'\]"):
        RoundsOptions.from_spec(FitSpec(strategy="rounds", options={"round": 3}))


@pytest.mark.parametrize("value", [0, 1.5, True, "2"])
def test_bad_value_raises_fit_error_naming_option_and_expectation(value):
    with pytest.raises(FitError, match=r"strategy 'rounds': option rounds=.*: expected an int >= 1"):
        RoundsOptions(rounds=value)


@pytest.mark.parametrize("options", [{"staleness": 0}, {"staleness": 1.0}, {"warmup_steps": -1},
                                     {"compression": "zip"}, {"chunk_bytes": 0}, {"error_feedback": 1},
                                     {"emulate_link": (1.0,)}, {"emulate_link": (1.0, -1.0)}])
def test_pipe_sgd_bad_option_raises_fit_error(options):
    with pytest.raises(FitError, match="pipe-sgd"):
        PipeSGDOptions.from_spec(FitSpec(strategy="pipe-sgd", options=options))


def test_pipe_sgd_link_pair_becomes_a_link_emulation():
    opts = PipeSGDOptions.from_spec(FitSpec(strategy="pipe-sgd", options={"emulate_link": [1e-3, 0]}))
    assert opts.link == LinkEmulation(1e-3, 0.0)


@pytest.mark.parametrize("options", [{"bucket_mb": 0}, {"kvstore": "nccl"}, {"kvstore": 3}, {"overlap": "yes"}])
def test_data_bad_option_raises_fit_error(options):
    with pytest.raises(FitError, match="strategy 'data'"):
        DataOptions.from_spec(FitSpec(strategy="data", options=options))


# -- fit's stall keywords -----------------------------------------------------------------------------
_SEEN: list[FitSpec] = []


def recording_factory(model, loss_fn, optimizer, comm, spec):
    """strategy "data", recording the FitSpec that fit built."""
    from mpitrain.strategies.data_parallel import make_trainer

    _SEEN.append(spec)
    return make_trainer(model, loss_fn, optimizer, comm, spec)


def _recorded_spec(monkeypatch, **kwargs) -> tuple[FitSpec, list[list[float]]]:
    """fit(strategy="data") on one rank with `kwargs`: the FitSpec the strategy got, the trained weights."""
    monkeypatch.setitem(STRATEGIES, "recorded", "tests.strategies.test_base:recording_factory")
    _SEEN.clear()
    result = fit(_model(), _data(), nn.functional.cross_entropy, _sgd, strategy="recorded", progress=False,
                 kvstore="local", **kwargs)
    weights = [p.detach().reshape(-1).tolist() for p in result.model.parameters()]
    return _SEEN[0], weights


def test_fit_builds_one_stall_policy_from_warn_after_and_abort_after(monkeypatch):
    spec, _ = _recorded_spec(monkeypatch, warn_after=5.0, abort_after=None)
    assert spec.stall == StallPolicy(warn_after=5.0, abort_after=None)
    assert dict(spec.options) == {"kvstore": "local"}


@pytest.mark.parametrize("old, new", [("stall_timeout", "warn_after"), ("stall_warning_s", "warn_after"),
                                      ("stall_abort", "abort_after")])
def test_deprecated_stall_name_warns_and_behaves_as_the_new_one(monkeypatch, old, new):
    value = 70.0
    with pytest.warns(DeprecationWarning, match=f"option '{old}' is deprecated.*use '{new}'") as record:
        spec_old, weights_old = _recorded_spec(monkeypatch, **{old: value})
    assert record[0].filename == __file__  # attributed to the caller of fit
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        spec_new, weights_new = _recorded_spec(monkeypatch, **{new: value})
    assert spec_old == spec_new and getattr(spec_new.stall, new) == value
    assert weights_old == weights_new


def test_stall_value_given_twice_or_out_of_range_raises_fit_error():
    with pytest.raises(FitError, match="given twice"), pytest.warns(DeprecationWarning):
        fit(_model(), _data(), nn.functional.cross_entropy, _sgd, progress=False, warn_after=5.0,
            stall_timeout=6.0)
    with pytest.raises(FitError, match="give only 'warn_after'"), pytest.warns(DeprecationWarning):
        fit(_model(), _data(), nn.functional.cross_entropy, _sgd, progress=False, stall_timeout=5.0,
            stall_warning_s=6.0)
    with pytest.raises(FitError, match="abort_after must be None or >= warn_after"):
        fit(_model(), _data(), nn.functional.cross_entropy, _sgd, progress=False, warn_after=10.0, abort_after=1.0)
    with pytest.raises(FitError, match="warn_after must be a number"):
        fit(_model(), _data(), nn.functional.cross_entropy, _sgd, progress=False, warn_after="soon")


def test_stall_policy_helper_is_what_fit_uses():
    rest: dict[str, object] = {"staleness": 2, "warn_after": 5.0}
    assert stall_policy(60.0, 600.0, rest) == StallPolicy(5.0, 600.0) and rest == {"staleness": 2}


# -- every rank, before any message -------------------------------------------------------------------
class _Counting:
    """The real communicator, recording every method fetched from it (all that communicate go through
    here), to show that a refusal came before any of them."""

    def __init__(self, comm) -> None:
        self._comm, self.calls = comm, []

    def __getattr__(self, name: str):
        value = getattr(self._comm, name)
        if callable(value) and not name.startswith("_"):
            self.calls.append(name)
        return value


@pytest.mark.mpi
@pytest.mark.parametrize("strategy, options, match", [
    ("data", {"staleness": 2}, r"does not take option\(s\) \['staleness'\]; it takes \['kvstore'"),
    ("data", {"bucket_mb": -1}, "bucket_mb"),
    ("pipe-sgd", {"lr": 0.1}, r"does not take option\(s\) \['lr'\]; it takes \['staleness'"),
    ("pipe-sgd", {"staleness": 0}, "staleness=0"),
    ("pipe-sgd", {"compression": "zip"}, "unknown compression"),
    ("data", {"warn_after": 0}, "warn_after must be > 0"),
])
def test_bad_option_raises_fit_error_on_every_rank_before_any_message(comm, strategy, options, match):
    counting = _Counting(comm)
    try:
        fit(_model(), _data(), nn.functional.cross_entropy, _sgd, strategy=strategy, progress=False,
            comm=counting, **options)
        verdict = "accepted"
    except FitError as e:
        import re
        verdict = "" if re.search(match, str(e)) else f"wrong message: {e}"
    assert_all_ranks(comm, not verdict and not counting.calls, f"{verdict}; calls before: {counting.calls}")
