"""Host staging of device tensors for an MPI library that cannot read device memory.

A collective on a CUDA tensor runs on a host mirror: the tensor is copied into a pinned host buffer
(on the device's side stream, ordered after the caller's current stream: only that copy is waited
for, never the caller's stream as a whole), MPI works on the host buffer, and what MPI wrote is copied
back on the caller's current stream, which the host does not wait for: kernels queued there afterwards
see the result, as with NCCL (torch.distributed's rule). Host buffers are pinned (page-locked, so the
copies are DMA at full bandwidth) and reused per (dtype, element count): a steady training step
allocates none; a mirror whose copy back may still be running is lent again only once it is done.

The same path runs for CPU tensors when a communicator is told to stage everything (a test of this
code against the direct path, over real MPI, on machines without a GPU): the mirror is then ordinary
memory and the copies are plain ``copy_``.

Every copy here is of the tensors' bytes (:func:`copy_bits`), so the mirrors work for every dtype, even those
torch has no copy kernel for (the sub-byte containers ``int1`` ... ``uint7``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ._cuda import side_stream

__all__ = ["Staging", "copy_bits", "clone_bits"]


class Staging:
    """Pinned host mirrors of device tensors, reused per (dtype, numel). Thread-safe: each mirror is
    lent to one operation at a time (:meth:`take` / :meth:`give`)."""

    def __init__(self) -> None:
        # free mirrors, each with the event after which no copy reads it any more (None: none does)
        self._free: dict[tuple[torch.dtype, int], list[tuple[torch.Tensor, Any]]] = {}
        self._lock = threading.Lock()

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A host tensor of `like`'s shape and dtype, lent until :meth:`give` (contents undefined)."""
        key = (like.dtype, like.numel())
        flat = None
        with self._lock:
            free = self._free.get(key, [])
            for i in range(len(free) - 1, -1, -1):
                if free[i][1] is None or free[i][1].query():
                    flat = free.pop(i)[0]
                    break
        if flat is None:
            flat = torch.empty(like.numel(), dtype=like.dtype, pin_memory=like.is_cuda)
        return flat.view(like.shape)

    def give(self, host: torch.Tensor, done: Any = None) -> None:
        """Return a mirror from :meth:`take` for reuse, once the CUDA event `done` (if any) completes."""
        with self._lock:
            self._free.setdefault((host.dtype, host.numel()), []).append((host.view(-1), done))

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A lent mirror holding `t`'s contents as of the caller's current stream."""
        host = self.take(t)
        _copy(host, t)
        return host

    def back(self, t: torch.Tensor, host: torch.Tensor) -> None:
        """Copy a mirror into `t`, ordered on the caller's current stream of `t`'s device (the host does
        not wait for it), and return the mirror for reuse once that copy is done."""
        if not t.is_cuda:
            copy_bits(t, host)
            self.give(host)
            return
        stream = torch.cuda.current_stream(t.device)
        with torch.cuda.stream(stream):
            copy_bits(t, host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        self.give(host, done)

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
        piece on the host. The caller's current stream then waits for the copies back (the host does
        not); if `op` raises, the pieces before it are already written back."""
        host = self.take(t)
        if not t.is_cuda:  # forced staging of a CPU tensor: the same pieces, one after another
            try:
                for d, h in zip(cut(t), cut(host)):
                    copy_bits(h, d)
                    op(h)
                    copy_bits(d, h)
            finally:
                self.give(host)
            return t
        s = side_stream(t.device)
        try:
            s.wait_stream(torch.cuda.current_stream(t.device))  # what the caller's stream produced so far
            pairs, ready = list(zip(cut(t), cut(host))), []
            with torch.cuda.stream(s):
                for d, h in pairs:
                    copy_bits(h, d, non_blocking=True)
                    ready.append(torch.cuda.Event())
                    ready[-1].record(s)
            for (d, h), ev in zip(pairs, ready):
                ev.synchronize()  # this piece is on the host; the later ones are still being copied
                op(h)
                with torch.cuda.stream(s):
                    copy_bits(d, h, non_blocking=True)
        except BaseException:
            s.synchronize()  # no copy may still read or write the mirror when it is lent again
            self.give(host)
            raise
        done = torch.cuda.Event()  # the caller's stream waits for the copies back; the host does not
        done.record(s)
        torch.cuda.current_stream(t.device).wait_event(done)
        self.give(host, done)
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


def copy_bits(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """``dst.copy_(src)`` for contiguous tensors of one dtype and size, as their bytes (every dtype)."""
    dst.reshape(-1).view(torch.uint8).copy_(src.reshape(-1).view(torch.uint8), non_blocking=non_blocking)


def clone_bits(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `t` made as its bytes (every dtype: int1 ... uint7 have no clone kernel)."""
    return t.reshape(-1).view(torch.uint8).clone().view(t.dtype).reshape(t.shape)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, complete on return. Between a device and the host the copy runs on the
    device's side stream, after the caller's current stream (which is not waited for itself)."""
    if not (src.is_cuda or dst.is_cuda):
        copy_bits(dst, src)
        return
    dev = src.device if src.is_cuda else dst.device
    s = side_stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))  # what the caller's stream produced so far
    with torch.cuda.stream(s):
        copy_bits(dst, src, non_blocking=True)
    s.synchronize()


def _to_device(host: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """`host` (MPI's new output, pageable memory) on `dev`, on its current stream. From pageable memory
    CUDA stages the source before the call returns, so `host` may be freed at once; the host does not
    wait for the stream."""
    if dev.type == "cpu":
        return host
    out = torch.empty(host.shape, dtype=host.dtype, device=dev)
    copy_bits(out, host, non_blocking=True)
    return out
