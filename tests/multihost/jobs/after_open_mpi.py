"""Why our allreduce is slower right after Open MPI's (docs/multihost.md): per size, the slowest rank's time
of each single call in the sequences

- ours x3 (baseline), then Open MPI's allreduce once, then ours x3 right after it,
- Open MPI's once, a 1 s sleep, then ours x3,

and, on rank 0 (the leader of host 0), the TCP state (`ss -tin`: congestion control, its bandwidth
estimate, pacing rate, cwnd) of its connections to host 1 (where its ring sends) after each phase,
and the egress shaper's counters (`tc -s qdisc`: backlog, drops); and summed over the hosts, the TCP
loss and recovery events of each phase (retransmitted segments, timeouts, tail-loss probes...). Run:
python -m tests.multihost.emulated --hosts 4 --slots 2 --rate 1gbit -- run python
tests/multihost/jobs/after_open_mpi.py [MiB ...] [--cc cubic]
(--cc: every host's route to the subnet gets this congestion control first; rank 0 of each host sets
it, before Open MPI's TCP connections open.)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

world = MPI.COMM_WORLD
if "--cc" in sys.argv:  # before mpitrain.init(): Open MPI's TCP connections open lazily, after this
    cc = sys.argv[sys.argv.index("--cc") + 1]
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    ok = True
    if node.Get_rank() == 0:  # per route: this namespace may not change the default (not an allowed one)
        route = subprocess.run(["ip", "route", "show", "10.213.7.0/24"], capture_output=True,
                               text=True).stdout.split()
        ok = subprocess.run(["ip", "route", "replace", *route, "congctl", cc]).returncode == 0
    if not all(world.allgather(ok)):
        world.Abort(1)
    world.Barrier()

import mpitrain  # noqa: E402

LINK_BPS = 1e9 / 8
comm = mpitrain.init()
rank = world.Get_rank()
RIGHT_HOST = "10.213.7.2"


def tcp_state(label: str) -> None:
    """Rank 0's connections to host 1: one line each, the fields that say how fast TCP lets it send."""
    if rank != 0:
        return
    out = subprocess.run(["ss", "-tinp", "dst", RIGHT_HOST], capture_output=True, text=True).stdout
    lines, keep = out.splitlines()[1:], []
    for head, info in zip(lines[0::2], lines[1::2], strict=False):
        if f"pid={os.getpid()}," not in head:
            continue
        fields = [m.group(0) for m in re.finditer(r"(bbr:\([^)]*\)|cubic|pacing_rate \S+|cwnd:\d+|ssthresh:\d+|"
                                                  r"rtt:\S+|bytes_acked:\d+|delivery_rate \S+|retrans:\S+)", info)]
        keep.append(f"{head.split()[3]}->{head.split()[4]} " + " ".join(fields))
    tc = subprocess.run(["tc", "-s", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout
    shaper = " ".join(re.findall(r"(Sent \d+ bytes|dropped \d+|overlimits \d+|backlog \S+ \S+)", tc))
    print(f"TCP {label}: shaper {shaper}\n  " + "\n  ".join(keep), flush=True)


_COUNTERS = ("RetransSegs", "TCPTimeouts", "TCPLossProbes", "TCPSpuriousRTOs", "TCPFastRetrans",
             "TCPSlowStartRetrans", "TCPLostRetransmit", "TCPSACKReorder", "TCPRcvQDrop", "TCPBacklogDrop")
node_rank = world.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()


def _counters() -> dict[str, int]:
    """This host's TCP counters (/proc/net/snmp and netstat: the reader's network namespace)."""
    out: dict[str, int] = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        lines = open(path).read().splitlines()
        for names, values in zip(lines[0::2], lines[1::2], strict=False):
            out.update(zip(names.split()[1:], map(int, values.split()[1:]), strict=False))
    return {k: out.get(k, 0) for k in _COUNTERS}


_last = [_counters()]


def tcp_events(label: str) -> None:
    """Summed over all hosts: how many of each TCP loss/recovery event happened since the last call."""
    now = _counters() if node_rank == 0 else {k: 0 for k in _COUNTERS}
    delta = {k: now[k] - _last[0][k] for k in _COUNTERS} if node_rank == 0 else now
    _last[0] = now
    total = {k: sum(d[k] for d in world.allgather(delta)) for k in _COUNTERS}
    if rank == 0:
        print(f"EVENTS {label}: " + " ".join(f"{k}={v}" for k, v in total.items() if v), flush=True)


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    world.Barrier()
    t0 = time.perf_counter()
    fn()
    return max(world.allgather(time.perf_counter() - t0))


for mib in [int(a) for a in sys.argv[1:] if a.isdigit()] or [16]:
    t = torch.ones(mib * (1 << 20) // 4)
    raw = np.ones(t.numel(), dtype=np.float32)
    floor = 2 * mib * (1 << 20) * 3 / 4 / LINK_BPS

    def ours(t: torch.Tensor = t) -> None:
        comm.allreduce(t)

    def ompi(raw: np.ndarray = raw) -> None:
        world.Allreduce(MPI.IN_PLACE, raw, op=MPI.SUM)

    timed(ours), timed(ompi)  # warm-up: connections, slots
    rows: dict[str, list[float]] = {}
    for rep in range(3):
        tcp_events("before")
        rows.setdefault("ours", []).extend(timed(ours) for _ in range(3))
        tcp_events(f"{mib} MiB round {rep} ours x3")
        tcp_state(f"{mib} MiB round {rep} after ours x3")
        rows.setdefault("ompi", []).append(timed(ompi))
        tcp_events(f"{mib} MiB round {rep} ompi")
        tcp_state(f"{mib} MiB round {rep} after ompi")
        rows.setdefault("after-ompi", []).extend(timed(ours) for _ in range(3))
        tcp_events(f"{mib} MiB round {rep} ours x3 after ompi")
        tcp_state(f"{mib} MiB round {rep} after ours x3 after ompi")
        timed(ompi)
        time.sleep(1.0)
        tcp_events("ompi")
        rows.setdefault("after-ompi+1s", []).extend(timed(ours) for _ in range(3))
        tcp_events(f"{mib} MiB round {rep} ours x3 after ompi and 1 s")
    if rank == 0:
        for k, v in rows.items():
            print(f"CALLS {mib} MiB floor {floor * 1e3:.1f} ms {k}: " + " ".join(
                f"{x * 1e3:.0f}({floor / x:.2f})" for x in v), flush=True)
