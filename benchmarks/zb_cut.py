"""Where ``balance="time"`` cuts the benchmark's GPT-2 (issue #28): build ``fit``'s pipeline trainer for one
schedule at P = world size, run one step, print the cut (``trainer.pipe.bounds``). Run it repeatedly,
alternated with main's source on ``PYTHONPATH``, to see how far the machine's load moves the cut.

    PYTHONPATH=src .venv/bin/mpitrain run -n 2 -- .venv/bin/python benchmarks/zb_cut.py zb1p [--gpt-...]
"""

from __future__ import annotations

import sys

import torch

from mpitrain.bench.pipeline import _gpt2, _lm_loss, _parse, _sgd
from mpitrain.runtime import init
from mpitrain.strategies.base import FitSpec
from mpitrain.strategies.pipeline._trainer import make_trainer


def main() -> None:
    schedule = sys.argv[1] if len(sys.argv) > 1 else "zb1p"
    comm = init()
    args = _parse(sys.argv[2:])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.gpt_vocab, (args.gpt_batch, args.gpt_seq), generator=g)
    labels = torch.randint(0, args.gpt_vocab, (args.gpt_batch, args.gpt_seq), generator=g)
    spec = FitSpec(strategy="model", partitions=comm.size, micro_batches=args.gpt_micro, schedule=schedule,
                   balance="time")
    trainer = make_trainer(_gpt2(args), _lm_loss, _sgd, comm, spec)
    trainer.train_step(ids, labels)
    if comm.rank == 0:
        print(f"{schedule} cut {trainer.pipe.bounds}")


if __name__ == "__main__":
    main()
