"""`mpitrain bench allreduce` with every call timed on every rank, and every garbage collection of 3 ms or
more (and every full one) logged with its rank and wall time (docs/multihost.md, "The collector's first
full pass"). Run:
python -m tests.multihost.emulated --hosts 4 --slots 2 --rate 1gbit -- run python
tests/multihost/jobs/per_call.py --min-bytes 4194304 --max-bytes 16777216 --rounds 4 --link-gbit 1 --per-round
Prints the benchmark's table, then ``CALL i contender [ms on rank 0, 1, ...]`` per call in the order they
ran (warm-up included), then the ``GC`` lines.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable

import mpitrain
from mpitrain.bench import allreduce as bench

collections: list[str] = []
_started = [0.0]


def _log_collection(phase: str, info: dict) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    took = time.perf_counter() - _started[0]
    if took > 3e-3 or info["generation"] == 2:
        collections.append(f"gen{info['generation']} {took * 1e3:.1f} ms at {time.time():.3f}")


gc.callbacks.append(_log_collection)
comm = mpitrain.init()
calls: list[tuple[str, float]] = []
#: The contenders' lambdas by their line in bench._contenders (gloo's is made only with a torch world).
names = {v.__code__.co_firstlineno: k for k, v in bench._contenders(1024, None).items()}


def timed_calls(fn: Callable[[], object], iters: int, barrier: Callable[[], object]) -> float:
    """bench._per_call, each call timed alone and named by the contender's line in bench._contenders."""
    name = names.get(fn.__code__.co_firstlineno, "gloo")
    barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        calls.append((name, (time.perf_counter() - t) * 1e3))
    return (time.perf_counter() - t0) / iters


bench._per_call = timed_calls
bench.main(sys.argv[1:])
every = comm.allgather_object(calls)
logs = comm.allgather_object(collections)
if comm.rank == 0:
    for i in range(len(calls)):
        print(f"CALL {i} {calls[i][0]} {[round(c[i][1], 1) for c in every]}")
    for r, lines in enumerate(logs):
        for line in lines:
            print(f"GC rank {r}: {line}")
