"""Host staging of device tensors for an MPI library that cannot read device memory.

A collective on a CUDA tensor runs on a host mirror: the tensor is copied into a pinned host buffer
(on the device's side stream, ordered after the caller's current stream: only that copy is waited
for, never the caller's stream as a whole), MPI works on the host buffer, and what MPI wrote is copied
back on the side stream, which the host waits for before the operation counts as complete. Host
buffers are pinned (page-locked, so the copies are DMA at full bandwidth) and reused per
(dtype, element count): a steady training step allocates none.

The same path runs for CPU tensors when a communicator is told to stage everything (a test of this
code against the direct path, over real MPI, on machines without a GPU): the mirror is then ordinary
memory and the copies are plain ``copy_``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ._cuda import side_stream

__all__ = ["Staging"]


class Staging:
    """Pinned host mirrors of device tensors, reused per (dtype, numel). Thread-safe: each mirror is
    lent to one operation at a time (:meth:`take` / :meth:`give`)."""

    def __init__(self) -> None:
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A host tensor of `like`'s shape and dtype, lent until :meth:`give` (contents undefined)."""
        key = (like.dtype, like.numel())
        with self._lock:
            free = self._free.get(key)
            flat = free.pop() if free else None
        if flat is None:
            flat = torch.empty(like.numel(), dtype=like.dtype, pin_memory=like.is_cuda)
        return flat.view(like.shape)

    def give(self, host: torch.Tensor) -> None:
        """Return a mirror from :meth:`take` for reuse."""
        with self._lock:
            self._free.setdefault((host.dtype, host.numel()), []).append(host.view(-1))

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A lent mirror holding `t`'s contents as of the caller's current stream."""
        host = self.take(t)
        _copy(host, t)
        return host

    def back(self, t: torch.Tensor, host: torch.Tensor) -> None:
        """Copy a mirror into `t` (complete when this returns) and return the mirror for reuse."""
        _copy(t, host)
        self.give(host)

    def inplace(self, t: torch.Tensor, op: Callable[[torch.Tensor], object], read: bool = True) -> torch.Tensor:
        """Run the blocking host operation `op` on a mirror of `t` (filled from `t` when `read`),
        then copy the mirror back into `t`; returns `t`."""
        host = self.to_host(t) if read else self.take(t)
        try:
            op(host)
        except BaseException:
            self.give(host)
            raise
        self.back(t, host)
        return t

    def pieces(self, t: torch.Tensor, cut: Callable[[torch.Tensor], list[torch.Tensor]],
               op: Callable[[torch.Tensor], object]) -> torch.Tensor:
        """:meth:`inplace` for an elementwise blocking host operation `op` (an allreduce, a broadcast),
        run piece by piece: ``cut`` splits a tensor into views, alike for `t` and its mirror. For a CUDA
        tensor every piece's copy to the host is queued on the side stream at once, and each piece's copy
        back is queued as soon as `op` has run on it, so the copy engines work while MPI reduces the next
        piece on the host. Complete (every piece back in `t`) when this returns; if `op` raises, the
        pieces before it are already written back."""
        host = self.take(t)
        try:
            if not t.is_cuda:  # forced staging of a CPU tensor: the same pieces, one after another
                for d, h in zip(cut(t), cut(host)):
                    h.copy_(d)
                    op(h)
                    d.copy_(h)
                return t
            s = side_stream(t.device)
            s.wait_stream(torch.cuda.current_stream(t.device))  # what the caller's stream produced so far
            pairs, ready = list(zip(cut(t), cut(host))), []
            with torch.cuda.stream(s):
                for d, h in pairs:
                    h.copy_(d, non_blocking=True)
                    ready.append(torch.cuda.Event())
                    ready[-1].record(s)
            for (d, h), ev in zip(pairs, ready):
                ev.synchronize()  # this piece is on the host; the later ones are still being copied
                op(h)
                with torch.cuda.stream(s):
                    d.copy_(h, non_blocking=True)
        finally:
            if t.is_cuda:  # no copy may still read or write the mirror when it is lent again
                side_stream(t.device).synchronize()
            self.give(host)
        return t

    def out(self, t: torch.Tensor, op: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Run the blocking host operation `op` on a mirror of `t`; its new host output, moved to
        `t`'s device, is returned."""
        host = self.to_host(t)
        try:
            result = op(host)
        finally:
            self.give(host)
        return _to_device(result, t.device)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, complete on return. Between a device and the host the copy runs on the
    device's side stream, after the caller's current stream (which is not waited for itself)."""
    if not (src.is_cuda or dst.is_cuda):
        dst.copy_(src)
        return
    dev = src.device if src.is_cuda else dst.device
    s = side_stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))  # what the caller's stream produced so far
    with torch.cuda.stream(s):
        dst.copy_(src, non_blocking=True)
    s.synchronize()


def _to_device(host: torch.Tensor, dev: torch.device) -> torch.Tensor:
    if dev.type == "cpu":
        return host
    out = torch.empty(host.shape, dtype=host.dtype, device=dev)
    _copy(out, host)
    return out
