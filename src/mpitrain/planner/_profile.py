"""Compute calibration of one model: what the planner's cost models need, measured on this rank.

Every rank measures its own share at the same time as the others (so the machine's contention between
ranks is in the numbers), then the ranks agree: every measured time is replaced by its maximum over
ranks (the slowest rank bounds a synchronous step), so every rank holds the identical profile.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..comm.base import Communicator
from ..perf.calibrate import best_time
from ..perf.spatial import ConvShape, conv_shapes
from ..strategies import rows, samples, target_rows
from ..strategies.base import Batch, LossFn
from ._types import PlanError

__all__ = ["ModelProfile", "measure_model", "model_signature", "agree", "cache_path", "load_cached", "store",
           "profile_to_dict", "profile_from_dict"]


@dataclass
class ModelProfile:
    """Measured and derived quantities of one model on one global batch (seconds, bytes).

    `step_at`: (samples, seconds of forward + loss + backward of the whole model on that many samples),
    two sizes: the compute of any share is the affine fit through them. `forward_share`: the part of it
    that is forward. `nodes`: the captured graph's compute nodes, each with its share of the step time,
    its output bytes per sample and its parameter bytes; `cuts`: where the graph may be cut (empty
    when the capture failed, `capture_error` says why). `convs`: every Conv2d's global shape.
    `switch_points`: (node index, module name, input height) of every node at which the spatial
    strategy's ``switch_at`` can move to sample parallelism (see :func:`switch_points`)."""

    batch: int
    step_at: list[tuple[float, float]]
    forward_share: float
    param_bytes: int
    activation_bytes_per_sample: float
    output_bytes_per_sample: float
    input_shape: tuple[int, ...] | None
    node_share: list[float] = field(default_factory=list)
    node_bytes_per_sample: list[float] = field(default_factory=list)
    node_param_bytes: list[int] = field(default_factory=list)
    node_is_conv: list[bool] = field(default_factory=list)
    crossing_bytes_per_sample: list[float] = field(default_factory=list)
    cuts: list[int] = field(default_factory=list)
    capture_error: str = ""
    convs: list[ConvShape] = field(default_factory=list)
    spatial_error: str = ""
    switch_points: list[tuple[int, str, int]] = field(default_factory=list)

    def step_s(self, samples: float) -> float:
        """Seconds of forward + backward of the whole model on `samples` (fractional: a block of pixels)."""
        (n0, t0), (n1, t1) = self.step_at[0], self.step_at[-1]
        slope = (t1 - t0) / (n1 - n0) if n1 != n0 else t1 / n1
        return max(t0 + slope * (samples - n0), 0.0) if n1 != n0 else slope * samples

    def times(self) -> list[float]:
        """Every measured time, in a fixed order (what the ranks agree on)."""
        return [t for _, t in self.step_at] + [self.forward_share] + self.node_share

    def with_times(self, times: Sequence[float]) -> ModelProfile:
        k = len(self.step_at)
        out = copy.copy(self)
        out.step_at = [(n, t) for (n, _), t in zip(self.step_at, times[:k])]
        out.forward_share = times[k]
        out.node_share = list(times[k + 1:])
        return out


def _inputs_targets(sample_batch: tuple[Batch, torch.Tensor]) -> tuple[Batch, torch.Tensor]:
    inputs, targets = sample_batch
    return inputs, targets


def _call(model: nn.Module, inputs: Batch) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _timed_step(model: nn.Module, loss_fn: LossFn, inputs: Batch, targets: torch.Tensor,
                repeats: int) -> tuple[float, float]:
    """(seconds of forward+loss+backward, seconds of forward+loss) on this batch, best of `repeats`."""
    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(_call(model, inputs), targets).backward()

    def forward() -> None:
        with torch.no_grad():
            loss_fn(_call(model, inputs), targets)

    return best_time(step, repeats), best_time(forward, repeats)


def _node_profile(model: nn.Module, inputs: Batch, samples: int, prof: ModelProfile, passes: int) -> None:
    """Fill the per-node fields from the pipeline strategy's capture and per-node measurement."""
    from ..strategies import pipeline as _graph  # the one capture of a model into nodes (pipeline's)

    try:
        traced = _graph.capture(model, inputs)
        args = _graph.model_args(traced, inputs)
        meta = _graph.profile(traced, args)
        seconds = _graph.measure(traced, args, passes)
    except Exception as e:  # capture raises TraceFailure; running a captured graph may raise anything
        prof.capture_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return
    total = sum(seconds) or 1.0
    prof.node_share = [s / total for s in seconds]
    index = {n.name: i for i, n in enumerate(traced.nodes)}
    nbytes = []
    for n in traced.nodes:
        m = meta.get(n.name)
        nbytes.append(0.0 if m is None else float(torch.Size(m.shape).numel() * m.dtype.itemsize) / samples)
    prof.node_bytes_per_sample = nbytes
    prof.node_param_bytes = [int(c) * 4 for c in _graph.param_counts(traced)]
    prof.node_is_conv = [n.op == "call_module" and isinstance(traced.gm.get_submodule(str(n.target)), nn.Conv2d)
                         for n in traced.nodes]
    local = _graph.local_nodes(traced, meta)
    last = {n.name: max((index.get(u.name, len(traced.nodes)) for u in n.users), default=-1) for n in traced.nodes}
    prof.crossing_bytes_per_sample = [
        sum(nbytes[i] for i, n in enumerate(traced.nodes[:c]) if n.name not in local and last[n.name] >= c)
        for c in range(len(traced.nodes) + 1)]
    prof.cuts = _graph.cut_points(traced, meta)
    prof.switch_points = switch_points(traced, meta, prof.cuts, last, local)


def switch_points(traced: Any, meta: dict[str, Any], cuts: Sequence[int], last: dict[str, int],
                  local: set[str]) -> list[tuple[int, str, int]]:
    """(index, module name, input height) of each cut at which ``switch_at`` can move to sample
    parallelism: one value crosses the cut, an NCHW activation still split spatially (height and
    width above one: not after a global pool), and a submodule called once (fx's module stack) runs
    exactly the nodes from the cut on to its end and holds every use of that value, so wrapping it
    moves every use (a residual block, not the conv inside it whose block also adds its input).
    The innermost such module is named."""
    nodes = traced.nodes
    index = {n.name: i for i, n in enumerate(nodes)}

    def stack(n: Any) -> list[tuple[str, str]]:
        return [(key, str(value[0])) for key, value in (n.meta.get("nn_module_stack") or {}).items()]

    span: dict[str, tuple[int, int]] = {}
    for i, n in enumerate(nodes):
        for key, _ in stack(n):
            lo, hi = span.get(key, (i, i))
            span[key] = (min(lo, i), max(hi, i))
    placeholders = {p.name for p in traced.placeholders}
    out = []
    for c in cuts:
        crossing = [n for n in nodes[:c] if n.name not in local and last[n.name] >= c]
        m = meta.get(crossing[0].name) if len(crossing) == 1 else None
        if m is None or len(m.shape) != 4 or min(m.shape[2:]) < 2:
            continue
        users = [index.get(u.name, len(nodes)) for u in crossing[0].users]
        for key, name in reversed(stack(nodes[c])):  # innermost first
            lo, hi = span[key]
            inside = nodes[lo:hi + 1]
            if ("@" in key or lo != c or not all(lo <= u <= hi for u in users)
                    or not all(key in dict(stack(n)) for n in inside)
                    or any(a.name in placeholders for n in inside for a in n.all_input_nodes)):
                continue
            out.append((c, name, int(m.shape[2])))
            break
    return out


def measure_model(model: nn.Module, loss_fn: LossFn, sample_batch: tuple[Batch, torch.Tensor], shares: Sequence[int],
                  repeats: int = 3) -> ModelProfile:
    """Measure `model` on this rank: the whole step at the sample counts `shares` (the smallest and
    the largest are kept), the per-node split on the largest, activation bytes, conv shapes. Local
    (no message); runs on a copy, so `model`, its gradients and buffers are untouched."""
    inputs, targets = _inputs_targets(sample_batch)
    batch = samples(inputs, targets)  # the inputs' dim 0; targets may hold k rows per sample
    work = copy.deepcopy(model)
    work.train()
    sizes = sorted({max(1, min(int(s), batch)) for s in shares})
    sizes = [sizes[0], sizes[-1]]
    step_at, fwd_share = [], 0.0
    for n in dict.fromkeys(sizes):
        x, y = rows(inputs, 0, n), target_rows(targets, batch, 0, n)
        with torch.random.fork_rng(devices=[]):
            full, fwd = _timed_step(work, loss_fn, x, y, repeats)
        step_at.append((float(n), full))
        fwd_share = min(fwd / full, 1.0) if full > 0 else 0.5
    if len(step_at) == 1:
        step_at.append(step_at[0])
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    n = sizes[-1]
    x = rows(inputs, 0, n)
    out_bytes, act = _activation_bytes(work, x)
    input_shape = tuple(inputs.shape) if isinstance(inputs, torch.Tensor) else None
    prof = ModelProfile(batch=batch, step_at=step_at, forward_share=fwd_share, param_bytes=param_bytes,
                        activation_bytes_per_sample=act / n, output_bytes_per_sample=out_bytes / n,
                        input_shape=input_shape)
    with torch.random.fork_rng(devices=[]):
        _node_profile(work, x, n, prof, repeats)
    if input_shape is not None and len(input_shape) == 4:
        try:
            prof.convs = conv_shapes(model, input_shape)
        except Exception as e:  # a model that does not run on the meta device: no halo costs known
            prof.spatial_error = f"its conv shapes could not be inferred ({type(e).__name__})"
    else:
        prof.spatial_error = "its input is not one NCHW tensor"
    return prof


def _activation_bytes(model: nn.Module, inputs: Batch) -> tuple[float, float]:
    """(output bytes, bytes of every leaf module's output) of one forward: what backward keeps alive."""
    total = [0.0]

    def hook(_m: nn.Module, _a: object, out: object) -> None:
        if isinstance(out, torch.Tensor):
            total[0] += out.numel() * out.element_size()

    handles = [m.register_forward_hook(hook) for m in model.modules() if next(m.children(), None) is None]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            was = model.training
            model.eval()
            out = _call(model, inputs)
            model.train(was)
    finally:
        for h in handles:
            h.remove()
    out_bytes = float(out.numel() * out.element_size()) if isinstance(out, torch.Tensor) else 0.0
    return out_bytes, total[0]


def agree(comm: Communicator, prof: ModelProfile) -> ModelProfile:
    """The profile every rank holds after this collective: each measured time replaced by its maximum
    over the ranks of `comm` (every rank must call, with profiles of the same model; PlanError on every rank
    when their graphs differ: one small allgather first)."""
    if comm.size == 1:
        return prof
    counts = comm.allgather_object(len(prof.times()))
    if len(set(counts)) > 1:  # an allreduce of different lengths would fail inside MPI (MPI_ERR_TRUNCATE)
        raise PlanError(f"plan: the ranks captured different graphs of the model ({counts} measured times per "
                        f"rank): its forward must run the same code on every rank, not branch on the rank")
    times = torch.tensor(prof.times(), dtype=torch.float64)
    comm.allreduce(times, op="max")
    return prof.with_times(times.tolist())


def model_signature(model: nn.Module, sample_batch: tuple[Batch, torch.Tensor], world_size: int,
                    extra: str = "") -> str:
    """A key naming (machine, model, batch, ranks, `extra`): equal on two runs that would measure the
    same."""
    inputs, targets = sample_batch
    leaves = torch.utils._pytree.tree_leaves(inputs)
    parts = [socket.gethostname(), str(os.cpu_count()), torch.__version__, str(torch.get_num_threads()),
             str(world_size), type(model).__module__ + "." + type(model).__qualname__,
             repr([(n, tuple(p.shape)) for n, p in model.named_parameters()]),
             repr([(tuple(t.shape), str(t.dtype)) for t in leaves if isinstance(t, torch.Tensor)]),
             repr(tuple(targets.shape)), extra]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def cache_path(cache: str | os.PathLike[str] | bool, key: str) -> Path | None:
    """Where the profile of `key` is kept: `cache` a folder, True the user's cache folder, False none."""
    if cache is False:
        return None
    root = Path.home() / ".cache" / "mpitrain" / "planner" if cache is True else Path(cache)
    return root / f"{key}.json"


def load_cached(path: Path | None) -> dict[str, Any] | None:
    if path is None or not path.is_file():
        return None
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (OSError, ValueError):
        return None


def store(path: Path | None, data: dict[str, Any]) -> None:
    """Write `data` atomically (rank 0 only: the others read what it wrote)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def profile_to_dict(prof: ModelProfile) -> dict[str, Any]:
    return asdict(prof)


def profile_from_dict(data: dict[str, Any]) -> ModelProfile:
    d = dict(data)
    d["step_at"] = [tuple(x) for x in d["step_at"]]
    d["input_shape"] = None if d["input_shape"] is None else tuple(d["input_shape"])
    d["convs"] = [ConvShape(**c) for c in d["convs"]]
    d["switch_points"] = [tuple(s) for s in d.get("switch_points", [])]
    return ModelProfile(**d)

