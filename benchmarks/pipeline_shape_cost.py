"""The cost of a new input shape in the pipeline (issue #25 item 2; docs/transformers.md).

GPT-2 and Llama from their default configs (4 layers x 128, vocabulary 2000, float32), the loop API
``Pipeline(P = world size, M = 4, balance="params")``, batches of 8 sequences with ``(B*T,)`` targets,
stepping over lengths 128 x3, 64 x3, 256 x3, 96 x3, 128, 64, 256: each length's first step (a new
shape signature: value metas propagated on fake tensors, receive buffers of the new sizes) against its
later steps (cached). Per step the slowest rank's wall time,
and the time spent in ``Shapes.meta`` (strategies/pipeline/_shapes.py).

    PYTHONPATH=. .venv/bin/mpitrain run -n 2 -- .venv/bin/python benchmarks/pipeline_shape_cost.py
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

import mpitrain
from mpitrain.strategies.pipeline import _shapes
from tests.strategies.pipeline.tiny_transformers import _transformers, lm_batches, lm_loss

ORDER = [128, 128, 128, 64, 64, 64, 256, 256, 256, 96, 96, 96, 128, 64, 256]
SPENT = [0.0]
_META = _shapes.Shapes.meta


def _timed_meta(self: Any, *args: Any, **kwargs: Any) -> Any:
    t0 = time.perf_counter()
    out = _META(self, *args, **kwargs)
    SPENT[0] += time.perf_counter() - t0
    return out


def model(name: str) -> torch.nn.Module:
    tf = _transformers()
    torch.manual_seed(0)
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=2000, n_layer=4, n_embd=128, n_head=4, n_positions=512))
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=2000, num_hidden_layers=4, hidden_size=128,
                                              num_attention_heads=4, num_key_value_heads=4, intermediate_size=256,
                                              max_position_embeddings=512))


def main() -> None:
    _shapes.Shapes.meta = _timed_meta  # type: ignore[method-assign]
    comm = mpitrain.init()
    for name in sys.argv[1:] or ["gpt2", "llama"]:
        batches = {n: lm_batches(8, 1, seed=n, lengths=(n,))[0] for n in set(ORDER)}
        batches = {n: (x, y.reshape(-1)) for n, (x, y) in batches.items()}
        pipe = mpitrain.Pipeline(model(name), partitions=comm.size, micro_batches=4, comm=comm, balance="params",
                                 example=batches[128][0])
        opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
        first: dict[int, tuple[float, float]] = {}
        cached: dict[int, list[float]] = {}
        for n in ORDER:
            comm.barrier()
            SPENT[0] = 0.0
            t0 = time.perf_counter()
            opt.zero_grad()
            pipe.step(*batches[n], lm_loss)
            opt.step()
            dt = max(comm.allgather_object(time.perf_counter() - t0))
            metas = max(comm.allgather_object(SPENT[0]))
            if n in first:
                cached.setdefault(n, []).append(dt)
            else:
                first[n] = (dt, metas)
        if comm.rank == 0:
            for n in sorted(first):
                dt, metas = first[n]
                print(f"{name} T={n}: first step {dt * 1e3:.1f} ms (metas {metas * 1e3:.1f} ms), "
                      f"cached median {statistics.median(cached[n]) * 1e3:.1f} ms over {len(cached[n])}", flush=True)


if __name__ == "__main__":
    main()
