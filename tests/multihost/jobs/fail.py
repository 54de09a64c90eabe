"""Every rank first leaves a process running in a session of its own (as PRRTE puts each rank in a
process group of its own, out of reach of a kill of the job's session) and prints its pid; then the
last rank (on the last emulated host) raises while the others wait in an allreduce.

The left process does not hold the rank's output: mpiexec forwards a rank's output until every process
holding it has closed it, so it would keep the job alive as long as it runs (docs/multihost.md)."""

import subprocess

import torch

import mpitrain

comm = mpitrain.init()
orphan = subprocess.Popen(["sleep", "300"], start_new_session=True, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
print(f"ORPHAN {orphan.pid}", flush=True)
comm.barrier()
if comm.rank == comm.size - 1:
    raise RuntimeError(f"failure on the remote rank {comm.rank}")
comm.allreduce(torch.ones(4))
