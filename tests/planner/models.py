"""Tiny models for the planner's tests (seconds to calibrate)."""

from __future__ import annotations

import torch
from torch import nn


def tiny_cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def tiny_mlp(seed: int = 0, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4))


def cnn_batch(n: int = 12, hw: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, hw, hw, generator=g), torch.randint(0, 10, (n,), generator=g)


def mlp_batches(steps: int, n: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(n, 16, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,), generator=g))
            for _ in range(steps)]
