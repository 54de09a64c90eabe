"""A torchvision CNN from its default constructor (ShuffleNetV2 x0.5: each unit splits its channels,
passes one half around its branch and concatenates and shuffles them, so halves skip across
partitions; BatchNorm everywhere) through the model and hybrid strategies, against one process:
parameters and BatchNorm statistics after 2 SGD steps in float64, under the zero-bubble schedules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpitrain.fit import fit
from mpitrain.spatial.models import torchvision_module
from tests.helpers import assert_close_all_ranks

from .models import batches, reference_train

STEPS, ROWS = 2, 2  # rows per micro-batch: 64x64 images leave conv5 2x2 maps, 8 values per BatchNorm channel


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def layouts(size: int) -> list[tuple[int, int]]:
    """(P, R): the whole pipeline, and 2 x 2 on four ranks."""
    return [(size, 1)] + ([(2, size // 2)] if size == 4 else [])


@pytest.mark.mpi
@pytest.mark.parametrize("schedule", ["zb1p", "zbv"])
def test_torchvision_shufflenet_parameters_after_2_steps_equal_one_process(comm, schedule):
    shufflenet = torchvision_module("models.shufflenetv2")
    for P, R in layouts(comm.size):
        torch.manual_seed(0)
        model = shufflenet.shufflenet_v2_x0_5(num_classes=10).double()
        data = [(x.double(), y) for x, y in batches((3, 64, 64), R * P * ROWS, STEPS, classes=10, seed=P + R)]
        want = reference_train(model, data, sgd, R * P)
        got = fit(model, data, nn.CrossEntropyLoss(), sgd, strategy="model" if R == 1 else "hybrid", partitions=P,
                  micro_batches=P, schedule=schedule, progress=False, balance="params").model
        for (name, a), b in zip(got.named_parameters(), want.parameters()):
            # replicas average gradients in another order than one process sums micro-batches: 1e-10 seen
            assert_close_all_ranks(comm, a.detach(), b.detach(), atol=1e-9, what=f"{schedule} P={P} R={R}: {name}")
        if R == 1:  # BatchNorm statistics per micro-batch, in order, as the reference's slices
            for (name, a), b in zip(got.named_buffers(), want.buffers()):
                assert_close_all_ranks(comm, a.double(), b.double(), atol=1e-10, what=f"{schedule} P={P}: {name}")
