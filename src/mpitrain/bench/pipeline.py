"""Sequential vs model vs data vs hybrid img/s on a deep residual CNN, pipeline efficiency, and
tokens/s of a GPT-2 (model under 1F1B, interleaved, zb1p and zbv vs data vs hybrid).

``mpitrain bench pipeline -n 2`` (or -n 4). Table 1 has HyPar-Flow's Fig. 7/8 shape: images per
second of one training step at several batch sizes for one process (rank 0 alone, the others asleep),
the pipeline
(P = n), data parallelism (R = n) and, when n is even and >= 4, hybrid (P = 2, R = n/2). Table 2
measures the pipeline efficiency ``T_seq / (P * T_pipe)`` of both schedules, where T_seq is one
process running the same M micro-batches (gradient accumulation), against the ideal M / (M + P - 1).
A contender's time is the median over `--rounds` interleaved rounds of its median over `--steps`
steps (the slowest rank's, each step started after a barrier); a ratio of two contenders (speed-up,
efficiency) is the median of their per-round ratios (:func:`~mpitrain.bench.common.paired_rounds`),
so the drifts of this shared machine, phases of seconds, cancel; "q25-q75" columns give its spread.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..comm.base import Communicator
from ..fit import FitSpec, make_trainer
from ..perf.memory import step_memory
from ..runtime import init
from ..strategies.pipeline.schedule import bubble_efficiency
from .common import (
    DEVICE_STEPS,
    add_outputs,
    add_precisions,
    alone_timer,
    header,
    median,
    paired_ratio,
    paired_rounds,
    print_table,
    quartiles,
    save_outputs,
    step_timer,
    without_cuda,
)

__all__ = ["main", "ResidualCNN"]


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + x)


class ResidualCNN(nn.Module):
    """ResNet-style: a stem, `depth` identical identity-shortcut blocks (so it balances), a head."""

    def __init__(self, depth: int = 12, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.Sequential(*[_Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(torch.relu(self.stem(x))).mean(dim=(2, 3)))
        return out


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _batch(n: int, image: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 3, image, image, generator=g), torch.randint(0, 10, (n,), generator=g)


Timer = Callable[[], float]


def _sequential_step(args: argparse.Namespace, n: int, micro: int) -> Callable[[], None]:
    """One process's training step of the whole model on `n` samples, M micro-batches accumulated."""
    torch.manual_seed(0)
    model, (x, y) = ResidualCNN(args.depth, args.width), _batch(n, args.image)
    opt, loss_fn = _sgd(model.parameters()), nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        for xs, ys in zip(x.chunk(micro), y.chunk(micro)):
            (loss_fn(model(xs), ys) / micro).backward()
        opt.step()

    return step


def _sequential(comm: Communicator, args: argparse.Namespace, n: int, micro: int) -> Timer:
    """A timer: rank 0 alone trains the whole model (M micro-batches accumulated) while the other ranks
    sleep (:func:`~mpitrain.bench.common.alone_timer`); the median over `args.steps` steps."""
    step = _sequential_step(args, n, micro) if comm.rank == 0 else None
    return alone_timer(comm, step, args.steps)


def _sequential_everywhere(comm: Communicator, args: argparse.Namespace, n: int, micro: int) -> Timer:
    """A timer: every rank trains the whole model at the same time, no messages (slowest rank): one
    process's step when P of them share this machine's cores and memory as the pipeline's ranks do."""
    return step_timer(comm, _sequential_step(args, n, micro), args.steps)


def _parallel(comm: Communicator, args: argparse.Namespace, n: int, strategy: str, partitions: int = 1,
              micro: int = 1, schedule: str = "1f1b") -> tuple[Timer, Any]:
    """A timer of `strategy`'s training step, and its trainer."""
    torch.manual_seed(0)
    spec = FitSpec(strategy=strategy, partitions=partitions, micro_batches=micro, schedule=schedule)
    trainer = make_trainer(ResidualCNN(args.depth, args.width), nn.CrossEntropyLoss(), _sgd, comm, spec)
    x, y = _batch(n, args.image)
    return step_timer(comm, lambda: trainer.train_step(x, y), args.steps), trainer


def throughput_table(comm: Communicator, args: argparse.Namespace) -> None:
    size = comm.size
    rows = []
    for n in args.batch_sizes:
        micro = max(1, min(args.micro_batches, n // args.min_micro))
        timers = {"seq": _sequential(comm, args, n, 1), "model": _parallel(comm, args, n, "model", size, micro)[0],
                  "data": _parallel(comm, args, n, "data")[0]}
        if size >= 4 and size % 2 == 0:
            timers["hybrid"] = _parallel(comm, args, n, "hybrid", 2, micro)[0]
        t = paired_rounds(timers, args.rounds)
        hy = n / median(t["hybrid"]) if "hybrid" in t else "n/a"
        rows.append([n, micro, n / median(t["seq"]), n / median(t["model"]), n / median(t["data"]), hy,
                     paired_ratio(t["seq"], t["model"]), paired_ratio(t["seq"], t["data"])])
    if comm.rank == 0:
        print(f"\n## img/s per training step (deep residual CNN: {args.depth} blocks x {args.width} ch, "
              f"{args.image}x{args.image} images; model: P={size}, data: R={size}, "
              f"hybrid: P=2 x R={size // 2})")
        print_table(["batch", "M", "sequential", "model", "data", "hybrid", "model/seq", "data/seq"], rows)


def efficiency_table(comm: Communicator, args: argparse.Namespace) -> None:
    P, rows = comm.size, []
    bound = min(1.0, (os.cpu_count() or 1) / P)  # P ranks on fewer cores cannot beat cores/P
    n = args.efficiency_batch
    for micro in args.efficiency_micro:
        timers = {"seq": _sequential(comm, args, n, micro), "seq all": _sequential_everywhere(comm, args, n, micro)}
        trainers = {}
        for schedule in ("gpipe", "1f1b"):
            timers[schedule], trainers[schedule] = _parallel(comm, args, n, "model", P, micro, schedule)
        t = paired_rounds(timers, args.rounds)
        for schedule in ("gpipe", "1f1b"):
            ideal = micro / (micro + P - 1)
            effs = [a / (P * b) for a, b in zip(t["seq"], t[schedule])]
            eff = median(effs)
            # oversubscribed, P whole models at once thrash the cores as the pipeline's stages do not
            machine = paired_ratio(t["seq all"], t[schedule]) / P / ideal if bound == 1.0 else "-"
            cuts = ",".join(map(str, trainers[schedule].bounds[1:-1]))
            rows.append([schedule, P, micro, n, cuts, median(t["seq"]) * 1e3, median(t["seq all"]) * 1e3,
                         median(t[schedule]) * 1e3, eff, quartiles(effs), ideal, eff / (ideal * bound),
                         machine])
    if comm.rank == 0:
        print("\n## pipeline efficiency T_seq / (P x T_pipe) vs the ideal M / (M + P - 1) (balance='time');"
              "\n## 'of core ideal' = efficiency / (ideal x min(1, cores / P)): what P ranks sharing the "
              "cores can reach;\n## 'T_seq all' = T_seq with every rank running it at once (no messages); "
              "'of machine ideal' = T_seq all / (P x T_pipe) / ideal (ranks <= cores only)")
        print_table(["schedule", "P", "M", "batch", "cuts", "T_seq ms", "T_seq all ms", "T_pipe ms",
                     "efficiency", "q25-q75", "ideal", "of core ideal", "of machine ideal"], rows)


def _transformers() -> Any:
    """transformers, imported without torchvision when torchvision's C++ ops do not load with this
    torch (transformers then skips its image utilities)."""
    import importlib

    try:
        import torchvision  # noqa: F401
    except Exception:
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision"] = None  # type: ignore[assignment]
    return importlib.import_module("transformers")


def _gpt2(args: argparse.Namespace) -> nn.Module:
    tf = _transformers()
    config = tf.GPT2Config(n_layer=args.gpt_layers, n_embd=args.gpt_width, n_head=max(1, args.gpt_width // 64),
                           vocab_size=args.gpt_vocab, n_positions=args.gpt_seq, resid_pdrop=0.0, embd_pdrop=0.0,
                           attn_pdrop=0.0, attn_implementation="eager", use_cache=False, bos_token_id=0,
                           eos_token_id=0)
    torch.manual_seed(0)
    model: nn.Module = tf.GPT2LMHeadModel(config)
    return model


def _lm_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a ModelOutput's logits."""
    return nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), labels.reshape(-1))


def transformer_table(comm: Communicator, args: argparse.Namespace) -> None:
    """tokens/s of a GPT-2 (tied embeddings, captured by torch.export) for one process alone, P
    processes alone at once ("seq all", the machine's ceiling), data, model (every schedule of
    ``--gpt-schedules``), and hybrid; efficiencies against the machine's ceiling."""
    size, n, micro = comm.size, args.gpt_batch, args.gpt_micro
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.gpt_vocab, (n, args.gpt_seq), generator=g)
    labels = torch.randint(0, args.gpt_vocab, (n, args.gpt_seq), generator=g)
    inputs = ids  # input_ids, positionally: the data strategy slices tensors and tuples only

    def sequential_step() -> Callable[[], None]:
        model = _gpt2(args)
        opt = _sgd(model.parameters())

        def step() -> None:
            opt.zero_grad()
            for i, l in zip(ids.chunk(micro), labels.chunk(micro)):
                (_lm_loss(model(input_ids=i), l) / micro).backward()
            opt.step()
        return step

    steps: dict[str, Callable[[], object]] = {}  # contender -> its training step (after the rounds: memory)

    def parallel(strategy: str, partitions: int, schedule: str = "1f1b") -> Timer:
        spec = FitSpec(strategy=strategy, partitions=partitions, micro_batches=micro if strategy != "data" else 1,
                       schedule=schedule, balance="time")
        trainer = make_trainer(_gpt2(args), _lm_loss, _sgd, comm, spec)
        steps[f"{strategy} {schedule}" if strategy != "data" else "data"] = lambda: trainer.train_step(inputs, labels)
        return step_timer(comm, lambda: trainer.train_step(inputs, labels), args.steps)

    timers = {"seq": alone_timer(comm, sequential_step() if comm.rank == 0 else None, args.steps),
              "seq all": step_timer(comm, sequential_step(), args.steps),
              "data": parallel("data", 1)}
    layouts: dict[str, tuple[int, str]] = {}  # contender -> (P, schedule)
    for schedule in args.gpt_schedules:
        if schedule == "interleaved-1f1b" and micro % size:
            continue  # M must be a multiple of P
        layouts[f"model {schedule}"] = (size, schedule)
        timers[f"model {schedule}"] = parallel("model", size, schedule)
    if size >= 4 and size % 2 == 0:
        layouts["hybrid 1f1b"] = (2, "1f1b")
        timers["hybrid 1f1b"] = parallel("hybrid", 2)
    t = paired_rounds(timers, args.rounds)
    tokens = n * args.gpt_seq
    rows = []
    for name in [k for k in timers if k not in ("seq", "seq all")]:
        # the machine's ceiling: P whole-model processes at once give P x (tokens / T_seq all)
        of_machine = paired_ratio(t["seq all"], t[name]) / size
        P, schedule = layouts.get(name, (1, "1f1b"))
        # the bubble of a balanced pipeline with F = I = W (schedule.bubble_efficiency): M / (M + P - 1)
        # for 1f1b, M / (M + (P - 1) / 2) interleaved (v = 2), 3M / (3M + P - 1) zb1p
        ideal = bubble_efficiency(schedule, P, micro, virtual=2, backward_cost=2.0, weight_cost=1.0)
        # one more step, profiled: the peak growth of live tensors per rank (activations held, messages)
        peaks = comm.allgather_object(step_memory(steps[name]))
        rows.append([name, tokens / median(t[name]), paired_ratio(t["seq"], t[name]), of_machine,
                     quartiles([a / (size * b) for a, b in zip(t["seq all"], t[name])]), ideal,
                     of_machine / ideal, "/".join(f"{p / 1e6:.0f}" for p in peaks)])
    if comm.rank == 0:
        print(f"\n## tokens/s per training step, GPT-2 ({args.gpt_layers} layers x {args.gpt_width}, vocab "
              f"{args.gpt_vocab}, tied embeddings; batch {n} x {args.gpt_seq} tokens, M={micro}); sequential "
              f"{tokens / median(t['seq']):.0f} tokens/s alone, {tokens / median(t['seq all']):.0f} with every "
              f"rank running it at once;\n## 'of machine' = (T_seq all / T) / P: the share of what {size} "
              f"concurrent processes get from this machine")
        print_table(["contender", "tokens/s", "speed-up vs seq", "of machine", "q25-q75", "bubble ideal",
                     "of machine ideal", "peak MB per rank"], rows)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mpitrain bench pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", type=_ints, default=[16, 64, 256])
    p.add_argument("--micro-batches", type=int, default=8, help="M for the throughput table")
    p.add_argument("--min-micro", type=int, default=4, help="fewest samples per micro-batch (table 1)")
    p.add_argument("--efficiency-micro", type=_ints, default=[2, 8, 16])
    p.add_argument("--efficiency-batch", type=int, default=64)
    p.add_argument("--depth", type=int, default=12)
    # ResNet's first-stage width; at 16 channels the steps are bound by memory bandwidth, which the
    # ranks of a small machine share (`mpitrain bench machine`; docs/pipeline.md)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--image", type=int, default=16)
    p.add_argument("--steps", type=int, default=1, help="timed steps per contender per round (median); "
                                                        "--device cuda: consecutive steps per timer, at least 10")
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds (ratios taken per round)")
    p.add_argument("--tables", default="throughput,efficiency,transformer",
                   help="comma-separated subset of throughput,efficiency,transformer")
    p.add_argument("--gpt-layers", type=int, default=4)
    p.add_argument("--gpt-width", type=int, default=128)
    p.add_argument("--gpt-vocab", type=int, default=2000)
    p.add_argument("--gpt-seq", type=int, default=64)
    p.add_argument("--gpt-batch", type=int, default=16)
    p.add_argument("--gpt-micro", type=int, default=4, help="M for the transformer table")
    p.add_argument("--gpt-schedules", type=lambda v: v.split(","), default=["1f1b", "interleaved-1f1b", "zb1p", "zbv"],
                   help="pipeline schedules of the transformer table (interleaved-1f1b only when P divides M)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: a deep MLP's pipeline on each rank's GPU vs one process of plain torch "
                        "(mpitrain.bench._pipeline_cuda); the CPU tables' options do not apply")
    p.add_argument("--batch", type=int, default=256, help="--device cuda: global batch")
    p.add_argument("--mlp-depth", type=int, default=16, help="--device cuda: hidden layers of the MLP")
    p.add_argument("--mlp-width", type=int, default=2048, help="--device cuda: width of the MLP")
    add_precisions(p)
    add_outputs(p)
    return p.parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv or [])
    if args.device == "cuda":
        return _main_cuda(args)
    comm = init()
    if comm.rank == 0:
        print(header("pipeline: sequential vs model vs data vs hybrid; pipeline efficiency", comm.size))
        cores = os.cpu_count() or 1
        note = f"OVERSUBSCRIBED: {comm.size} ranks on {cores} cores" if comm.size > cores else \
            f"{comm.size} ranks on {cores} cores"
        print(f"# {note}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')}; "
              f"torch threads per rank: {torch.get_num_threads()}", flush=True)
    tables = set(args.tables.split(","))
    if "throughput" in tables:
        throughput_table(comm, args)
    if "efficiency" in tables:
        efficiency_table(comm, args)
    if "transformer" in tables:
        transformer_table(comm, args)
    save_outputs(args, "pipeline", comm.size, comm.rank)
    return 0


def _main_cuda(args: argparse.Namespace) -> int:
    """``--device cuda`` (:mod:`mpitrain.bench._pipeline_cuda`): status 2, saying why, without CUDA."""
    from . import _pipeline_cuda

    refused = without_cuda("pipeline")  # the same verdict on every rank, before any message
    if refused is not None:
        return refused
    args.steps = max(args.steps, DEVICE_STEPS)
    comm = init()
    _pipeline_cuda.run(args)
    save_outputs(args, "pipeline-cuda", comm.size, comm.rank)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
