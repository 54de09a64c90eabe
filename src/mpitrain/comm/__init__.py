"""The Communicator interface and its backends (MPI by default)."""

from .base import DTYPES, OPS, CommError, Communicator, Request, reduce_ops, split_sizes

__all__ = ["Communicator", "Request", "CommError", "OPS", "DTYPES", "reduce_ops", "split_sizes"]
