"""Rank-side probe for the emulated-host tests: what each rank sees, printed as one JSON line per rank.

Starts the backend named by MPITRAIN_BACKEND, allreduces float64 rank numbers over the world (exact),
and reports host name, CPU affinity, the environment it got and which ranks MPI says share its host.
"""

from __future__ import annotations

import json
import os
import socket

import torch
from mpi4py import MPI

import mpitrain
from mpitrain.comm._rendezvous import host_leaders

if "PROBE_HOSTNAME" in os.environ:  # every rank's Python sees this host name (hosts sharing a name)
    socket.gethostname = lambda: os.environ["PROBE_HOSTNAME"]
comm = mpitrain.init()
t = torch.full((3,), float(comm.rank + 1), dtype=torch.float64)
comm.allreduce(t)
report = {
    "rank": comm.rank,
    "backend": comm.backend,
    "hostname": socket.gethostname(),
    "affinity": sorted(os.sched_getaffinity(0)),
    "env": {k: v for k, v in os.environ.items() if k.startswith(("MPITRAIN_", "PROBE_"))},
    "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    "sum": t.tolist(),
    "leaders": host_leaders(MPI.COMM_WORLD),
}
print("PROBE " + json.dumps(report), flush=True)
