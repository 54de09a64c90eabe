"""Communication layer: the Communicator interface and its MPI and torch.distributed backends."""

from .base import DTYPES, OPS, CommError, Communicator, Request, split_sizes

__all__ = ["Communicator", "Request", "CommError", "OPS", "DTYPES", "split_sizes"]
