"""The last rank (on the last emulated host) raises; the others wait in an allreduce."""

import torch

import mpitrain

comm = mpitrain.init()
if comm.rank == comm.size - 1:
    raise RuntimeError(f"failure on the remote rank {comm.rank}")
comm.allreduce(torch.ones(4))
