"""Ring allreduce over point-to-point messages, with a codec applied at every hop (Pipe-SGD §3.2).

The tensor is cut into ``p`` blocks (:func:`~mpitrain.comm.base.split_sizes`) and every block into
chunks of at most ``chunk_bytes``. Reduce-scatter: for ``p - 1`` steps each rank sends one block to
its right neighbour and receives one from its left, decompresses it, adds its own values and
recompresses the partial sum for the next hop. Allgather: the owner of each fully reduced block
compresses it ONCE and the compressed chunks are forwarded unchanged around the ring, the owner
decoding its own payload too, so every rank ends with bitwise the same tensor.

Chunks pipeline: all receives are posted up front and each chunk is sent on as soon as it is
reduced, so the reduction of one chunk overlaps the transfer of the next (Fig. 3 of the paper).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .._utils.deprecation import renamed_options
from .._utils.flat import spans
from .._utils.stall import StallPolicy, wait_until, watched
from .base import CommError, Communicator, Request, split_sizes
from .codecs import Codec, get_codec

__all__ = ["ring_allreduce", "ring_schedule", "RingStep", "DEFAULT_CHUNK_BYTES", "RING_TAG", "chunk_bounds"]

#: Default chunk size: large enough that per-message latency is amortised, small enough to pipeline.
DEFAULT_CHUNK_BYTES = 1 << 18
#: Tag of every ring message. Messages between a pair of ranks on one communicator match in order,
#: so two rings must not run concurrently on the same communicator (use ``comm.split(0)`` per thread).
RING_TAG = 7311


@dataclass(frozen=True)
class RingStep:
    """One step of the ring on one rank: send block `send` to the right, receive block `recv` from the left."""

    phase: str  # "reduce-scatter" | "allgather"
    step: int
    send: int
    recv: int


def ring_schedule(size: int, rank: int) -> list[RingStep]:
    """The ring's steps on `rank` as printable data. After reduce-scatter `rank` owns block
    ``(rank + 1) % size``; every block is sent exactly once by every rank."""
    rs = [RingStep("reduce-scatter", s, (rank - s) % size, (rank - s - 1) % size) for s in range(size - 1)]
    ag = [RingStep("allgather", s, (rank + 1 - s) % size, (rank - s) % size) for s in range(size - 1)]
    return rs + ag


def chunk_bounds(n: int, size: int, chunk_elems: int) -> list[list[tuple[int, int]]]:
    """Per block, the ``(start, stop)`` element ranges of its chunks; empty blocks have no chunks."""
    out = []
    for lo, hi in spans(split_sizes(n, size)):
        pieces = -(-(hi - lo) // chunk_elems)
        out.append(spans(split_sizes(hi - lo, pieces), start=lo) if pieces else [])
    return out


def _wait(req: Request, what: str, warn_after: float, nap: float | None = None) -> None:
    """Block inside MPI (no Python polling, see :func:`mpitrain._utils.stall.watched`), warning on a stall;
    with `nap`, test with sleeps of at most `nap` seconds in between instead."""
    if req.test():
        return
    detail = f"waiting for {what}; is that rank alive and calling the same allreduce?"
    if nap is not None:
        wait_until(req.test, detail, StallPolicy(warn_after=warn_after, abort_after=None, max_nap=nap,
                                                 first_nap=min(2e-5, nap)), who="ring_allreduce")
        return
    with watched("ring_allreduce", detail, warn_after):
        req.wait()


def _validate(t: torch.Tensor, codec: Codec, op: str, chunk_bytes: int,
              error_feedback: torch.Tensor | None) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.device.type != "cpu":
        raise CommError(f"ring_allreduce: argument 't' must be a floating CPU tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)}")
    if not t.is_contiguous():
        raise CommError("ring_allreduce: argument 't' is not contiguous; pass t.contiguous() explicitly")
    codec.check_input(t, "t")
    if op not in ("sum", "avg"):
        raise CommError(f"ring_allreduce: op {op!r} is not supported; use 'sum' or 'avg'")
    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise CommError(f"ring_allreduce: chunk_bytes must be a positive int, got {chunk_bytes!r}")
    if error_feedback is not None and (not isinstance(error_feedback, torch.Tensor)
                                       or error_feedback.shape != t.shape or error_feedback.dtype != t.dtype
                                       or not error_feedback.is_contiguous()):
        raise CommError(f"ring_allreduce: error_feedback must be a contiguous tensor of t's shape "
                        f"{tuple(t.shape)} and dtype {t.dtype}")


def ring_allreduce(comm: Communicator, t: torch.Tensor, codec: str | Codec | None = None, op: str = "sum",
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES, error_feedback: torch.Tensor | None = None,
                   warn_after: float = 60.0, stats: dict[str, float] | None = None,
                   stall_warning_s: float | None = None, *, addends: Sequence[torch.Tensor] = (),
                   on_final: Callable[[int, int], object] | None = None, nap: float | None = None) -> torch.Tensor:
    """Sum (or average) `t` over all ranks of `comm` in place, compressing every hop with `codec`.

    Every rank must call it with a tensor of the same shape and dtype and the same codec, op and
    chunk_bytes. Guarantees: every rank ends with bitwise the same `t`; without a codec the result
    is the exact fp sum in ring order. With a lossy codec each element's error is at most the sum,
    over the ``p`` encodings on its path (``p - 1`` partial sums and the final sum), of that codec's
    per-element error (int8: half a quantization step each).

    `error_feedback` (optional, t's shape): a residual the caller keeps across calls, initially zero.
    It is added to `t` before reducing and then overwritten with this rank's compression error
    (every element of `t` is encoded exactly once on each rank), so the error lost in one call is
    sent in the next (EF-SGD). Arguments are checked locally and a CommError raised before any
    message is sent. A wait longer than `warn_after` seconds warns, naming the peer and block
    (`stall_warning_s` is its former name, deprecated: it warns, for one release). When
    `stats` is a dict, the seconds spent encoding/decoding are added to ``stats["codec_s"]``.
    `addends`: contiguous tensors of t's shape and dtype (this rank's other contributions, e.g. the other
    ranks of its host); the result is as if ``t += a`` had run for each, in order, before the ring, but
    each chunk is added just before the ring first uses it, so the additions overlap the transfers.
    `on_final(lo, hi)`: called (op 'sum' only) as soon as ``t.view(-1)[lo:hi]`` holds its final value on
    this rank, once for every element, chunk by chunk while the ring still transfers others, so the
    caller can copy results out overlapped with the network. The range must not be written by it.
    `nap`: None (default) waits for each message inside the transport (Open MPI polls, keeping a core
    busy); a number of seconds tests it with sleeps of at most that long in between, leaving the core to
    others where the transfers need little of this process's time (across hosts over TCP, where the
    kernel moves the bytes; docs/multihost.md).
    Uses point-to-point messages with tag :data:`RING_TAG`: run one ring per communicator at a time.
    """
    codec = get_codec(codec)
    if stall_warning_s is not None:
        warn_after = renamed_options({"stall_warning_s": stall_warning_s}, {"stall_warning_s": "warn_after"},
                                     "ring_allreduce")["warn_after"]
    _validate(t, codec, op, chunk_bytes, error_feedback)
    if nap is not None and not (isinstance(nap, (int, float)) and nap > 0):
        raise CommError(f"ring_allreduce: nap must be None or a positive number of seconds, got {nap!r}")
    if on_final is not None and op != "sum":
        raise CommError("ring_allreduce: on_final needs op 'sum' (an average is final only after the ring)")
    for a in addends:
        if not isinstance(a, torch.Tensor) or a.shape != t.shape or a.dtype != t.dtype or not a.is_contiguous():
            raise CommError(f"ring_allreduce: addends must be contiguous tensors of t's shape {tuple(t.shape)} "
                            f"and dtype {t.dtype}")
    flat = t.view(-1)
    if error_feedback is not None:
        flat.add_(error_feedback.view(-1))
        if codec.lossless or comm.size == 1:
            error_feedback.zero_()
    if comm.size == 1 or not flat.numel():
        for a in addends:
            flat.add_(a.view(-1))
        if on_final is not None and flat.numel():
            on_final(0, flat.numel())
    else:
        chunk_elems = max(1, chunk_bytes // t.element_size())
        ring = _Ring(comm, flat, codec, chunk_elems=chunk_elems, error_feedback=error_feedback,
                     warn_after=warn_after, addends=[a.view(-1) for a in addends], on_final=on_final, nap=nap)
        ring.run()
        if stats is not None:
            stats["codec_s"] = stats.get("codec_s", 0.0) + ring.codec_s
    if op == "avg":
        t.div_(comm.size)
    return t


class _Ring:
    """State of one ring allreduce on one rank (buffers, requests); used once by ring_allreduce."""

    def __init__(self, comm: Communicator, flat: torch.Tensor, codec: Codec, chunk_elems: int,
                 error_feedback: torch.Tensor | None, warn_after: float, addends: Sequence[torch.Tensor] = (),
                 on_final: Callable[[int, int], object] | None = None, nap: float | None = None) -> None:
        self.comm, self.flat, self.codec, self.warn_after = comm, flat, codec, warn_after
        self.p, self.r = comm.size, comm.rank
        self.right, self.left = (self.r + 1) % self.p, (self.r - 1) % self.p
        self.ef = None if error_feedback is None or codec.lossless else error_feedback.view(-1)
        self.blocks = chunk_bounds(flat.numel(), self.p, chunk_elems)
        self.steps = ring_schedule(self.p, self.r)
        self.sends: list[Request] = []
        self.codec_s = 0.0  # time in encode/decode (identity: ~0)
        self.addends = addends
        self.on_final = on_final
        self.nap = nap

    def _add_own(self, lo: int, hi: int) -> None:
        """This rank's other contributions to flat[lo:hi], just before the ring first uses the chunk."""
        for a in self.addends:
            self.flat[lo:hi].add_(a[lo:hi])

    def _encode(self, lo: int, hi: int) -> torch.Tensor:
        """Payload of flat[lo:hi]; records this rank's compression error there when error feedback is on."""
        t0 = time.perf_counter()
        chunk = self.flat[lo:hi]
        payload = self.codec.encode(chunk)
        if self.ef is not None:
            res = self.ef[lo:hi]
            self.codec.decode(payload, res)
            torch.sub(chunk, res, out=res)
        self.codec_s += time.perf_counter() - t0
        return payload

    def _wait(self, req: Request, step: RingStep, lo: int, hi: int) -> None:
        what = (f"rank {self.left} -> rank {self.r}: {step.phase} step {step.step}, block {step.recv} "
                f"elements [{lo}, {hi}) of {self.flat.numel()}")
        _wait(req, what, self.warn_after, self.nap)

    def _post_recvs(self, steps: list[RingStep], into_flat: bool) -> list[list[tuple[Request, torch.Tensor]]]:
        out = []
        for st in steps:
            reqs = []
            for lo, hi in self.blocks[st.recv]:
                buf = self.flat[lo:hi] if into_flat else self.codec.empty_payload(hi - lo, self.flat.dtype)
                reqs.append((self.comm.irecv(buf, self.left, tag=RING_TAG), buf))
            out.append(reqs)
        return out

    def run(self) -> None:
        rs, ag = self.steps[: self.p - 1], self.steps[self.p - 1:]
        recvs = self._post_recvs(rs, into_flat=False)
        for lo, hi in self.blocks[rs[0].send]:
            self._add_own(lo, hi)
            self.sends.append(self.comm.isend(self._encode(lo, hi), self.right, tag=RING_TAG))
        for i, st in enumerate(rs):
            last = i == len(rs) - 1
            for (req, payload), (lo, hi) in zip(recvs[i], self.blocks[st.recv]):
                self._add_own(lo, hi)  # before the wait: overlaps the chunk's transfer
                self._wait(req, st, lo, hi)
                t0 = time.perf_counter()
                self.codec.decode_add(payload, self.flat[lo:hi])
                self.codec_s += time.perf_counter() - t0
                out = self._encode(lo, hi)
                if last and not self.codec.lossless:
                    self._decode(out, lo, hi)  # the owner keeps what the others will decode
                self.sends.append(self.comm.isend(out, self.right, tag=RING_TAG))
                if last and self.on_final is not None:  # after the send: the copy overlaps its transfer
                    self.on_final(lo, hi)
        if self.codec.lossless:  # allgather receives land in blocks whose earlier sends may still read them
            for req in self.sends[: sum(len(self.blocks[st.send]) for st in rs)]:
                req.wait()
        self._allgather(ag)
        Request.wait_all(self.sends)

    def _allgather(self, ag: list[RingStep]) -> None:
        in_place = self.codec.lossless
        recvs = self._post_recvs(ag, into_flat=in_place)
        for i, st in enumerate(ag):
            for (req, payload), (lo, hi) in zip(recvs[i], self.blocks[st.recv]):
                self._wait(req, st, lo, hi)
                if i < len(ag) - 1:
                    self.sends.append(self.comm.isend(payload, self.right, tag=RING_TAG))
                if not in_place:
                    self._decode(payload, lo, hi)
                if self.on_final is not None:
                    self.on_final(lo, hi)

    def _decode(self, payload: torch.Tensor, lo: int, hi: int) -> None:
        t0 = time.perf_counter()
        self.codec.decode(payload, self.flat[lo:hi])
        self.codec_s += time.perf_counter() - t0
