"""Sharded, atomic checkpoints: every rank writes its own shard, rank 0 a small manifest, under
``DIR/step-<k>/``; `load_checkpoint` merges the shards' model entries in one process without MPI.

Layout of one checkpoint::

    DIR/step-<k>/manifest.json     format, step, position in the data, strategy layout, history (JSON)
    DIR/step-<k>/rank-<r>.pt       rank r's shard: {"trainer": ..., "rng": ..., "scheduler": ...}

A shard by name (``strategies/_reshard.py``) may hold any subset of the model's tensors: data, pipe-sgd and
spatial write each replicated parameter in one rank's shard only (hybrid: in one replica's of its
partition), so readers gather by name across shards (`FORMAT` 1 covers both that and the older layouts in
which every rank wrote its whole replica or partition).

Atomicity: the shards and the manifest are written into ``DIR/.step-<k>.tmp/``, each file fsynced,
then the directory fsynced, renamed to ``step-<k>`` and ``DIR`` fsynced. Only directories named
``step-<k>`` holding a manifest count, so a kill at any moment leaves only complete checkpoints
visible (a stale ``.tmp`` directory is removed by the next save of that step). Every rank must see
``DIR`` (a shared file system across hosts). Shards are read with ``torch.load(weights_only=True)``:
no pickled code runs from a checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .comm.base import Communicator
from .strategies import assemble

__all__ = ["load_checkpoint", "latest", "save", "read_manifest", "read_shard", "rng_state", "set_rng_state",
           "CheckpointError", "FORMAT"]

FORMAT = 1
MANIFEST = "manifest.json"
_STEP = re.compile(r"^step-(\d+)$")

#: Test hook: called with the path of each file just written (a test kills the process there).
_after_write: Callable[[Path], None] | None = None


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be read as one (missing shard, unknown format)."""


def shard_name(rank: int) -> str:
    return f"rank-{rank}.pt"


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step under `directory` (None if there is none)."""
    root = Path(directory)
    if not root.is_dir():
        return None
    found = []
    for p in root.iterdir():
        m = _STEP.match(p.name)
        if m and (p / MANIFEST).is_file():
            found.append((int(m.group(1)), p))
    return max(found)[1] if found else None


def read_manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of the checkpoint at `path` (a ``step-<k>`` directory)."""
    with open(Path(path) / MANIFEST) as f:
        manifest: dict[str, Any] = json.load(f)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {manifest.get('format')!r}, this mpitrain reads {FORMAT}")
    return manifest


def read_shard(path: str | os.PathLike[str], rank: int) -> dict[str, Any]:
    """Saved rank `rank`'s shard of the checkpoint at `path` (weights_only: tensors and plain data)."""
    file = Path(path) / shard_name(rank)
    if not file.is_file():
        raise CheckpointError(f"{path} has no shard for rank {rank} ({file.name})")
    shard: dict[str, Any] = torch.load(file, weights_only=True, map_location="cpu")
    return shard


def load_checkpoint(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The full model's ``state_dict`` from a checkpoint, in one process, without MPI.

    `directory` is a ``step-<k>`` checkpoint or a ``checkpoint_dir`` (then its latest complete
    checkpoint). The shards' ``"model"`` entries are merged in rank order; an entry several ranks
    hold (replicated weights) is taken from the lowest rank. Load it with ``model.load_state_dict``."""
    path = Path(directory)
    if not (path / MANIFEST).is_file():
        found = latest(path)
        if found is None:
            raise CheckpointError(f"{directory} holds no complete checkpoint (no step-<k>/{MANIFEST})")
        path = found
    manifest = read_manifest(path)
    state = assemble(read_shard(path, rank)["trainer"] for rank in range(int(manifest["world_size"])))
    order = manifest.get("model_keys")
    if order:  # the user's state_dict order
        state = {k: state[k] for k in order if k in state} | {k: v for k, v in state.items() if k not in order}
    return state


def rng_state() -> dict[str, Any]:
    """This process's torch, Python and numpy global RNG states, as weights_only-loadable data."""
    import numpy as np

    version, words, gauss = random.getstate()
    state = np.random.get_state(legacy=True)
    assert isinstance(state, tuple)  # legacy=True: (name, keys, pos, has_gauss, cached)
    name, keys, pos, has_gauss, cached = state
    return {"torch": torch.get_rng_state(), "python": [version, list(words), gauss],
            "numpy": {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)}}


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    import numpy as np

    torch.set_rng_state(state["torch"])
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["cached"]))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, write: Callable[[Any], None], binary: bool = True) -> None:
    with open(path, "wb" if binary else "w") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    if _after_write is not None:
        _after_write(path)


def save(comm: Communicator, directory: str | os.PathLike[str], step: int, shard: dict[str, Any],
         manifest: dict[str, Any]) -> Path:
    """Collective: write this rank's `shard` and (rank 0) `manifest` as ``directory/step-<step>``,
    atomically. Returns the checkpoint's path on every rank. Any rank's failure raises
    CheckpointError on every rank (nothing is renamed then). An existing ``step-<step>`` (a resumed run
    saving the step it resumed from) is left as it is."""
    root = Path(directory)
    final, tmp = root / f"step-{step}", root / f".step-{step}.tmp"
    error: str | None = None
    if comm.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if not final.exists():
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
        except OSError as e:
            error = f"rank 0: {e!r}"
    exists, error = comm.broadcast_object((final.exists(), error))
    if error is not None:
        raise CheckpointError(f"checkpoint {final}: {error}")
    if exists:
        return final
    try:
        _write(tmp / shard_name(comm.rank), lambda f: torch.save(shard, f))
        error = None
    except OSError as e:
        error = f"rank {comm.rank}: {e!r}"
    errors = [e for e in comm.allgather_object(error) if e is not None]
    if not errors and comm.rank == 0:
        try:
            _write(tmp / MANIFEST, lambda f: f.write(json.dumps({"format": FORMAT, "step": step,
                                                                 "world_size": comm.size, **manifest}, indent=1)),
                   binary=False)
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(root)
        except OSError as e:
            errors.append(f"rank 0: {e!r}")
    errors = comm.broadcast_object(errors)
    if errors:
        raise CheckpointError(f"checkpoint {final} not written: {'; '.join(errors)}")
    return final
