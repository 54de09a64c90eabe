import sys, time
import numpy as np, torch
from mpi4py import MPI
import mpitrain
from mpitrain.comm._hierarchical import Hierarchy
from mpitrain.comm._host_stage import HostStage
from mpitrain.comm.ring import ring_allreduce
comm = mpitrain.init()
h = Hierarchy(comm.mpi_comm)
rc = h._ring_comm() if h.leaders is not None else None
stage = HostStage(h.node)
world = MPI.COMM_WORLD
def old(t, buf):
    h.node.Reduce(MPI.IN_PLACE if h.is_leader else buf, buf if h.is_leader else None, op=MPI.SUM, root=0)
    if rc is not None: ring_allreduce(rc, t)
    h.node.Bcast(buf, root=0)
def new(t, buf):
    stage.allreduce(t, lambda f, o: ring_allreduce(rc, f, addends=o))
def ringonly(t, buf):
    if rc is not None: ring_allreduce(rc, t)
    req = world.Ibarrier()
    while not req.Test(): time.sleep(0.001)
import os
if os.environ.get("NOSS"):
    open("/proc/sys/net/ipv4/tcp_slow_start_after_idle", "w").write("0")
def idle(t, buf):
    time.sleep(0.5)
def viacomm(t, buf):
    comm.allreduce(t)
fns = dict(old=old, new=new, comm=viacomm, new2=new, comm2=viacomm, ringonly=ringonly)
for mib in [int(a) for a in sys.argv[1:]] or [16]:
    n = mib * (1 << 20) // 4
    t = torch.ones(n); buf = [t.numpy(), MPI.FLOAT]
    res = {k: [] for k in fns}
    for rep in range(4):
        for k, f in fns.items():
            world.Barrier()
            t0 = time.perf_counter(); f(t, buf); dt = time.perf_counter() - t0
            dt = max(world.allgather(dt))
            if rep: res[k].append(dt)
    if world.Get_rank() == 0:
        floor = 2*mib*(1<<20)*3/4/1.25e8
        print(f"AB {mib} MiB " + "  ".join(f"{k} {np.median(v)*1e3:.1f} ms ({floor/np.median(v):.3f})" for k, v in res.items()), flush=True)
