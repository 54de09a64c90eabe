"""Rank-side check on emulated hosts: training through the user paths equals one process when the ranks
span hosts and the gradients are large enough to go hierarchical. DataParallel over every collective
kvstore type, and ``fit(strategy="data")`` with its defaults, train a float64 MLP whose gradient buckets
take each allreduce path (flat, hierarchical with MPI host stages and Open MPI's allreduce among the
leaders, the same with the leaders' ring, the ring with shared-memory host stages) for STEPS SGD steps;
every rank compares the parameters with the same steps in one process (tight float64 tolerance: the
hierarchical sum order differs from one process's). Which paths ran is counted by wrapping the
hierarchy's stages. Prints one JSON verdict per rank (``TRAIN {...}``)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mpitrain
from mpitrain.comm import _hierarchical as hierarchical
from mpitrain.comm._hierarchical import HIERARCHY_ABOVE, RING_ABOVE, SHARED_STAGES_ABOVE, Hierarchy
from mpitrain.comm._host_stage import HostStage
from mpitrain.fit import fit
from mpitrain.strategies.data_parallel import COLLECTIVE_TYPES, DataParallel
from tests.strategies._device_checks import steps_in_one_process

PER_RANK = 4
STEPS = 3
TOL = 1e-12
#: Buckets (reverse layer order, see DataParallel): [fc4, fc3.bias] 14 KB flat; [fc3.weight, fc2.bias]
#: 330 KB hierarchical, Open MPI's allreduce among the leaders; [fc2.weight] 1.3 MB the leaders' ring with
#: MPI host stages; [fc1.bias] 5 KB flat; [fc1.weight] 5.2 MB the ring with shared-memory host stages.
BUCKET_MB, FIRST_BUCKET_MB = 1.0, 0.02
WANT_PATHS = ["flat", "hierarchical", "ring", "flat", "shared"]


def model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(1024, 640), nn.Tanh(), nn.Linear(640, 256), nn.Tanh(), nn.Linear(256, 160),
                         nn.Tanh(), nn.Linear(160, 10)).double()


def batches(size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    n = size * PER_RANK
    return [(torch.randn(n, 1024, generator=g, dtype=torch.float64), torch.randint(0, 10, (n,), generator=g))
            for _ in range(STEPS)]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def path_of(nbytes: int) -> str:
    """The allreduce path a floating sum of `nbytes` takes across hosts (comm/_hierarchical.py)."""
    if nbytes < HIERARCHY_ABOVE:
        return "flat"
    return "hierarchical" if nbytes < RING_ABOVE else "ring" if nbytes < SHARED_STAGES_ABOVE else "shared"


# -- counting the hierarchy's stages, on whichever thread the kvstore runs them ------------------------
calls: Counter[str] = Counter()
host_sizes: list[int] = []
counting = threading.Lock()  # the concurrent kvstore runs stages on two threads at once: no lost counts


def count(name: str) -> None:
    with counting:
        calls[name] += 1


def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        count(name)
        return fn(*args, **kwargs)
    return wrapper


original_allreduce = Hierarchy._allreduce


def hierarchical_allreduce(self: Hierarchy, job: Any) -> None:
    count("hierarchical")
    if not host_sizes:
        host_sizes.extend(self.host_sizes)
    original_allreduce(self, job)


Hierarchy._allreduce = hierarchical_allreduce  # type: ignore[method-assign]
HostStage.allreduce = counted("shared", HostStage.allreduce)  # type: ignore[method-assign]
hierarchical.ring_allreduce = counted("ring", hierarchical.ring_allreduce)  # the leaders' ring


def compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[bool, float]:
    ok = len(got) == len(want) and all(torch.allclose(p, q, rtol=TOL, atol=TOL) for p, q in zip(got, want))
    return ok, max((p - q).abs().max().item() for p, q in zip(got, want))


def data_parallel(comm: Any, kvstore: str) -> tuple[list[torch.Tensor], list[str]]:
    """STEPS steps of DataParallel on this rank's rows; the parameters and the buckets' paths."""
    dp = DataParallel(model(), kvstore=kvstore, bucket_mb=BUCKET_MB, comm=comm, first_bucket_mb=FIRST_BUCKET_MB)
    paths = [path_of(b.nbytes) for b in dp.buckets]
    opt = sgd(dp.parameters())
    rows = slice(comm.rank * PER_RANK, (comm.rank + 1) * PER_RANK)
    for x, y in batches(comm.size):
        opt.zero_grad()
        F.cross_entropy(dp(x[rows]), y[rows]).backward()
        opt.step()
    dp.close()
    return [p.detach().clone() for p in dp.module.parameters()], paths


def with_fit(comm: Any) -> list[torch.Tensor]:
    """fit(strategy="data") with its defaults (dist_sync_mpi, 25 MiB buckets after a first of 1 MiB: here
    330 KB hierarchical and 6.6 MB through the shared stages)."""
    m = model()
    fit(m, batches(comm.size), F.cross_entropy, sgd, strategy="data", comm=comm, progress=False)
    return [p.detach().clone() for p in m.parameters()]


def main() -> None:
    comm = mpitrain.init("mpi")
    ref = model()
    want = steps_in_one_process(ref, batches(comm.size), F.cross_entropy, sgd(ref.parameters()), torch.device("cpu"))
    failures: list[str] = []
    runs: dict[str, dict[str, Any]] = {}
    for name in (*COLLECTIVE_TYPES, "fit"):
        calls.clear()
        if name == "fit":
            got, paths = with_fit(comm), None
        else:
            got, paths = data_parallel(comm, name)
            if paths != WANT_PATHS:
                failures.append(f"{name}: buckets take paths {paths}, expected {WANT_PATHS}")
        ok, err = compare(got, want)
        if not ok:
            failures.append(f"{name}: parameters differ from one process's (max abs err {err:.3g})")
        runs[name] = {"max_err": err, **calls}
    print("TRAIN " + json.dumps({"rank": comm.rank, "failures": failures, "host_sizes": host_sizes, "runs": runs}),
          flush=True)


main()
