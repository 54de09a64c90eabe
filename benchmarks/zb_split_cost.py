"""Where a zero-bubble step's time goes (issue #28): the benchmark's GPT-2 (4 x 128, vocabulary 2000, tied,
16 x 64 tokens, M = 4, ``balance="time"``) under ``fit``'s pipeline at P = world size.

1. Per action kind (F, I, W, or B) per step and rank: thread-CPU time (``time.thread_time``: the time this
   rank computed, less sensitive to a loaded machine than wall time), wall time, and the wall time spent
   waiting for messages inside the actions; "outside" is the step's time between actions (loss,
   gradient reductions, optimizer step), with the trainer's phases around the schedule apart
   (``begin_step``: clearing gradients; ``finish_gradients``: the tied weight's allreduce, and the
   replicas' where R > 1; ``update``: the optimizer step); the rest of "outside" is the loss, the loss
   allreduce and the pass's own bookkeeping. Timed by wrapping ``Stage``'s and the trainer's methods in
   this script, for 1f1b, zb1p and zbv.
2. Per partition, in one process (each rank its own partition, no messages): one micro-batch's forward,
   its whole backward (B), and the split backward (I, then W) on the same inputs, alternated, medians of
   thread-CPU times; the gradients of both are compared (max abs difference).
3. ``schedule.simulate`` on the times of 2. (``action_costs``): each schedule's efficiency against one
   process running the same partitions' forwards and whole backwards, as measured, with the split's
   extra cost removed, with the same total work cut evenly, and with both.

    PYTHONPATH=. .venv/bin/mpitrain run -n 2 -- .venv/bin/python benchmarks/zb_split_cost.py \
        [STEPS] [REPS] [CUT] [--gpt-...]

CUT (P = 2 only; 0 or absent: ``balance="time"``): a hand cut in nodes per partition of the 4-layer
GPT-2's 298-node graph, "c" for 1f1b and zb1p (``balance=[c, 298 - c]``) or "a,b,c,d" for zbv's four
partitions. After it, the options of ``mpitrain bench pipeline`` for the GPT-2 (``--gpt-width 512
--gpt-vocab 8000``: a bigger model).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from mpitrain.bench.pipeline import _gpt2, _lm_loss, _parse, _sgd
from mpitrain.runtime import init
from mpitrain.strategies.base import FitSpec
from mpitrain.strategies.pipeline import _cut, _stage
from mpitrain.strategies.pipeline._backward import input_gradients
from mpitrain.strategies.pipeline._trainer import make_trainer
from mpitrain.strategies.pipeline.schedule import simulate

KINDS = {"forward": lambda kw: "F", "backward": lambda kw: "I" if kw.get("split") else "B",
         "backward_weight": lambda kw: "W"}


def profile_actions(trainer: Any, ids: torch.Tensor, labels: torch.Tensor, steps: int) -> str:
    """Per action kind: count, thread-CPU, wall and message-wait ms per step on this rank."""
    acc: dict[str, list[float]] = {}
    waited = [0.0]
    saved = {name: getattr(_stage.Stage, name) for name in [*KINDS, "_wait"]}

    def wait(self: Any, req: Any, what: str) -> None:
        t = time.perf_counter()
        saved["_wait"](self, req, what)
        waited[0] += time.perf_counter() - t

    def wrap(name: str) -> Callable[..., Any]:
        def timed(self: Any, *a: Any, **kw: Any) -> Any:
            w, c, q = time.perf_counter(), time.thread_time(), waited[0]
            out = saved[name](self, *a, **kw)
            v = acc.setdefault(f"{KINDS[name](kw)} p{self.part.index}", [0.0, 0.0, 0.0, 0.0])
            v[0] += 1
            v[1] += time.thread_time() - c
            v[2] += time.perf_counter() - w
            v[3] += waited[0] - q
            return out
        return timed

    _stage.Stage._wait = wait  # type: ignore[method-assign]
    for name in KINDS:
        setattr(_stage.Stage, name, wrap(name))
    outside: dict[str, list[float]] = {}  # the trainer's per-step work around the schedule, by phase
    phases = {name: getattr(trainer, name) for name in ("begin_step", "finish_gradients", "update")}

    def phase(name: str) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            w, c = time.perf_counter(), time.thread_time()
            out = phases[name](*a, **kw)
            v = outside.setdefault(name, [0.0, 0.0])
            v[0] += time.thread_time() - c
            v[1] += time.perf_counter() - w
            return out
        return timed

    for name in phases:
        setattr(trainer, name, phase(name))
    wall = cpu = 0.0
    try:
        for _ in range(steps):
            trainer.comm.barrier()
            w, c = time.perf_counter(), time.thread_time()
            trainer.train_step(ids, labels)
            wall += time.perf_counter() - w
            cpu += time.thread_time() - c
    finally:
        for name, fn in saved.items():
            setattr(_stage.Stage, name, fn)
        for name in phases:
            delattr(trainer, name)
    lines = [f"step: cpu {cpu / steps * 1e3:.1f} ms, wall {wall / steps * 1e3:.1f} ms"]
    for kind, (n, c, w, q) in sorted(acc.items()):
        lines.append(f"  {kind} x{n / steps:.0f}: cpu {c / steps * 1e3:6.2f}  wall {w / steps * 1e3:6.2f}  "
                     f"of which message waits {q / steps * 1e3:6.2f} ms per step")
        cpu, wall = cpu - c, wall - w
    for name, (c, w) in outside.items():
        lines.append(f"  outside, {name}: cpu {c / steps * 1e3:6.2f}  wall {w / steps * 1e3:6.2f} ms per step")
    lines.append(f"  outside actions: cpu {cpu / steps * 1e3:6.2f}  wall {wall / steps * 1e3:6.2f} ms per step")
    return "\n".join(lines)


def split_against_whole(trainer: Any, ids: torch.Tensor, labels: torch.Tensor, reps: int) -> dict[str, float]:
    """This rank's partition: one micro-batch's F, whole B, I and W (medians of thread-CPU seconds),
    on the inputs it received in a real step."""
    stage = trainer.pipe.stages[0]
    module, k = stage.part.module, stage.part.index
    got: list[Any] = []
    hook = module.register_forward_pre_hook(
        lambda m, a: got.append([x.detach().clone() if isinstance(x, torch.Tensor) else x for x in a]) or None)
    trainer.train_step(ids, labels)
    hook.remove()
    args = got[0]
    rows = args[0].shape[0] if isinstance(args[0], torch.Tensor) else ids.shape[0] // trainer.pipe.M
    target = labels[:rows].reshape(-1)
    last = k == len(trainer.pipe._parts) - 1
    params = [q for q in module.parameters() if q.requires_grad]

    def forward() -> tuple[list[torch.Tensor], list[torch.Tensor | None], list[torch.Tensor]]:
        xs = [x.clone().requires_grad_() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
              for x in args]
        out = module(*xs)
        if last:  # the loss as fit computes it on the last partition (outside the graph)
            logits = out[0]
            outs: list[torch.Tensor] = [torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                                          target)]
            seeds: list[torch.Tensor | None] = [None]
        else:
            outs = [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]
            seeds = [torch.full_like(o, 1e-3) for o in outs]
        return outs, seeds, [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad]

    t: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": []}
    diff = 0.0
    for _ in range(reps):
        for q in params:
            q.grad = None
        c = time.thread_time()
        outs, seeds, _ = forward()
        t["F"].append(time.thread_time() - c)
        c = time.thread_time()
        torch.autograd.backward(outs, [s if s is not None else torch.ones_like(o) for o, s in zip(outs, seeds)])
        t["B"].append(time.thread_time() - c)
        whole = [q.grad for q in params]
        for q in params:
            q.grad = None
        outs, seeds, leaves = forward()
        c = time.thread_time()
        work = input_gradients(outs, seeds, leaves, params)
        t["I"].append(time.thread_time() - c)
        c = time.thread_time()
        work.run()
        t["W"].append(time.thread_time() - c)
        diff = max([diff, *(float((q.grad - g).abs().max()) for q, g in zip(params, whole) if g is not None)])
    out = {kind: statistics.median(v) for kind, v in t.items()}
    out["split/whole"] = statistics.median([(i + w) / b for i, w, b in zip(t["I"], t["W"], t["B"])])
    out["max diff"] = diff
    return out


def simulated(costs: list[dict[str, float]], M: int) -> list[str]:
    """Each schedule's efficiency on the measured times, against one process running every partition's
    F and whole B: as measured, without the split's extra cost, and with the work cut evenly."""
    P = len(costs)
    one = M * sum(c["F"] + c["B"] for c in costs)
    free = [dict(c, I=c["I"] * c["B"] / (c["I"] + c["W"]), W=c["W"] * c["B"] / (c["I"] + c["W"])) for c in costs]
    lines = []
    for label in ("as measured", "split at no extra cost", "work cut evenly", "both"):
        effs = []
        for name, kinds in (("1f1b", "FB"), ("zb1p", "FIW")):
            table = free if label in ("split at no extra cost", "both") else costs
            if label in ("work cut evenly", "both"):  # each rank's work under this schedule scaled to the mean
                work = [sum(c[k] for k in kinds) for c in table]
                table = [{k: v * sum(work) / (P * w) for k, v in c.items()} for c, w in zip(table, work)]
            effs.append(f"{name} {one / (P * simulate(P, M, name, action_costs=table)):.3f}")
        lines.append(f"simulated efficiency, {label}: " + ", ".join(effs))
    return lines


def _model_shares(weighed: list[list[float]], at: list[int], cut: list[int]) -> str:
    """Each partition's share of the per-node costs balance="time" weighed (what the cut assumes: compare
    with the measured CPU of the actions per partition, p0, p1, ...)."""
    if cut or not weighed:
        return ""
    costs = weighed[-1]
    parts = [sum(costs[a:b]) for a, b in zip(at, at[1:])]
    return " (weighed shares " + " / ".join(f"{c / sum(parts):.3f}" for c in parts) + ")"


def _balance(cut: list[int], schedule: str) -> Any:
    """The hand cut of the command line for `schedule`, or "time"."""
    if len(cut) == 1 and schedule != "zbv":
        return [cut[0], 298 - cut[0]]
    return cut if len(cut) == 4 and schedule == "zbv" else "time"


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    # CUT: nodes per partition at P = 2, "c" (zb1p, 1f1b: [c, rest]) or "a,b,c,d" (zbv's 4); 0: balance="time"
    cut = [int(c) for c in sys.argv[3].split(",")] if len(sys.argv) > 3 and sys.argv[3] != "0" else []
    comm = init()
    args = _parse(sys.argv[4:])  # the bench's GPT-2 options (--gpt-width ...), after STEPS REPS CUT
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.gpt_vocab, (args.gpt_batch, args.gpt_seq), generator=g)
    labels = torch.randint(0, args.gpt_vocab, (args.gpt_batch, args.gpt_seq), generator=g)
    report = []
    costs: dict[str, float] = {}
    weighed: list[list[float]] = []  # the per-node costs balance="time" cut by (each cut)
    bounds = _cut.bounds

    def spy(balance: Any, parts: int, costs: Any, cuts: Any) -> list[int]:
        if balance == "time":
            weighed.append(list(costs))
        return bounds(balance, parts, costs, cuts)

    _cut.bounds = spy
    for schedule in ("1f1b", "zb1p", "zbv"):
        spec = FitSpec(strategy="model", partitions=comm.size, micro_batches=args.gpt_micro, schedule=schedule,
                       balance=_balance(cut, schedule))
        trainer = make_trainer(_gpt2(args), _lm_loss, _sgd, comm, spec)
        for _ in range(3):
            trainer.train_step(ids, labels)
        report.append(f"rank {comm.rank}, {schedule}, cuts {trainer.pipe.bounds}"
                      + _model_shares(weighed, trainer.pipe.bounds, cut) + ": "
                      + profile_actions(trainer, ids, labels, steps))
        if schedule == "zb1p":
            costs = split_against_whole(trainer, ids, labels, reps)
    gathered = comm.allgather_object((report, costs))
    if comm.rank == 0:
        for lines, _ in gathered:
            print("\n".join(lines))
        for r, (_, c) in enumerate(gathered):
            print(f"partition {r}, one micro-batch, thread-CPU ms: F {c['F'] * 1e3:.2f}, whole B {c['B'] * 1e3:.2f}, "
                  f"I {c['I'] * 1e3:.2f} + W {c['W'] * 1e3:.2f} (split/whole {c['split/whole']:.3f}); "
                  f"gradients' max difference {c['max diff']:.1e}")
        print("\n".join(simulated([c for _, c in gathered], args.gpt_micro)))


if __name__ == "__main__":
    main()
