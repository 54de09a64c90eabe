"""The cost model of the model and hybrid strategies (HyPar-Flow): a pipeline of P partitions, R
replicas, M micro-batches per replica.

One step of a synchronous pipeline schedule (GPipe or 1F1B: same length) has ``M + P - 1`` slots; in
each, the slowest partition runs one micro-batch's forward plus backward and passes its activation
forward and its partial error backward point-to-point. ``P - 1`` of the slots are the fill and drain
(the bubble); the replicas' gradient allreduce of a partition follows its last backward::

    step = M * t_max  +  (P - 1) * t_max  +  (M + P - 1) * 2 * p2p(a_max)  +  AR_R(g_max)  +  l_up
           compute       bubble             activations and errors           gradients

with ``t_max`` the slowest partition's forward+backward seconds on one micro-batch, ``a_max`` the
largest activation crossing a boundary, ``g_max`` the largest partition's gradient bytes, ``AR_R``
the allreduce over R replicas and ``l_up`` the update (Pipe-SGD eq. 2's term). HyPar-Flow (§
"Exploiting Pipeline Stages within Each Minibatch") picks M by trying the largest number of
micro-batches and halving it: :func:`micro_batch_candidates`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PipelineCost", "pipeline_step", "micro_batch_candidates"]


@dataclass(frozen=True)
class PipelineCost:
    """Seconds of one pipeline step, split for display; `total` is their sum."""

    compute: float
    bubble: float
    communication: float
    update: float

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.communication + self.update


def pipeline_step(t_max: float, M: int, P: int, p2p_s: float, allreduce_s: float, update_s: float = 0.0
                  ) -> PipelineCost:
    """The module formula: `t_max` slowest partition per micro-batch (fwd+bwd), `p2p_s` one boundary
    message of the largest activation, `allreduce_s` the replicas' allreduce of the largest partition."""
    if M < 1 or P < 1:
        raise ValueError(f"M and P must be >= 1, got M={M}, P={P}")
    slots = M + P - 1
    comm = (2 * slots * p2p_s if P > 1 else 0.0) + allreduce_s
    return PipelineCost(compute=M * t_max, bubble=(P - 1) * t_max, communication=comm, update=update_s)


def micro_batch_candidates(per_replica: int, limit: int = 64) -> list[int]:
    """HyPar-Flow's search: the largest micro-batch count dividing `per_replica` samples (at most
    `limit`), then halvings of it that still divide, down to 1."""
    m = max((d for d in range(1, min(per_replica, limit) + 1) if per_replica % d == 0), default=1)
    out = []
    while m >= 1:
        if per_replica % m == 0:
            out.append(m)
        m //= 2
    return sorted(set(out), reverse=True)
