"""Codecs: each encoding equals its reference bit operation / cast, and int8 stays within half a step."""

from __future__ import annotations

import pytest
import torch

from mpitrain.comm.base import CommError
from mpitrain.comm.codecs import CODECS, Int8Codec, get_codec

SPECIALS = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.1415927, -2.7182817, 1e-40, -1e-40, 1e30, -1e30,
                         float("inf"), float("-inf"), 65504.0, 1.17549435e-38])


def _data(n: int = 1000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g) * torch.logspace(-6, 6, n)


def _roundtrip(name, x):
    c = get_codec(name)
    out = torch.empty_like(x)
    return c.decode(c.encode(x), out)


def test_bf16_truncation_equals_masking_low_16_bits():
    x = torch.cat([_data(), SPECIALS, torch.tensor([float("nan")])])
    masked = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)
    assert torch.equal(_roundtrip("bf16", x).view(torch.int32), masked.view(torch.int32))


def test_bf16_rne_and_fp16_equal_torch_round_to_nearest_casts():
    x = torch.cat([_data(), SPECIALS])
    assert torch.equal(_roundtrip("bf16-rne", x), x.to(torch.bfloat16).float())
    assert torch.equal(_roundtrip("fp16", x), x.half().float())


@pytest.mark.parametrize("n", [1, 3, 4, 5, 999])
def test_int8_error_is_at_most_half_a_quantization_step(n):
    x = _data(n, seed=n)
    c = get_codec("int8")
    payload = c.encode(x)
    step = Int8Codec.scale_of(payload)
    assert step == pytest.approx(x.abs().max().item() / 127, rel=1e-6)
    err = (c.decode(payload, torch.empty_like(x)) - x).abs().max().item()
    assert err <= step / 2 * (1 + 1e-5)


def test_int8_zero_vector_is_exact_and_nonfinite_decodes_to_nan():
    assert torch.equal(_roundtrip("int8", torch.zeros(7)), torch.zeros(7))
    assert torch.isnan(_roundtrip("int8", torch.tensor([1.0, float("inf"), 2.0]))).all()


@pytest.mark.parametrize("name", list(CODECS))
def test_payload_is_one_contiguous_buffer_of_the_announced_size(name):
    c = get_codec(name)
    x = _data(37)
    before = x.clone()
    payload = c.encode(x.view(37, 1))
    assert payload.is_contiguous() and payload.dim() == 1
    assert payload.numel() == c.payload_numel(37) and payload.dtype == c.empty_payload(37).dtype
    assert torch.equal(x, before), "encode must not modify its input"
    # encoding into a preallocated buffer gives the same bits
    again = c.encode(x, out=c.empty_payload(37))
    assert torch.equal(again.view(torch.uint8) if again.dtype != torch.bfloat16 else again.view(torch.int16),
                       payload.view(torch.uint8) if payload.dtype != torch.bfloat16 else payload.view(torch.int16))


@pytest.mark.parametrize("name", list(CODECS))
def test_decode_add_equals_decode_then_add(name):
    c = get_codec(name)
    x, acc = _data(101, 1), _data(101, 2)
    payload = c.encode(x)
    expected = acc + c.decode(payload, torch.empty_like(acc))
    torch.testing.assert_close(c.decode_add(payload, acc.clone()), expected, atol=1e-6, rtol=1e-6)


def test_unknown_codec_and_wrong_dtype_raise_clear_errors():
    with pytest.raises(CommError, match="unknown compression"):
        get_codec("zip")
    with pytest.raises(CommError, match="float32"):
        get_codec("bf16").check_input(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(CommError, match="floating"):
        get_codec("int8").check_input(torch.zeros(3, dtype=torch.int64))
    assert get_codec("none") is get_codec(None) and get_codec(get_codec("fp16")).name == "fp16"
