"""Lever 2 of issue #28 measured before building it: would the weight half (W) of several micro-batches
fused into one GEMM per weight be faster than one GEMM per micro-batch?

For a Linear layer the weight gradient of M micro-batches is ``sum_m g_m^T x_m = G^T X`` over the
concatenated rows. This times, with thread-CPU timers on one thread (as each rank runs), for the weight
shapes of the benchmark's GPT-2 at a given width and vocabulary (attention's fused QKV, its projection,
the MLP's two, the tied LM head) and micro-batches of `rows` tokens:

* ``separate``: M GEMMs ``g_m^T x_m`` accumulated into one gradient (what M weight halves run);
* ``fused``: one GEMM on rows already concatenated (the best case: no copy);
* ``fused+cat``: the concatenation of the saved inputs and captured gradients, then the GEMM (what a
  fused W would run, since each micro-batch's tensors are separate allocations).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/zb_fuse_gemm.py [WIDTH] [VOCAB] [ROWS] [M]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch


def cpu_ms(fn: Callable[[], object], reps: int) -> float:
    """The mean thread-CPU milliseconds of `reps` calls of `fn`, after a warm-up."""
    for _ in range(3):
        fn()
    c = time.thread_time()
    for _ in range(reps):
        fn()
    return (time.thread_time() - c) / reps * 1e3


def time_shape(out_f: int, in_f: int, rows: int, micro: int, reps: int) -> list[float]:
    """Separate, fused and fused+cat weight-gradient GEMMs of one Linear(in_f, out_f), ms."""
    gs = [torch.randn(rows, out_f) for _ in range(micro)]
    xs = [torch.randn(rows, in_f) for _ in range(micro)]
    g_all, x_all = torch.cat(gs), torch.cat(xs)
    grad = torch.zeros(out_f, in_f)

    def separate() -> None:  # what M weight halves do: each GEMM accumulated into the one gradient
        grad.zero_()
        for g, x in zip(gs, xs):
            grad.addmm_(g.t(), x)

    return [cpu_ms(separate, reps), cpu_ms(lambda: g_all.t().mm(x_all), reps),
            cpu_ms(lambda: torch.cat(gs).t().mm(torch.cat(xs)), reps)]


def main() -> None:
    width = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    vocab = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    rows = int(sys.argv[3]) if len(sys.argv) > 3 else 256  # tokens per micro-batch: 4 x 64 in the bench
    micro = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    torch.set_num_threads(1)
    reps = max(5, int(5e9 / (rows * micro * width * width * 4)))
    shapes = {"qkv": (3 * width, width), "proj": (width, width), "fc": (4 * width, width),
              "fc2": (width, 4 * width), "lm head": (vocab, width)}
    total = [0.0, 0.0, 0.0]
    print(f"width {width}, vocabulary {vocab}, {micro} micro-batches of {rows} rows, {reps} repetitions")
    for name, (out_f, in_f) in shapes.items():
        times = time_shape(out_f, in_f, rows, micro, reps)
        total = [a + b for a, b in zip(total, times)]
        print(f"  {name:8s} {out_f:5d} x {in_f:5d}: separate {times[0]:8.3f}  fused {times[1]:8.3f}  "
              f"fused+cat {times[2]:8.3f} ms  (fused+cat / separate {times[2] / times[0]:.3f})")
    print(f"  one block + LM head: separate {total[0]:.3f}, fused {total[1]:.3f}, fused+cat {total[2]:.3f} ms "
          f"(fused+cat / separate {total[2] / total[0]:.3f})")


if __name__ == "__main__":
    main()
