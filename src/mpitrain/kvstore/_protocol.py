"""The dist_sync wire protocol between workers and servers (shared by :mod:`._server`, the worker
side, and :mod:`._shard`, the server loop).

Every message starts with a 5-int64 header ``(op, key index, count, dtype code, 0)`` on tag
:data:`HDR`. PUSH and INIT follow it with the raw shard on tag :data:`DATA` (no pickling on the data
path); a PULL is answered with the raw shard on tag :data:`REPLY`, an INIT with a 1-element int64
acknowledgement on :data:`REPLY`. The control ops (SETOPT, SAVE, LOAD) follow the header with one
pickled object (:meth:`~mpitrain.comm.Communicator.send_object`, tag :data:`OBJ`) and are answered
with one object. Each worker's messages to a server are matched in order by MPI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..comm.base import DTYPES, Communicator, Request

__all__ = ["INIT", "PUSH", "PULL", "SETOPT", "SAVE", "LOAD", "CLOSE", "CONTROL", "HDR", "DATA", "REPLY",
           "OBJ", "Header", "send", "request"]

INIT, PUSH, PULL, SETOPT, SAVE, LOAD, CLOSE = range(7)
CONTROL = (SETOPT, SAVE, LOAD)  # ops whose payload and reply are pickled objects
# tags: tensor messages use non-zero tags, so the object messages (tag 0: the only tag torch's object
# path has) never match one of them
HDR, DATA, REPLY, OBJ = 11, 12, 13, 0
_WORDS = 5


@dataclass(frozen=True)
class Header:
    """What a message is: `op` on key `index`; a tensor payload has `count` elements of `dtype`."""

    op: int
    index: int = 0
    count: int = 0
    dtype: torch.dtype | None = None

    def pack(self) -> torch.Tensor:
        code = -1 if self.dtype is None else DTYPES.index(self.dtype)
        return torch.tensor([self.op, self.index, self.count, code, 0], dtype=torch.int64)

    @staticmethod
    def empty() -> torch.Tensor:
        """A buffer to receive a packed header into."""
        return torch.zeros(_WORDS, dtype=torch.int64)

    @staticmethod
    def unpack(buf: torch.Tensor) -> Header:
        op, index, count, code, _ = (int(x) for x in buf)
        return Header(op, index, count, None if code < 0 else DTYPES[code])


def send(comm: Communicator, dest: int, op: int, index: int = 0, data: torch.Tensor | None = None) -> list[Request]:
    """Start sending a header (and `data`, the raw payload, if any) to `dest`; the caller keeps `data`
    alive and unmodified until the returned requests complete."""
    header = Header(op, index, 0 if data is None else data.numel(), None if data is None else data.dtype)
    reqs = [comm.isend(header.pack(), dest, HDR)]
    if data is not None:
        reqs.append(comm.isend(data, dest, DATA))
    return reqs


def request(comm: Communicator, server: int, op: int, obj: Any) -> Any:
    """Worker side of a control op: header, the pickled `obj`, then block for the server's reply object."""
    if op not in CONTROL:
        raise ValueError(f"op {op} is not a control op")
    Request.wait_all(send(comm, server, op))
    comm.send_object(obj, server, OBJ)
    return comm.recv_object(server, OBJ)
