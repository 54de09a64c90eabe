"""The main job: a small CNN trained on scikit-learn's handwritten digits with `mpitrain.fit`.

``mpitrain demo --ranks 2`` (= ``make demo``) splits the CNN into 2 pipeline partitions
(strategy "model"); ``mpitrain demo --ranks 4 --strategy hybrid`` runs 2 replicas x 2 partitions.
The digits (1797 8x8 images) ship with scikit-learn, so nothing is downloaded. Every rank builds
the same data and model from the seed; the run is reproducible and ends with the held-out accuracy
and the training throughput, printed by rank 0. Exit status 1 if the accuracy misses its target.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator, Sequence

import torch
from torch import nn

__all__ = ["main", "DigitsCNN", "digits", "Batches"]

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


class Batches:
    """Global mini-batches, reshuffled each epoch from the seed (so identical on every rank); with
    `drop_last` the last incomplete batch is skipped so every batch splits into equal micro-batches."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, size: int, seed: int | None,
                 drop_last: bool) -> None:
        self.x, self.y, self.size, self.seed, self.drop_last = x, y, size, seed, drop_last
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.y) // self.size if self.drop_last else -(-len(self.y) // self.size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = len(self.y)
        if self.seed is None:
            order = torch.arange(n)
        else:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        self.epoch += 1
        for i in range(len(self)):
            idx = order[i * self.size:(i + 1) * self.size]
            yield self.x[idx], self.y[idx]


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
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    import mpitrain
    from mpitrain.fit import fit

    args = parse(argv or [])
    comm = mpitrain.init()
    torch.manual_seed(args.seed)
    model = DigitsCNN()
    train_x, train_y, test_x, test_y = digits(args.seed)
    pipelined = args.strategy in ("model", "hybrid")
    t0 = time.perf_counter()
    result = fit(model, Batches(train_x, train_y, args.batch_size, args.seed, drop_last=True),
                 nn.CrossEntropyLoss(), lambda ps: torch.optim.Adam(ps, lr=args.lr), strategy=args.strategy,
                 epochs=args.epochs, eval_data=Batches(test_x, test_y, 168, None, drop_last=False),
                 metrics=["accuracy"], progress=not args.no_progress,
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
    return 0 if ok else 1


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
