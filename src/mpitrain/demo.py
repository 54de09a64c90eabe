"""The main job: a small CNN trained on scikit-learn's handwritten digits with `mpitrain.fit`.

``mpitrain demo --ranks 2`` splits the CNN into 2 pipeline partitions (strategy "model");
``mpitrain demo --ranks 4 --strategy hybrid`` runs 2 replicas x 2 partitions; ``make demo`` runs
``--strategy data --checkpoint``: each rank reads its own rows of the training Dataset, a sharded
checkpoint is written every 50 steps, and rank 0 checks that ``mpitrain.load_checkpoint`` of the last
one holds the trained weights. The digits (1797 8x8 images) ship with scikit-learn, so nothing is
downloaded. Every rank builds the same data and model from the seed; the run is reproducible and ends
with the held-out accuracy and the training throughput, printed by rank 0. Exit status 1 if the
accuracy misses its target (or the checkpoint does not hold the trained weights).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mpitrain

__all__ = ["main", "DigitsCNN", "digits"]

TARGET_ACCURACY = 0.95


class DigitsCNN(nn.Module):
    """Three 3x3 convolutions and two dense layers: 8x8x1 -> 10 classes."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.conv3 = nn.Conv2d(2 * width, 2 * width, 3, padding=1)
        self.fc1 = nn.Linear(2 * width * 16, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv2(torch.relu(self.conv1(x)))))
        x = torch.relu(self.conv3(x))
        out: torch.Tensor = self.fc2(torch.relu(self.fc1(torch.flatten(x, 1))))
        return out


def digits(seed: int, held_out: int = 336) -> tuple[torch.Tensor, ...]:
    """(train_x, train_y, test_x, test_y): images scaled to [0, 1], a fixed seeded split. 336 held-out
    images = 2 evaluation batches of 168, which every strategy splits evenly on 1-4, 6 or 8 ranks."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[:held_out], order[held_out:]
    return x[train], y[train], x[test], y[test]


def _partitions(strategy: str, size: int, partitions: int | None) -> int:
    if strategy == "data":
        return 1
    if strategy == "hybrid":
        return partitions or (2 if size % 2 == 0 else size)
    return partitions or size


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mpitrain demo", description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="model", help="model | hybrid | data")
    p.add_argument("--partitions", type=int, default=None, help="pipeline partitions (default: all ranks, "
                                                                "or 2 for hybrid)")
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", action="store_true", help="write sharded checkpoints (to --checkpoint-dir, "
                                                               "else a temporary directory removed at the end)")
    p.add_argument("--checkpoint-dir", default=None, help="checkpoint directory (implies --checkpoint)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="optimizer steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(list(argv))


def _checkpoint_dir(args: argparse.Namespace, comm: mpitrain.Communicator) -> tuple[str | None, bool]:
    """(directory, whether the demo made it and removes it): rank 0's temporary directory, shared."""
    if args.checkpoint_dir is not None:
        return args.checkpoint_dir, False
    if not args.checkpoint:
        return None, False
    made = tempfile.mkdtemp(prefix="mpitrain-demo-") if comm.rank == 0 else None
    return comm.broadcast_object(made), True


def _matches_checkpoint(model: nn.Module, directory: str) -> bool:
    """`mpitrain.load_checkpoint` of the latest checkpoint holds `model`'s weights (one process, no MPI)."""
    saved = mpitrain.load_checkpoint(directory)
    return saved.keys() == model.state_dict().keys() and all(
        torch.equal(saved[k], v) for k, v in model.state_dict().items())


def main(argv: Sequence[str] | None = None) -> int:
    from mpitrain.fit import fit

    args = parse(argv or [])
    comm = mpitrain.init()
    torch.manual_seed(args.seed)
    model = DigitsCNN()
    train_x, train_y, test_x, test_y = digits(args.seed)
    pipelined = args.strategy in ("model", "hybrid")
    directory, temporary = _checkpoint_dir(args, comm)
    t0 = time.perf_counter()
    result = fit(model, TensorDataset(train_x, train_y), nn.CrossEntropyLoss(),
                 lambda ps: torch.optim.Adam(ps, lr=args.lr), strategy=args.strategy, batch_size=args.batch_size,
                 seed=args.seed, epochs=args.epochs,
                 eval_data=DataLoader(TensorDataset(test_x, test_y), batch_size=168),
                 metrics=["accuracy"], progress=not args.no_progress, checkpoint_dir=directory,
                 checkpoint_every=args.checkpoint_every if directory else None, resume=args.resume,
                 partitions=_partitions(args.strategy, comm.size, args.partitions),
                 micro_batches=args.micro_batches if pipelined else 1, schedule=args.schedule if pipelined else "1f1b")
    elapsed = time.perf_counter() - t0
    last = result.history[-1]
    rate = statistics.median(h["samples_per_s"] for h in result.history)
    ok = last["eval_accuracy"] >= TARGET_ACCURACY
    if comm.rank == 0:
        print(f"\ndigits CNN, strategy={args.strategy} on {comm.size} ranks, {args.epochs} epochs in "
              f"{elapsed:.1f}s")
        print(f"held-out accuracy: {last['eval_accuracy']:.4f} on {len(test_y)} images "
              f"(target >= {TARGET_ACCURACY}: {'met' if ok else 'MISSED'})")
        print(f"training throughput: {rate:.0f} images/s (median over epochs; epoch 1 includes set-up)")
        if directory is not None:
            same = _matches_checkpoint(result.model, directory)
            ok = ok and same
            steps = sorted(int(p.name[len("step-"):]) for p in Path(directory).glob("step-*"))
            print(f"{len(steps)} checkpoints (steps {steps[0]}..{steps[-1]}) in {directory}; load_checkpoint of "
                  f"the last holds the trained weights: {'yes' if same else 'NO'}")
            if temporary:
                shutil.rmtree(directory, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
