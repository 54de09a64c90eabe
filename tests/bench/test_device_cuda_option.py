"""`mpitrain bench dataparallel|pipeline|spatial|fit --device cuda` says why and exits 2 where torch sees no GPU."""

from __future__ import annotations

import importlib

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the benchmark would run")
@pytest.mark.parametrize("bench", ["dataparallel", "pipeline", "spatial", "fit"])
def test_device_cuda_without_a_gpu_exits_2_saying_why(bench, capsys):
    main = importlib.import_module(f"mpitrain.bench.{bench}").main
    assert main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert f"mpitrain bench {bench} --device cuda: no CUDA device" in err and "drop --device cuda" in err


@pytest.mark.parametrize("bench", ["dataparallel", "pipeline", "spatial"])
def test_precisions_parse_to_a_list_and_refuse_an_unknown_one(bench, capsys):
    parse = importlib.import_module(f"mpitrain.bench.{bench}")._parse
    assert parse(["--precisions", "bf16"]).precisions == ["bf16"]
    assert parse([]).precisions == ["fp32", "bf16"]
    with pytest.raises(SystemExit) as e:
        parse(["--device", "cuda", "--precisions", "fp32,fp16"])
    assert e.value.code == 2 and "a comma list of fp32, bf16" in capsys.readouterr().err
