"""Run under `mpitrain run -n 2`: rank 1 sends its halo 3 s late; rank 0 must warn after 1 s, then finish."""

from __future__ import annotations

import time
import warnings

import torch

import mpitrain
from mpitrain._utils.stall import StallPolicy
from mpitrain.spatial._exchange import start_exchange, wait_all
from mpitrain.spatial.halo import plan_halo, window_of

comm = mpitrain.init()
plan = plan_halo((8, 4), (2, 1), window_of(3, 1, 1, 1), comm.rank)
if comm.rank == 1:
    time.sleep(3.0)
ex = start_exchange(torch.full((1, 1, *plan.owned.shape), float(comm.rank)), plan, comm)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    wait_all(ex.requests, plan, StallPolicy(warn_after=1.0))
print(f"rank {comm.rank} halo {ex.halos[0].flatten().tolist()} warnings {[str(w.message) for w in caught]}",
      flush=True)
