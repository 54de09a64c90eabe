"""Rank-side job for the planner's network levels: which ranks share a host, and the alpha-beta of
one host's ranks and of the world (printed as one JSON line per rank)."""

from __future__ import annotations

import json
from dataclasses import asdict

import mpitrain
from mpitrain.planner._plan import host_layout, measure_levels

comm = mpitrain.init()
hosts = host_layout(comm)
inter, intra = measure_levels(comm, hosts)
print("LEVELS " + json.dumps({"rank": comm.rank, "hosts": list(hosts), "inter": asdict(inter),
                              "intra": asdict(intra)}), flush=True)
