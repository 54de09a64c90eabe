"""Rank-side check on emulated hosts: the world's allreduce (hierarchical when ranks span hosts) equals a
flat one bitwise (tests/multihost/exactness.py). Prints one JSON verdict per rank."""

from __future__ import annotations

import json

import mpitrain
from mpitrain.comm.compose import backend_of
from tests.multihost.exactness import compare_with_flat

comm = mpitrain.init("mpi")
failures = compare_with_flat(comm)  # type: ignore[arg-type]
h = backend_of(comm)._hierarchy  # type: ignore[attr-defined]
print("HIER " + json.dumps({"rank": comm.rank, "failures": failures, "hosts": h.hosts if h else 0,
                            "host_sizes": h.host_sizes if h else []}), flush=True)
