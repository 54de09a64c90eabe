"""Measure the timing model's alpha (latency), beta (s/byte), gamma (s/byte summed), S and codec costs.

Every rank of the communicator must call :func:`calibrate`; every rank gets the same numbers (each
measurement is the maximum over ranks: the slowest link/core bounds a synchronous ring).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..comm.base import Communicator
from ..comm.codecs import get_codec

__all__ = ["Calibration", "calibrate", "fit_alpha_beta", "codec_cost", "best_time", "LinkCost", "Network",
           "measure_network", "extrapolate_network", "extrapolate_calibration"]

#: Message sizes (bytes) of the latency/bandwidth fit: small ones pin alpha, large ones beta.
SIZES = (8, 1024, 16384, 262144, 1048576, 4194304)


@dataclass(frozen=True)
class Calibration:
    """Measured model constants (seconds; per byte where named so). `codec_per_byte`: encode+decode."""

    alpha: float
    beta: float
    gamma: float
    S: float
    codec_per_byte: dict[str, float]
    wire_ratio: dict[str, float]


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """``t = alpha + beta * m``: alpha is the time of the smallest message, beta the least-squares slope
    of the rest through it (a plain two-parameter fit lets the large sizes drive alpha negative)."""
    alpha = max(0.0, times[0])
    num = sum(m * (t - alpha) for m, t in zip(sizes[1:], times[1:]))
    den = sum(m * m for m in sizes[1:])
    return alpha, max(0.0, num / den) if den else 0.0


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of `repeats` timed calls after one warm-up call. Noise on a shared machine only ever
    adds time, so the minimum is the reproducible constant (the model predicts an unloaded machine)."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def _shift_times(comm: Communicator, sizes: list[int], repeats: int) -> list[float]:
    """Best time of one ring shift (send right, receive left) per size, on this rank."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    out = []
    for m in sizes:
        send, recv = torch.zeros(m // 4), torch.empty(m // 4)

        def shift(send: torch.Tensor = send, recv: torch.Tensor = recv) -> None:
            comm.sendrecv(send, right, recv, left)

        comm.barrier()
        out.append(best_time(shift, repeats))
    return out


def codec_cost(name: str | None, nbytes: int = 1 << 22, repeats: int = 5) -> tuple[float, float]:
    """(seconds of encode+decode per input byte, wire bytes per input byte) of codec `name`, locally."""
    codec = get_codec(name)
    x = torch.randn(nbytes // 4)
    out = torch.empty_like(x)
    payload = codec.encode(x)
    ratio = payload.numel() * payload.element_size() / nbytes
    if codec.lossless:
        return 0.0, ratio
    return best_time(lambda: codec.decode(codec.encode(x, out=payload), out), repeats) / nbytes, ratio


def calibrate(comm: Communicator, repeats: int = 10, codecs: tuple[str | None, ...] = (None, "bf16", "fp16", "int8"),
              max_bytes: int = SIZES[-1]) -> Calibration:
    """Measure alpha, beta (ring-shift fit over message sizes up to `max_bytes`), gamma (float32 add
    per byte), S (barrier) and each codec's encode+decode cost; each the best of `repeats` on a rank,
    then the maximum over ranks.

    Collective over `comm`; takes about a second. Returns the same Calibration on every rank."""
    sizes = [m for m in SIZES if m <= max_bytes]
    shifts = _shift_times(comm, sizes, repeats) if comm.size > 1 else [0.0] * len(sizes)
    a, b = torch.randn(max_bytes // 4), torch.randn(max_bytes // 4)
    gamma = best_time(lambda: a.add_(b), repeats) / (a.numel() * 4)
    sync = best_time(comm.barrier, repeats) if comm.size > 1 else 0.0
    costs = [codec_cost(c, nbytes=max_bytes, repeats=repeats) for c in codecs]
    local = torch.tensor([*shifts, gamma, sync, *(c for c, _ in costs)], dtype=torch.float64)
    comm.allreduce(local, op="max")
    k = len(sizes)
    shifts, (gamma, sync), per_byte = local[:k].tolist(), local[k:k + 2].tolist(), local[k + 2:].tolist()
    alpha, beta = fit_alpha_beta(sizes, shifts)
    names = [str(c) for c in codecs]
    return Calibration(alpha=alpha, beta=beta, gamma=gamma, S=sync, codec_per_byte=dict(zip(names, per_byte)),
                       wire_ratio={n: r for n, (_, r) in zip(names, costs)})


@dataclass(frozen=True)
class LinkCost:
    """``t(m) = alpha + beta * m`` seconds for a message or collective of `m` bytes per rank."""

    alpha: float
    beta: float

    def time(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.alpha + self.beta * nbytes


@dataclass(frozen=True)
class Network:
    """Alpha-beta of one communicator level (its ranks all on one node, or spanning nodes), measured
    for the three patterns the strategies use: a ring shift (point-to-point: pipeline activations,
    halos), allreduce (gradients) and alltoall (redistribution). `ranks`: the level's size."""

    level: str
    ranks: int
    p2p: LinkCost
    allreduce: LinkCost
    alltoall: LinkCost


#: Message sizes (bytes per rank) of :func:`measure_network`.
NETWORK_SIZES = (8, 65536, 1048576, 4194304)


def _collective_times(comm: Communicator, sizes: Sequence[int], repeats: int) -> list[list[float]]:
    """Best seconds of [shift, allreduce, alltoall] per size on this rank (every rank calls)."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    out = []
    for m in sizes:
        n = max(m // 4, comm.size)
        n -= n % comm.size
        send, recv = torch.zeros(n), torch.empty(n)
        counts = [n // comm.size] * comm.size
        row: list[float] = []
        fns: list[Callable[[], object]] = [
            lambda s=send, r=recv: comm.sendrecv(s, right, r, left),  # type: ignore[misc]
            lambda s=send: comm.allreduce(s),  # type: ignore[misc]
            lambda s=send, c=counts: comm.alltoallv(s, c, c)]  # type: ignore[misc]
        for fn in fns:
            comm.barrier()
            row.append(best_time(fn, repeats))
        out.append(row)
    return out


def measure_network(comm: Communicator, repeats: int = 5, sizes: Sequence[int] = NETWORK_SIZES,
                    level: str = "world") -> Network:
    """Alpha-beta fits (:func:`fit_alpha_beta`) of point-to-point, allreduce and alltoall over `comm`,
    each size the best of `repeats` on a rank, then the maximum over ranks (the slowest rank bounds a
    synchronous step). Collective over `comm`; the same Network on every rank. A one-rank `comm`
    costs nothing (all zero)."""
    if comm.size == 1:
        zero = LinkCost(0.0, 0.0)
        return Network(level, 1, zero, zero, zero)
    local = torch.tensor(_collective_times(comm, sizes, repeats), dtype=torch.float64)
    comm.allreduce(local, op="max")
    costs = [LinkCost(*fit_alpha_beta(list(sizes), local[:, k].tolist())) for k in range(3)]
    return Network(level, comm.size, *costs)


def _ring_scale(n: int) -> tuple[float, float]:
    """(latency terms, bytes per rank moved per byte) of a ring allreduce over n ranks (Pipe-SGD
    eqs. 5-6: 2(n-1) steps, 2(n-1)/n of the data)."""
    return 2.0 * (n - 1), 2.0 * (n - 1) / n


def _alltoall_scale(n: int) -> tuple[float, float]:
    """(messages, bytes sent per byte) of an alltoall over n ranks: n-1 messages, (n-1)/n of the data."""
    return float(n - 1), (n - 1) / n


def extrapolate_network(net: Network, world: int) -> Network:
    """`net` (measured on ``net.ranks`` >= 2 ranks) priced for `world` ranks: the per-link alpha and
    beta behind each pattern's fit are kept and the pattern's step and byte counts rescaled (ring
    allreduce 2(W-1) steps and 2(W-1)/W of the bytes; alltoall W-1 messages and (W-1)/W; a ring shift
    is one message whatever W). An estimate, not a measurement: contention that grows with W (more
    ranks per core, per link) is not in it."""
    n = net.ranks
    if world == n:
        return net
    if n < 2:
        raise ValueError("extrapolating a network needs a measurement on at least 2 ranks")

    def rescale(link: LinkCost, scale: Callable[[int], tuple[float, float]]) -> LinkCost:
        (a0, b0), (a1, b1) = scale(n), scale(max(world, 1))
        return LinkCost(link.alpha / a0 * a1, link.beta / b0 * b1)

    return Network(net.level, world, net.p2p, rescale(net.allreduce, _ring_scale),
                   rescale(net.alltoall, _alltoall_scale))


def extrapolate_calibration(cal: Calibration, measured_ranks: int, world: int) -> Calibration:
    """Pipe-SGD's constants for `world` ranks from a calibration on `measured_ranks`: alpha, beta and
    gamma are per link and per byte (the formulas take the rank count), the barrier S grows with the
    log of the ranks (a dissemination barrier's rounds)."""
    rounds = math.log2(max(world, 2)) / math.log2(max(measured_ranks, 2))
    return Calibration(cal.alpha, cal.beta, cal.gamma, cal.S * rounds, dict(cal.codec_per_byte),
                       dict(cal.wire_ratio))
