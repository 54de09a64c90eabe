"""The cost model of the model and hybrid strategies (HyPar-Flow): a pipeline of P partitions, R
replicas, M micro-batches per replica.

One step of a synchronous pipeline schedule (GPipe or 1F1B: same length; the other schedules' bubble
is simulated, see :func:`pipeline_step`) has ``M + P - 1`` slots: the
first micro-batch passes through every partition (forward and backward: the sum of the partitions'
times), the other ``M - 1`` follow at the rate of the slowest partition; each slot passes an
activation forward and a partial error backward point-to-point; the replicas' gradient allreduce of a
partition follows its last backward::

    step = M * t_max  +  (sum_p t_p - t_max)  +  (M + P - 1) * 2 * p2p(a_max)  +  AR_R(g_max)  +  l_up
           compute       bubble                 activations and errors           gradients

(``(M + P - 1) t_max`` for balanced partitions), with ``t_p`` partition p's forward+backward seconds
on one micro-batch, ``t_max`` the slowest, ``a_max`` the
largest activation crossing a boundary, ``g_max`` the largest partition's gradient bytes, ``AR_R``
the allreduce over R replicas and ``l_up`` the update (Pipe-SGD eq. 2's term). HyPar-Flow (§
"Exploiting Pipeline Stages within Each Minibatch") picks M by trying the largest number of
micro-batches and halving it: :func:`micro_batch_candidates`.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def pipeline_step(stage_s: Sequence[float], M: int, p2p_s: float, allreduce_s: float, update_s: float = 0.0,
                  bubble_s: float | None = None, chunks: int = 1) -> PipelineCost:
    """The module formula: `stage_s` each pipeline rank's seconds per micro-batch (fwd+bwd), `p2p_s`
    one boundary message of the largest activation, `allreduce_s` the replicas' allreduce of the
    largest partition. Other schedules than GPipe/1F1B: `bubble_s` is their bubble (the caller
    simulates the schedule on the partitions' times, :func:`mpitrain.strategies.pipeline.schedule.simulate`,
    and subtracts ``M * max(stage_s)``), `chunks` the partitions per rank (v): a micro-batch crosses
    ``chunks`` boundaries per rank, ``2 (M chunks + P - 1)`` messages."""
    P = len(stage_s)
    if M < 1 or P < 1 or chunks < 1:
        raise ValueError(f"M, the number of partitions and chunks must be >= 1, got M={M}, P={P}, chunks={chunks}")
    t_max = max(stage_s)
    comm = (2 * (M * chunks + P - 1) * p2p_s if P > 1 else 0.0) + allreduce_s
    bubble = sum(stage_s) - t_max if bubble_s is None else bubble_s
    return PipelineCost(compute=M * t_max, bubble=bubble, communication=comm, update=update_s)


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
