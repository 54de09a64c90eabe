"""`fit(strategy="spatial")` with dense targets (a segmentation output N x C x H x W, targets N x H x W)
equals one process: the loss runs on blocks (a torchvision-style criterion over the model's dict of
outputs, cross-entropy with ignore_index and class weights), with uneven batches (4, 4, 1: a batch
smaller than the sample groups); RegionSamples reads each rank's block of the targets only; a loss that needs
whole samples falls back to gathering them, warned, and stays exact."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpitrain.fit import fit
from mpitrain.spatial import RegionSamples
from tests.helpers import assert_all_ranks
from tests.spatial.test_runs import ImageRegions, epoch_batches, expected_reads, same_state, sgd
from tests.spatial.test_trainer import hybrid_layouts

pytestmark = pytest.mark.mpi

N, B, H, W, CLASSES, IGNORE = 9, 4, 12, 10, 3, 255
WEIGHTS = torch.tensor([0.5, 2.0, 1.0], dtype=torch.float64)


class TinySeg(nn.Module):
    """A segmentation net shaped like torchvision's: a strided body, a pooled branch resized back to the
    feature map, a classifier and an auxiliary one, both resized to the input's size
    (``F.interpolate(size=x.shape[-2:])``), returned as ``{"out": ..., "aux": ...}``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(2, 4, 3, 2, 1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                                  nn.Conv2d(4, 4, 3, 1, 2, dilation=2, bias=False), nn.BatchNorm2d(4), nn.ReLU())
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(4, 2, 1), nn.ReLU())
        self.head, self.aux = nn.Conv2d(6, CLASSES, 1), nn.Conv2d(4, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        size = x.shape[-2:]
        f = self.body(x)
        p = F.interpolate(self.pool(f), size=f.shape[-2:], mode="bilinear", align_corners=False)
        out = F.interpolate(self.head(torch.cat([f, p], 1)), size=size, mode="bilinear", align_corners=False)
        return {"out": out, "aux": F.interpolate(self.aux(f), size=size, mode="bilinear", align_corners=False)}


def criterion(inputs: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """torchvision's references/segmentation criterion, with class weights on the main output."""
    out = F.cross_entropy(inputs["out"], target, weight=WEIGHTS, ignore_index=IGNORE)
    return out + 0.5 * F.cross_entropy(inputs["aux"], target, ignore_index=IGNORE)


def needs_whole_samples(inputs: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    """A per-pixel mean written on flattened pixels (flatten(2) merges the split dims: not spatial)."""
    return F.cross_entropy(inputs["out"].flatten(2), target.flatten(1).clamp(max=CLASSES - 1))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N, 2, H, W, generator=g, dtype=torch.float64)
    labels = torch.randint(0, CLASSES, (N, H, W), generator=g)
    labels[::2, : H // 3] = IGNORE  # unevenly ignored: some blocks and groups ignore more pixels
    labels[1, :, W - 3:] = IGNORE
    return x, labels


class LabelRegions(ImageRegions):
    """N x H x W label maps read by region (records every read)."""

    @property
    def sample_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    def read(self, index: int, region: tuple[slice, slice]) -> torch.Tensor:
        self.reads.append((int(index), (region[0].start, region[0].stop), (region[1].start, region[1].stop)))
        return self.x[index, region[0], region[1]].clone()


def reference(loss_fn, epochs: int) -> tuple[nn.Module, list[float]]:
    """One process over fit's batches (shuffled by the documented order rule): one step per batch."""
    model, (x, y) = TinySeg().double(), data()
    opt, history = sgd(model.parameters()), []
    for batches in epoch_batches(epochs):
        total = 0.0
        for b in batches:
            opt.zero_grad()
            loss = loss_fn(model(x[b]), y[b])
            loss.backward()
            opt.step()
            total += loss.item() * len(b)
        history.append(total / N)
    return model, history


def _fit(comm, which: int, dataset, loss_fn, epochs: int, **kw):
    grid, samples = hybrid_layouts(comm.size)[which]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fit(TinySeg().double(), dataset, loss_fn, sgd, strategy="spatial", grid=grid, samples=samples,
                     batch_size=B, epochs=epochs, progress=False, **kw)
    return result, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)], (grid, samples)


@pytest.mark.parametrize("which, targets", [(0, "regions"), (1, "regions"), (1, "tensor")],
                         ids=["spatial-regions", "hybrid-regions", "hybrid-tensor"])
def test_dense_targets_train_on_blocks_as_one_process_reading_only_each_ranks_block(comm, which, targets):
    x, labels = data()
    images, label_maps = ImageRegions(x), LabelRegions(labels)
    dataset = RegionSamples(images, labels if targets == "tensor" else label_maps)
    result, warned, (grid, samples) = _fit(comm, which, dataset, criterion, epochs=1,
                                           eval_data=[(x[:3], labels[:3])])  # eval: outputs gathered, a dict
    ref, history = reference(criterion, 1)
    with torch.no_grad():
        eval_loss = criterion(ref.eval()(x[:3]), labels[:3]).item()
    what = f"grid {grid} x{samples}, targets {targets}"
    assert_all_ranks(comm, abs(result.history[-1]["eval_loss"] - eval_loss) < 1e-10,
                     f"{what}: eval loss {result.history[-1]['eval_loss']} vs {eval_loss}")
    same_state(comm, result.model.state_dict(), ref.state_dict(), 1e-10, what)
    assert_all_ranks(comm, all(abs(h["loss"] - e) < 1e-10 for h, e in zip(result.history, history)),
                     f"{what}: losses {[h['loss'] for h in result.history]} vs {history}")
    assert_all_ranks(comm, not warned, f"{what}: warned {warned}")  # nothing redistributed or gathered
    if targets == "regions":
        expected = expected_reads(comm, samples, grid, 1, regions=True)
        assert_all_ranks(comm, label_maps.reads == expected, f"{what}: target reads {label_maps.reads}")


def test_a_loss_needing_whole_samples_falls_back_to_gathering_them_and_equals_one_process(comm):
    x, labels = data()
    result, warned, layout = _fit(comm, 1, RegionSamples(ImageRegions(x), labels), needs_whole_samples, 1)
    ref, history = reference(needs_whole_samples, 1)
    same_state(comm, result.model.state_dict(), ref.state_dict(), 1e-10, f"layout {layout}")
    assert_all_ranks(comm, abs(result.history[0]["loss"] - history[0]) < 1e-10, f"{result.history} vs {history}")
    assert_all_ranks(comm, sum("needs whole samples" in w for w in warned) == 1, f"warnings {warned}")
