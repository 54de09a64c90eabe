"""The Communicator interface: in-place collectives, point-to-point and split on torch tensors."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["Communicator", "Request", "CommError", "OPS", "DTYPES", "reduce_ops", "split_sizes"]

#: Reduction ops every backend implements. Which dtype takes which op: :func:`reduce_ops`.
OPS = ("sum", "avg", "max", "min", "prod")

_F = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTS = tuple(getattr(torch, n) for n in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
              if isinstance(getattr(torch, n, None), torch.dtype))
_COMPLEX = tuple(getattr(torch, n) for n in ("complex32", "complex64", "complex128")
                 if isinstance(getattr(torch, n, None), torch.dtype))
#: torch's quantized dtypes: refused, since a quantized tensor's scale and zero point would not travel with
#: its bytes (send ``t.int_repr()`` and the quantization parameters instead).
_QUANTIZED = frozenset(getattr(torch, n) for n in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                       if isinstance(getattr(torch, n, None), torch.dtype))

#: Every dtype the communicators move (point-to-point, broadcast, allgather, alltoallv, reduce_scatter's and
#: allreduce's inputs): each dtype of the installed torch but the quantized ones — bool, 8- to 64-bit signed
#: and unsigned integers, float16/bfloat16/float32/float64, complex32/64/128, the float8 and float4 types, the
#: bit and sub-byte containers. The common six come first (the kvstore protocol encodes a dtype by index).
#: Where MPI has no datatype (bfloat16, complex32, float8, ...) the tensor's own storage goes as bytes: no
#: copy, no pickling. Reductions: :func:`reduce_ops`.
DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32,
                                   torch.int64) + tuple(sorted(
    {d for d in vars(torch).values() if isinstance(d, torch.dtype)} - set(_F) - {torch.int32, torch.int64}
    - _QUANTIZED, key=str))

_REDUCE_OPS: dict[torch.dtype, tuple[str, ...]] = {
    **{d: OPS for d in _F},
    **{d: ("sum", "max", "min", "prod") for d in _INTS},  # integer arithmetic wraps as torch's does; no avg
    **{d: ("sum", "avg") for d in _COMPLEX},  # no order (max/min); prod is not elementwise on (re, im)
    **({torch.complex32: ("sum",)} if torch.complex32 in _COMPLEX else {}),  # torch cannot divide ComplexHalf
    torch.bool: ("max", "min"),  # logical or / logical and
}


def reduce_ops(dtype: torch.dtype) -> tuple[str, ...]:
    """The reduction ops (allreduce, iallreduce, reduce_scatter) `dtype` takes, the same on every backend:

    * floating: all of :data:`OPS` (bfloat16, and float16 where MPI lacks it, add in a float32 copy: fp32
      accumulate, one rounding);
    * integers, signed and unsigned: sum, max, min, prod (wrapping as torch's integer arithmetic does;
      avg refused rather than floor-divided);
    * complex: sum and avg (complex32: sum only, added in a complex64 copy: torch cannot divide it);
    * bool: max (logical or) and min (logical and);
    * every other dtype (float8, float4, the bit containers) moves but has no op: convert it to a wider
      type first, so that the rounding is the caller's choice."""
    return _REDUCE_OPS.get(dtype, ())


#: What to do when a backend cannot take a device, by backend (appended to the error).
_DEVICE_HINTS = {"torch": "; CUDA tensors need the NCCL group, which exists when torch sees a GPU at init"}


class CommError(RuntimeError):
    """A communicator was used wrongly: bad argument, closed communicator, unsupported combination."""


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of `parts` contiguous blocks of `n` items; the first ``n % parts`` blocks get one extra.

    This is the one blocking rule of the project (reduce_scatter, batch slicing, spatial splits).
    """
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class Request(abc.ABC):
    """A nonblocking operation in flight. ``wait()`` returns its output tensor (or None for sends)."""

    @abc.abstractmethod
    def wait(self) -> torch.Tensor | None:
        """Block until complete; idempotent. Output buffers are valid only after this returns."""

    @abc.abstractmethod
    def test(self) -> bool:
        """True once complete (then ``wait()`` returns at once). Never blocks."""

    def cancel(self) -> bool:
        """Cancel a receive no message has matched yet, and complete it (both local); True once the request
        is complete, cancelled or not (a receive whose message had matched holds it). False for what cannot
        be cancelled: sends (MPI deprecates cancelling them), collectives, a backend's receives it cannot
        cancel; they complete only when their peers take part. A cancelled receive's buffer is undefined.
        Used on requests that nobody will wait for (:func:`mpitrain.comm._inflight.abandon`)."""
        return False

    @staticmethod
    def wait_all(requests: Sequence[Request]) -> list[torch.Tensor | None]:
        return [r.wait() for r in requests]


class Communicator(abc.ABC):
    """A group of ranks that run collectives together.

    Every rank of the group must call each collective, with tensors of the same shape and dtype,
    in the same order. Tensors are worked on in place where the signature returns its argument.
    Inputs must be contiguous; a bad argument raises :class:`CommError` naming it, on the calling
    rank, before any message is sent. Methods ending in ``_object`` pickle: never on a hot path.
    """

    backend: str = "?"

    # -- identity -------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def size(self) -> int: ...

    # -- collectives (in place where they return their argument) --------------------------------
    @abc.abstractmethod
    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `t` over all ranks, in place; returns `t`."""

    @abc.abstractmethod
    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Overwrite `t` on every rank with root's `t`, in place; returns `t`."""

    @abc.abstractmethod
    def allgather(self, t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's `t` (same shape everywhere) concatenated on dim 0 in rank order: a new tensor, or
        written into `out` (contiguous, ``size`` times `t`'s rows, same dtype and device) and returned.
        `t` may be block ``rank`` of `out` itself (an in-place allgather: ZeRO's parameter buffers).

        A 0-d tensor is treated as shape (1,)."""

    @abc.abstractmethod
    def reduce_scatter(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """New tensor: block `rank` of the reduction of `t`, blocks along dim 0 by :func:`split_sizes`."""

    @abc.abstractmethod
    def alltoallv(self, send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> torch.Tensor:
        """Rows of `send` (dim 0) go out in rank order, ``send_counts[r]`` rows to rank r; returns the
        received rows concatenated in rank order (``recv_counts[r]`` rows from rank r)."""

    @abc.abstractmethod
    def barrier(self) -> None: ...

    # -- point to point --------------------------------------------------------------------------
    @abc.abstractmethod
    def send(self, t: torch.Tensor, dest: int, tag: int = 0) -> None: ...

    @abc.abstractmethod
    def recv(self, t: torch.Tensor, source: int, tag: int = 0) -> torch.Tensor:
        """Receive into `t` (shape and dtype must match the sender's); returns `t`."""

    @abc.abstractmethod
    def sendrecv(self, send: torch.Tensor, dest: int, recv: torch.Tensor, source: int,
                 sendtag: int = 0, recvtag: int = 0) -> torch.Tensor:
        """Send `send` to `dest` while receiving into `recv` from `source` (deadlock-free); returns `recv`."""

    # -- nonblocking -----------------------------------------------------------------------------
    @abc.abstractmethod
    def iallreduce(self, t: torch.Tensor, op: str = "sum") -> Request:
        """Start an in-place allreduce; `t` must not be touched until the request completes."""

    @abc.abstractmethod
    def ibroadcast(self, t: torch.Tensor, root: int = 0) -> Request: ...

    @abc.abstractmethod
    def isend(self, t: torch.Tensor, dest: int, tag: int = 0) -> Request: ...

    @abc.abstractmethod
    def irecv(self, t: torch.Tensor, source: int, tag: int = 0) -> Request: ...

    # -- groups and objects ----------------------------------------------------------------------
    @abc.abstractmethod
    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """Collective over this communicator: ranks with equal `color` form a new communicator, ordered
        by (key, rank). ``color=None`` joins none and gets None."""

    @abc.abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Pickled allgather of a small Python object (control messages, validation)."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Pickled broadcast of a small Python object."""

    @abc.abstractmethod
    def send_object(self, obj: Any, dest: int, tag: int = 0) -> None:
        """Pickled blocking send of a small Python object to `dest` (control messages only, never a hot
        path). Matched in order with ``recv_object(source=this rank, tag)`` on `dest`; `tag` must not
        be one that tensor sends between the same pair use."""

    @abc.abstractmethod
    def recv_object(self, source: int, tag: int = 0) -> Any:
        """Receive (blocking) the next object that `source` sent with ``send_object(obj, this rank, tag)``."""

    @abc.abstractmethod
    def abort(self, code: int = 1) -> None:
        """End the whole job (every rank of the world) with exit status `code` (never 0)."""

    @abc.abstractmethod
    def free(self) -> None:
        """Release the communicator; any later call raises CommError."""

    # -- shared argument checks ------------------------------------------------------------------
    _closed: bool = False

    def _check_open(self) -> None:
        if self._closed:
            raise CommError(f"{self!r} was freed/finalized and cannot be used any more")

    #: Device types this backend takes (a backend may pass others per call).
    _devices: tuple[str, ...] = ("cpu",)

    def _check(self, t: Any, name: str, op: str | None = None, devices: tuple[str, ...] | None = None) -> None:
        """Refuse what no backend can do, naming argument and reason (raises before any message)."""
        self._check_open()
        if not isinstance(t, torch.Tensor):
            raise CommError(f"argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise CommError(f"argument '{name}' has the quantized dtype {t.dtype}, whose scale and zero point "
                            f"would not travel with its bytes: send t.int_repr() and its quantization parameters")
        devices = devices or self._devices
        if not t.is_cpu and t.device.type not in devices:  # is_cpu first: cheaper than device.type
            hint = _DEVICE_HINTS.get(self.backend, "")
            raise CommError(f"argument '{name}' is on device {t.device}; the {self.backend} backend takes "
                            f"tensors on {devices}: move it there first (t.to(...)){hint}")
        if not t.is_contiguous():
            raise CommError(f"argument '{name}' is not contiguous; pass t.contiguous() (a copy) explicitly")
        if op is not None and op not in reduce_ops(t.dtype):
            raise CommError(_refusal(op, name, t.dtype))

    def _gather_out(self, src: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """`out` checked as the output of an allgather of `src` (CommError before any message), or a
        new tensor of that shape."""
        shape = (self.size * src.shape[0], *src.shape[1:])
        if out is None:
            return torch.empty(shape, dtype=src.dtype, device=src.device)
        self._check(out, "out")
        if tuple(out.shape) != shape or out.dtype != src.dtype or out.device != src.device:
            raise CommError(f"argument 'out' must be a {src.dtype} tensor of shape {shape} on {src.device}, got "
                            f"{out.dtype} {tuple(out.shape)} on {out.device}")
        return out

    def _check_rank(self, r: int, name: str) -> None:
        if not isinstance(r, int) or not 0 <= r < self.size:
            raise CommError(f"argument '{name}'={r!r} is not a rank of this communicator (size {self.size})")

    def _check_counts(self, counts: Sequence[int], name: str, rows: int | None = None) -> list[int]:
        counts = [int(c) for c in counts]
        if len(counts) != self.size or any(c < 0 for c in counts):
            raise CommError(f"argument '{name}' must hold {self.size} non-negative counts, got {counts}")
        if rows is not None and sum(counts) != rows:
            raise CommError(f"argument '{name}' sums to {sum(counts)} but 'send' has {rows} rows on dim 0")
        return counts

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backend={self.backend} rank={self.rank} size={self.size}>"


def _refusal(op: str, name: str, dtype: torch.dtype) -> str:
    """Why reduction `op` is refused on argument `name` of `dtype` (see :func:`reduce_ops`)."""
    if op not in OPS:
        return f"argument 'op' is {op!r}; supported ops: {OPS}"
    ops = reduce_ops(dtype)
    if op == "avg" and dtype in _INTS:
        return f"op 'avg' needs a floating dtype, argument '{name}' is {dtype}"
    if not ops:
        return (f"argument '{name}' has dtype {dtype}, which moves but does not reduce (op {op!r}): convert it "
                f"to a wider type first (e.g. t.float()), so the rounding is your choice")
    return f"op {op!r} is not defined for argument '{name}' of dtype {dtype}; it takes {ops}"


class _DoneRequest(Request):
    """A request that completed at creation (zero-size tensors, size-1 groups)."""

    def __init__(self, out: torch.Tensor | None) -> None:
        self._out = out

    def wait(self) -> torch.Tensor | None:
        return self._out

    def test(self) -> bool:
        return True


class _CallbackRequest(Request):
    """Wraps a backend request; runs `finish` exactly once on completion (copy-back, avg division)."""

    def __init__(self, wait: Callable[[], Any], test: Callable[[], bool], out: torch.Tensor | None,
                 finish: Callable[[], object] | None = None, keep: Any = None,
                 cancel: Callable[[], object] | None = None) -> None:
        self._wait, self._test, self._out, self._finish = wait, test, out, finish
        self._keep = keep  # buffers the backend still reads/writes; alive until completion
        self._cancel = cancel  # marks a receive for cancellation (its wait is then local)
        self._done = False

    def _complete(self) -> None:
        if not self._done:
            self._done = True
            if self._finish is not None:
                self._finish()
            self._keep = None

    def wait(self) -> torch.Tensor | None:
        if not self._done:
            self._wait()
            self._complete()
        return self._out

    def test(self) -> bool:
        if not self._done and self._test():
            self._complete()
        return self._done

    def cancel(self) -> bool:
        if self._done:
            return True
        if self._cancel is None or self._cancel() is False:  # a wrapped request that cannot be cancelled
            return False
        self.wait()  # local after a cancel (MPI standard, MPI_Cancel)
        return True
