"""Nonblocking sends of staged device tensors, copied to the host off the caller's thread.

A staged ``isend`` must copy the tensor to a host mirror before MPI can send it, and that copy waits
for the kernels that produce the tensor. Done on the calling thread, the host would stop queueing
work until the GPU caught up (a pipeline stage could not launch its next micro-batch while its last
activation is still being computed). Here ``isend`` only records an event on the caller's current
stream and queues the send; one worker thread per communicator waits for that event, copies the
tensor on the device's side stream and posts MPI's ``Isend`` of the mirror. Completion is then MPI's
(tested and waited on the caller's thread, as any request).

Guarantees: sends queued here are posted in the order they were queued (so two of them to one peer
with one tag match that peer's receives in order), and the tensor is read as of the ``isend`` call on
the caller's current stream; the caller must not change it before the request completes (MPI's
rule). The tensor's data is sent, never its autograd history: the worker copies a detached alias
(its thread runs with grad mode on, where copying a tensor that requires grad into a mirror made
under ``no_grad`` fails). A send the worker cannot post ends the job at once, naming it: its receiver
would otherwise wait forever (the error would reach this rank only when it waits for the send, which
the halo and pipeline protocols do after their receives). Against sends posted directly by the
caller's thread (CPU tensors) no order is kept: use distinct tags, as the pipeline and halo protocols
do. Needs MPI_THREAD_MULTIPLE; without it the communicator copies on the caller's thread instead.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable

import torch

from .._utils.stall import say
from ._cuda import after, ready_event
from ._staging import Staging, copy_bits
from .base import Request

__all__ = ["StagedSends"]


class _Send(Request):
    """One queued send: posted by the worker (``_posted`` set), then completed by MPI."""

    def __init__(self, t: torch.Tensor, dest: int, tag: int) -> None:
        self.tensor: torch.Tensor | None = t.detach()  # the data alone, whatever the worker's grad mode
        self._of = (t.shape, t.dtype, t.device)  # named by describe(), only if the send fails
        self.dest, self.tag = dest, tag
        self.ready = ready_event(t)  # the caller's stream has produced `t` here
        self.host: torch.Tensor | None = None
        self.request: Request | None = None
        self.error: BaseException | None = None
        self._posted = threading.Event()
        self._release: Callable[[], None] | None = None

    def describe(self) -> str:
        shape, dtype, device = self._of
        return f"{tuple(shape)} {dtype} on {device} to rank {self.dest} (tag {self.tag})"

    def _complete(self) -> None:
        if self._release is not None:
            self._release()
            self._release = None

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def test(self) -> bool:
        if not self._posted.is_set():
            return False
        self._raise()
        assert self.request is not None
        if self.request.test():
            self._complete()
            return True
        return False

    def wait(self) -> None:
        # the worker sets _posted after its copy (a GPU that stops would be stuck anyway) or on error
        self._posted.wait()
        self._raise()
        assert self.request is not None
        self.request.wait()
        self._complete()


class StagedSends:
    """The worker thread of one communicator's staged sends. `post(host, dest, tag)` starts MPI's
    nonblocking send of a host mirror (called on the worker thread); `abort(code)` ends the job (after
    a send that could not be posted; `who` names this rank in the message)."""

    def __init__(self, staging: Staging, post: Callable[[torch.Tensor, int, int], Request],
                 abort: Callable[[int], None], who: str) -> None:
        self._staging, self._post, self._abort, self._who = staging, post, abort, who
        self._queue: queue.SimpleQueue[_Send | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def isend(self, t: torch.Tensor, dest: int, tag: int) -> Request:
        """Queue a send of `t` (already checked by the communicator); returns its request at once."""
        job = _Send(t, dest, tag)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mpitrain-staged-sends", daemon=True)
                self._thread.start()
        self._queue.put(job)
        return job

    def close(self) -> None:
        """Stop the worker after the sends queued so far are posted. Idempotent."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                t = job.tensor
                assert t is not None
                # a new thread's current CUDA device is 0: the pinned mirror and the copy belong to t's
                with torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext():
                    host = job.host = self._staging.take(t)
                    with after(t, job.ready):  # on the side stream, after the producer; complete on exit
                        copy_bits(host, t, non_blocking=True)
                job.tensor = None  # copied: the caller's memory may be reused
                job.request = self._post(host, job.dest, job.tag)
                job._release = lambda h=host: self._staging.give(h)
            except BaseException as e:  # handed to the caller's test() and wait(), and the job ends
                job.error = e
                if job.host is not None:
                    self._staging.give(job.host)
                say(f"[mpitrain] {self._who}: the staged send of {job.describe()} failed ({type(e).__name__}: {e}); "
                    f"its receiver would wait forever: aborting the job")
                self._abort(1)
            finally:
                job._posted.set()
