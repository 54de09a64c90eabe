"""Pipe-SGD benchmark: the timing model's prediction next to measurement, in a Fig. 4-style table.

Run as ``mpitrain bench pipesgd -n 4 [--models mlp,cnn] [--link-alpha 5e-5 --link-beta 2e-8]
[--target 0.9] [--epochs 12]``. Data: scikit-learn's digits upsampled to 28x28 (MNIST's input size;
synthetic clusters of that size when scikit-learn is missing), global batch 96 (the paper's 100,
rounded to divide 2, 3 and 4 ranks). Models: the paper's MNIST-MLP (784-500-500-10) and a small CNN.

For each model and link, every configuration trains from the same initial weights until the test
accuracy reaches `--target` (or `--epochs` run out): PS-Sync (the ``dist_sync`` parameter-server
kvstore, the last rank serving), D-Sync (``staleness=1``) and Pipe-SGD (``staleness=2``), the last
two without compression, with 16-bit truncation (T) and with int8 quantization (Q). Columns: the
measured and predicted seconds per iteration and their relative error, a breakdown per iteration
(compute; exposed communication = time the compute thread waited; codec time spent by the comm
thread), the wall-clock training seconds to the target accuracy and the final accuracy.

``link=emulated`` is an EMULATION of a slower network (the paper's regime, where communication
dominates): after each real allreduce the communication thread sleeps ``2(p-1)a + 2(p-1)/p * wire
bytes * b`` (:class:`~mpitrain.strategies.pipesgd.LinkEmulation`); PS-Sync workers sleep
``2a + workers * bytes * b`` after each pull (one full-duplex server link carries every worker's push
and pull). Predictions use the calibrated alpha/beta/gamma plus the emulated a/b, and the compute
times l_up/l_for/l_back measured separately (best of 15) on rank 0's slice before training.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mpitrain
from mpitrain._utils.flat import copy_from_flat, flatten
from mpitrain.bench.common import add_outputs, header, print_table, save_outputs
from mpitrain.comm.base import Communicator
from mpitrain.fit import FitSpec
from mpitrain.perf.calibrate import Calibration, calibrate
from mpitrain.perf.timing import TimingInputs, predict
from mpitrain.strategies.pipesgd import make_trainer

__all__ = ["main", "MODELS", "CONFIGS"]

BATCH = 96


def mlp() -> nn.Module:
    """The paper's MNIST-MLP: 784-500-500-10 (0.65 M parameters, 2.6 MB of gradients)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 500), nn.ReLU(), nn.Linear(500, 500), nn.ReLU(),
                         nn.Linear(500, 10))


def cnn() -> nn.Module:
    """A small LeNet-style CNN: 0.32 M parameters, most time in the convolutions."""
    return nn.Sequential(nn.Conv2d(1, 32, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 5), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 16, 256), nn.ReLU(), nn.Linear(256, 10))


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "cnn": cnn}
#: name -> (framework, staleness, compression)
CONFIGS: dict[str, tuple[str, int, str | None]] = {
    "PS-Sync": ("ps", 1, None), "D-Sync": ("ring", 1, None), "D-Sync+T": ("ring", 1, "bf16"),
    "D-Sync+Q": ("ring", 1, "int8"), "Pipe-SGD": ("ring", 2, None), "Pipe-SGD+T": ("ring", 2, "bf16"),
    "Pipe-SGD+Q": ("ring", 2, "int8"),
}


def load_digits28() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x_train, y_train, x_test, y_test): digits 8x8 upsampled to 1x28x28, normalised; same on every rank."""
    try:
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        y = torch.tensor(d.target, dtype=torch.long)
    except ImportError:  # synthetic digits: 10 noisy prototypes
        g = torch.Generator().manual_seed(0)
        y = torch.randint(0, 10, (1800,), generator=g)
        x = (torch.rand(10, 1, 8, 8, generator=g)[y] + 0.3 * torch.randn(1800, 1, 8, 8, generator=g)).clamp(0, 1)
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    x = (x - x.mean()) / x.std()
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(1))
    x, y = x[perm], y[perm]
    cut = len(y) * 4 // 5
    return x[:cut], y[:cut], x[cut:], y[cut:]


def _batches(x: torch.Tensor, y: torch.Tensor, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(100 + epoch))
    return [(x[perm[i:i + BATCH]], y[perm[i:i + BATCH]]) for i in range(0, len(y) - BATCH + 1, BATCH)]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


@dataclass
class Run:
    """What one training run measured (seconds; per iteration where named so)."""

    iter_s: float
    compute_s: float
    wait_s: float
    codec_s: float
    to_target_s: float
    final_acc: float


def measure_compute(model_fn: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor,
                    repeats: int = 15) -> tuple[float, float, float]:
    """Best-of-`repeats` (l_up, l_for, l_back) of one slice on this rank (as calibrate: noise only adds)."""
    model = model_fn()
    opt = _sgd(model.parameters())
    ups, fors, backs = [], [], []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        t1 = time.perf_counter()
        opt.zero_grad()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        fors.append(t1 - t0)
        backs.append(t2 - t1)
        ups.append(t3 - t2)
    return tuple(min(v[2:]) for v in (ups, fors, backs))  # type: ignore[return-value]


def _accuracy(forward: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        hits = sum(int((forward(x[i:i + 120]).argmax(1) == y[i:i + 120]).sum()) for i in range(0, len(y), 120))
    return hits / len(y)


def _train(step: Callable[[torch.Tensor, torch.Tensor], Any], acc: Callable[[], float], sync: Callable[[], Any],
           data: tuple, target: float, epochs: int) -> tuple[int, float, float, float]:
    """Epochs of `step` until `acc()` reaches `target`: (steps, training seconds, seconds to target, acc)."""
    steps, train_s, to_target, a = 0, 0.0, float("nan"), 0.0
    for epoch in range(epochs):
        sync()
        t0 = time.perf_counter()
        for xb, yb in _batches(data[0], data[1], epoch):
            step(xb, yb)
            steps += 1
        train_s += time.perf_counter() - t0
        a = acc()
        if a >= target:
            to_target = train_s
            break
    return steps, train_s, to_target, a


def run_ring(comm: Communicator, model_fn: Callable[[], nn.Module], data: tuple, staleness: int,
             compression: str | None, link: tuple[float, float] | None, target: float, epochs: int) -> Run:
    """D-Sync (staleness 1) or Pipe-SGD through fit's pipe-sgd Trainer."""
    torch.manual_seed(0)
    options = {"staleness": staleness, "compression": compression, "emulate_link": link}
    tr = make_trainer(model_fn(), F.cross_entropy, _sgd, comm, FitSpec(strategy="pipe-sgd", options=options))

    def acc() -> float:
        return _accuracy(lambda xb: tr.eval_step(xb, torch.zeros(len(xb))), data[2], data[3])

    steps, train_s, to_target, a = _train(tr.train_step, acc, comm.barrier, data, target, epochs)
    tr.trained_model()
    st, ct = tr.stats, tr.comm_thread.stats
    return Run(train_s / steps, st["compute_s"] / steps, st["wait_s"] / steps, ct["codec_s"] / steps, to_target, a)


def run_ps(comm: Communicator, model_fn: Callable[[], nn.Module], data: tuple, link: tuple[float, float] | None,
           target: float, epochs: int) -> Run | None:
    """PS-Sync: workers push gradients to the dist_sync server (the last rank) and pull the sum."""
    from mpitrain import kvstore
    from mpitrain.kvstore import ServerStore

    kv = kvstore.create("dist_sync", comm, num_servers=1)
    assert isinstance(kv, ServerStore)
    workers = comm.split(1 if kv.is_server else 0)
    assert workers is not None
    if kv.is_server:
        kv.serve()
        return None
    torch.manual_seed(0)
    model = model_fn()
    opt, params = _sgd(model.parameters()), list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    kv.init("g", flat)
    nw, t = workers.size, {"compute": 0.0, "comm": 0.0}
    delay = 0.0 if link is None else 2 * link[0] + nw * flat.numel() * 4 * link[1]

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        t0 = time.perf_counter()
        k = len(yb) // nw
        opt.zero_grad()
        F.cross_entropy(model(xb[workers.rank * k:(workers.rank + 1) * k]),
                        yb[workers.rank * k:(workers.rank + 1) * k]).backward()
        grads = [p.grad for p in params if p.grad is not None]
        assert len(grads) == len(params), "every parameter of the benchmark model gets a gradient"
        flatten(grads, out=flat)
        t1 = time.perf_counter()
        kv.push("g", flat)
        kv.pull("g", flat)
        time.sleep(delay)
        t2 = time.perf_counter()
        copy_from_flat(flat.div_(nw), grads)
        opt.step()
        t["compute"] += (t1 - t0) + (time.perf_counter() - t2)
        t["comm"] += t2 - t1

    steps, train_s, to_target, a = _train(step, lambda: _accuracy(model, data[2], data[3]), workers.barrier,
                                          data, target, epochs)
    kv.close()
    return Run(train_s / steps, t["compute"] / steps, t["comm"] / steps, 0.0, to_target, a)


def _predict(cal: Calibration, comp: tuple[float, float, float], n_bytes: int, p: int, framework: str,
             staleness: int, compression: str | None, link: tuple[float, float] | None) -> float:
    la, lb = link or (0.0, 0.0)
    l_up, l_for, l_back = comp
    if framework == "ps":  # our PS model: one full-duplex server link carries every worker's bytes
        nw = p - 1
        scale = p / nw  # each worker's slice is p/(p-1) times larger
        return (l_up + (l_for + l_back) * scale + 2 * (cal.alpha + la) + nw * n_bytes * (cal.beta + lb)
                + nw * n_bytes * cal.gamma)
    x = TimingInputs(l_up=l_up, l_for=l_for, l_back=l_back, alpha=cal.alpha + la, beta=cal.beta + lb,
                     gamma=cal.gamma, n_bytes=n_bytes, p=p, S=cal.S, K=staleness,
                     wire_ratio=cal.wire_ratio[str(compression)], codec_per_byte=cal.codec_per_byte[str(compression)])
    return predict(x)["pipe" if staleness >= 2 else "sync"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="mpitrain bench pipesgd", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mlp,cnn", help=f"comma list of {list(MODELS)}")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {list(CONFIGS)}")
    ap.add_argument("--links", default="real,emulated", help="comma list of real, emulated")
    ap.add_argument("--link-alpha", type=float, default=5e-5, help="emulated latency, s per message")
    ap.add_argument("--link-beta", type=float, default=2e-8, help="emulated s per byte (2e-8 = 400 Mbit/s)")
    ap.add_argument("--target", type=float, default=0.9, help="test accuracy to reach")
    ap.add_argument("--epochs", type=int, default=12, help="at most this many epochs per run")
    add_outputs(ap)
    return ap.parse_args(argv)


def _ranks_per_host() -> list[int]:
    """Ranks per host of the launched world by MPI's shared-memory split (hosts in order of their lowest
    rank), whatever the backend. Collective over the world."""
    from mpi4py import MPI

    from mpitrain.comm import host_leaders

    leaders = host_leaders(MPI.COMM_WORLD)
    return [leaders.count(r) for r in sorted(set(leaders))]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    comm = mpitrain.init()
    p = comm.size
    data = load_digits28()
    cal = calibrate(comm)
    hosts = _ranks_per_host()
    rows = []
    if comm.rank == 0:
        print(header("Pipe-SGD: timing model vs measurement, Fig. 4-style comparison", p))
        print(f"# calibrated: alpha={cal.alpha:.3g}s beta={cal.beta:.3g}s/B gamma={cal.gamma:.3g}s/B S={cal.S:.3g}s "
              f"codec s/B={ {k: float(f'{v:.3g}') for k, v in cal.codec_per_byte.items()} }")
        print(f"# emulated link: alpha={args.link_alpha:g}s/message beta={args.link_beta:g}s/byte (EMULATION); "
              f"global batch {BATCH}; SGD lr 0.1; target test accuracy {args.target}")
        print(f"# hosts: {len(hosts)} with {hosts} ranks (link=real is the network between them; the calibrated "
              f"alpha/beta above measured it)", flush=True)
    for name in args.models.split(","):
        model_fn = MODELS[name]
        n_bytes = 4 * sum(q.numel() for q in model_fn().parameters())
        k = BATCH // p
        comp = measure_compute(model_fn, data[0][:k], data[1][:k])
        if comm.rank == 0:
            print(f"# {name}: {n_bytes / 1e6:.2f} MB of gradients; l_up={comp[0] * 1e3:.2f}ms "
                  f"l_for={comp[1] * 1e3:.2f}ms l_back={comp[2] * 1e3:.2f}ms (slice of {k})", flush=True)
        for link_name in args.links.split(","):
            link = (args.link_alpha, args.link_beta) if link_name == "emulated" else None
            for cfg in args.configs.split(","):
                framework, staleness, compression = CONFIGS[cfg]
                if framework == "ps":
                    run = run_ps(comm, model_fn, data, link, args.target, args.epochs) if p > 1 else None
                else:
                    run = run_ring(comm, model_fn, data, staleness, compression, link, args.target, args.epochs)
                if comm.rank == 0 and run is not None:
                    pred = _predict(cal, comp, n_bytes, p, framework, staleness, compression, link)
                    rows.append([name, link_name, cfg, run.iter_s * 1e3, pred * 1e3, (pred - run.iter_s) / run.iter_s,
                                 run.compute_s * 1e3, run.wait_s * 1e3, run.codec_s * 1e3, run.to_target_s,
                                 run.final_acc])
                    print(f"#   done {name} {link_name} {cfg}", flush=True)
    if comm.rank == 0:
        print_table(["model", "link", "config", "iter ms", "pred ms", "rel err", "compute ms", "exposed comm ms",
                     "codec ms", f"s to acc {args.target}", "final acc"], rows)
    save_outputs(args, "pipesgd", p, comm.rank)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
