"""Small models with the graph shapes the pipeline must handle, and the one-process reference."""

from __future__ import annotations

import copy

import torch
from torch import nn

from mpitrain.strategies._batching import chunks

__all__ = ["MLP", "ResNetish", "SkipTwice", "Inceptionish", "MODELS", "reference_train", "batches"]


class MLP(nn.Module):
    def __init__(self, d: int = 12, h: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, h),
                                 nn.ReLU(), nn.Linear(h, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    """Residual block: identity shortcut, or a 1x1 projection when the width or stride changes."""

    def __init__(self, cin: int, cout: int, stride: int = 1, bn: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=not bn)
        self.bn1 = nn.BatchNorm2d(cout) if bn else nn.Identity()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=not bn)
        self.bn2 = nn.BatchNorm2d(cout) if bn else nn.Identity()
        self.relu = nn.ReLU(inplace=True)
        self.proj = nn.Conv2d(cin, cout, 1, stride) if (cin != cout or stride != 1) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x if self.proj is None else self.proj(x)
        return self.relu(out)


class ResNetish(nn.Module):
    def __init__(self, classes: int = 5, bn: bool = True) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, 1, 1)
        self.blocks = nn.Sequential(Block(4, 4, bn=bn), Block(4, 8, 2, bn=bn), Block(8, 8, bn=bn))
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.blocks(torch.relu(self.stem(x)))
        return self.head(y.mean(dim=(2, 3)))


class SkipTwice(nn.Module):
    """`a` jumps over whole partitions and is read twice later; `idx` (int64) and `mask` (float, no
    grad) cross boundaries without partial errors; `x.size(0)` is a non-tensor the cut must avoid."""

    def __init__(self, d: int = 10, h: int = 12, classes: int = 5) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, h)
        self.l4, self.l5 = nn.Linear(h, h), nn.Linear(h, classes)
        self.emb = nn.Embedding(d, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx = x.argmax(dim=1)
        mask = (x[:, :1] > 0).float()
        a = torch.tanh(self.l1(x))
        b = torch.relu(self.l2(a))
        c = torch.tanh(self.l3(b)) * mask
        d = torch.relu(self.l4(c + a)) + self.emb(idx)
        return self.l5(d * a).view(x.size(0), -1)


class Inceptionish(nn.Module):
    """Three branches of one input joined by a concatenation, twice (Inception-like)."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.a1, self.b1, self.c1 = nn.Conv2d(1, 2, 1), nn.Conv2d(1, 3, 3, padding=1), nn.Conv2d(1, 2, 1)
        self.a2, self.b2 = nn.Conv2d(7, 4, 1), nn.Conv2d(7, 4, 3, padding=1)
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([self.a1(x), torch.relu(self.b1(x)), self.c1(nn.functional.max_pool2d(x, 3, 1, 1))], 1)
        z = torch.cat([torch.tanh(self.a2(y)), torch.relu(self.b2(y))], 1)
        return self.head(z.mean(dim=(2, 3)))


MODELS = {"mlp": (MLP, (12,)), "resnet": (ResNetish, (1, 8, 8)), "skip": (SkipTwice, (10,)),
          "inception": (Inceptionish, (1, 6, 6))}


def batches(shape: tuple[int, ...], n: int, steps: int, classes: int = 5, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn((n, *shape), generator=g), torch.randint(0, classes, (n,), generator=g))
            for _ in range(steps)]


def reference_train(model: nn.Module, data: list, optimizer, slices: int) -> nn.Module:
    """One process: each global batch as `slices` equal chunks in order (the per-micro-batch statistics
    BatchNorm sees in a pipeline), gradients accumulated over the mean of the chunk losses."""
    model = copy.deepcopy(model)
    opt = optimizer(model.parameters())
    loss_fn = nn.CrossEntropyLoss()
    for x, y in data:
        opt.zero_grad()
        for xc, yc in zip(chunks(x, slices), chunks(y, slices)):
            (loss_fn(model(xc), yc) / slices).backward()
        opt.step()
    return model
