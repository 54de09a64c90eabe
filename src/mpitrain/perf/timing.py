"""Pipe-SGD's timing model (§3.1, eqs. 2-7): per-iteration time of sync vs pipelined training.

All times are seconds, sizes bytes. The ring allreduce of ``n`` bytes over ``p`` workers in ``L``
segments costs (Thakur et al., as used in eqs. 5-6)::

    l_comm(L) = 2 (p-1) L alpha + 2 (p-1)/p n beta + (p-1)/p n gamma + L S

Per-iteration predictions (multiply by T for the totals of the paper):

============  ===============================================  =====
key           formula                                          eq.
============  ===============================================  =====
sync          l_up + l_for + l_back + l_comm(1)                2
pipe_ideal    (l_up + l_for + l_back + l_comm(1)) / K          3
pipe          max(l_up + l_for + l_back, l_comm(1))            4, 5
pipe_seg      max(l_up + l_for + l_b, l_comm(L))               6
sync_seg      l_up + l_for + max(l_back, l_b + l_comm(L))      Fig. 2(b), our reading
============  ===============================================  =====

``l_b`` is the backward time of the first gradient segment (``l_back / L`` unless given). Lossy
compression enters as ``wire_ratio`` (wire bytes per input byte: 0.5 for bf16/fp16, ~0.25 for int8)
and ``codec_per_byte`` (seconds of encode+decode per input byte and hop; the ring encodes each
element ``p`` times and decodes it ``p`` times per rank-path, i.e. about 2 n seconds-per-byte per
rank). ``l_codec`` is added to the communication term (the comm thread pays it, off the critical
path in Pipe-SGD and on it in sync training, as §4 observes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["TimingInputs", "ring_allreduce_time", "codec_time", "predict", "scaling_efficiency"]


@dataclass(frozen=True)
class TimingInputs:
    """Measured or assumed quantities of eqs. 2-7 (seconds, bytes)."""

    l_up: float
    l_for: float
    l_back: float
    alpha: float
    beta: float
    gamma: float
    n_bytes: float
    p: int
    S: float = 0.0
    L: int = 1
    K: int = 2
    l_b: float | None = None
    wire_ratio: float = 1.0
    codec_per_byte: float = 0.0

    def with_codec(self, wire_ratio: float, codec_per_byte: float) -> TimingInputs:
        return replace(self, wire_ratio=wire_ratio, codec_per_byte=codec_per_byte)


def ring_allreduce_time(n_bytes: float, p: int, alpha: float, beta: float, gamma: float, S: float = 0.0,
                        L: int = 1, wire_ratio: float = 1.0) -> float:
    """l_comm of eqs. 5-6: ring allreduce of `n_bytes` over `p` ranks in `L` segments (0 for p = 1).

    `wire_ratio` scales the bytes on the wire (beta term), not the bytes summed (gamma term)."""
    if p <= 1:
        return 0.0
    f = (p - 1) / p
    return 2 * (p - 1) * L * alpha + 2 * f * n_bytes * wire_ratio * beta + f * n_bytes * gamma + L * S


def codec_time(x: TimingInputs) -> float:
    """Encode+decode time per allreduce on one rank: each of the n bytes is encoded and decoded
    about twice along the ring (p-1 reduce hops of a 1/p block, plus the final block and p-1 decodes)."""
    return 0.0 if x.p <= 1 else 2 * x.n_bytes * x.codec_per_byte


def predict(x: TimingInputs) -> dict[str, float]:
    """Per-iteration seconds for every schedule of the module table, plus 'l_comm' and 'l_comp'."""
    comp = x.l_up + x.l_for + x.l_back
    extra = codec_time(x)
    comm1 = ring_allreduce_time(x.n_bytes, x.p, x.alpha, x.beta, x.gamma, x.S, 1, x.wire_ratio) + extra
    comm_l = ring_allreduce_time(x.n_bytes, x.p, x.alpha, x.beta, x.gamma, x.S, x.L, x.wire_ratio) + extra
    l_b = x.l_back / x.L if x.l_b is None else x.l_b
    return {
        "l_comp": comp,
        "l_comm": comm1,
        "sync": comp + comm1,
        "pipe_ideal": (comp + comm1) / x.K,
        "pipe": max(comp, comm1) if x.K >= 2 else comp + comm1,
        "pipe_seg": max(x.l_up + x.l_for + l_b, comm_l) if x.K >= 2 else x.l_up + x.l_for + max(x.l_back,
                                                                                                 l_b + comm_l),
        "sync_seg": x.l_up + x.l_for + max(x.l_back, l_b + comm_l),
    }


def scaling_efficiency(l_up: float, l_comp: float, l_comm: float) -> float:
    """Eq. 7: SE = (l_up + l_comp) / max(l_up + l_comp, l_comm); 1 when compute bound."""
    work = l_up + l_comp
    return work / max(work, l_comm) if work > 0 else 0.0
