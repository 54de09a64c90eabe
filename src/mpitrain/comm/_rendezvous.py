"""Where ranks meet across hosts: host identity from MPI, addresses from the network interfaces.

Host names are not trusted: a name may resolve to 127.0.1.1 (the Debian/Ubuntu default), not resolve
at all, or be shared by several hosts. Which ranks share a host comes from MPI's shared-memory split
(``COMM_TYPE_SHARED``, decided by the MPI runtime's own node identity); which address rank 0 is reached
at comes from its interfaces, preferring the ones MPI's TCP traffic is restricted to.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Interface", "interfaces", "host_leaders", "choose_address", "route_interface"]

_SIOCGIFADDR = 0x8915
_SIOCGIFNETMASK = 0x891B
# Where Open MPI users restrict TCP traffic (``--mca btl_tcp_if_include``, ``oob_tcp_if_include``): the
# ranks see these as environment variables set by the launcher.
_IF_INCLUDE_VARS = ("OMPI_MCA_btl_tcp_if_include", "OMPI_MCA_oob_tcp_if_include", "PRTE_MCA_oob_tcp_if_include")


@dataclass(frozen=True)
class Interface:
    """One IPv4 address of this host: interface name, address, network."""

    name: str
    address: str
    network: str

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.address).is_loopback


def _ioctl_addr(sock: socket.socket, request: int, name: str) -> str | None:
    try:
        raw = fcntl.ioctl(sock.fileno(), request, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None  # no IPv4 address on this interface
    return socket.inet_ntoa(raw[20:24])


def interfaces() -> list[Interface]:
    """This host's IPv4 interfaces that are configured (Linux ioctl; empty where unsupported)."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            addr = _ioctl_addr(s, _SIOCGIFADDR, name)
            mask = _ioctl_addr(s, _SIOCGIFNETMASK, name)
            if addr and mask:
                net = ipaddress.ip_network(f"{addr}/{mask}", strict=False)
                out.append(Interface(name, addr, str(net)))
    return out


def host_leaders(mpi_comm: Any) -> list[int]:
    """For every rank of `mpi_comm`, the lowest rank on its host (MPI's shared-memory split).

    Collective over `mpi_comm`: every rank must call it."""
    from mpi4py import MPI

    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        leader = node.allreduce(mpi_comm.Get_rank(), op=MPI.MIN)
    finally:
        node.Free()
    return list(mpi_comm.allgather(leader))


def _included(iface: Interface, patterns: list[str]) -> bool:
    for pat in patterns:
        try:
            if ipaddress.ip_address(iface.address) in ipaddress.ip_network(pat, strict=False):
                return True
        except ValueError:
            if iface.name == pat:
                return True
    return False


def choose_address(candidates: list[Interface], others: list[list[Interface]],
                   environ: Mapping[str, str] | None = None) -> str:
    """The address of rank 0 (`candidates`) that the other hosts (`others`, their interfaces) reach it at.

    Preference: an address inside MPI's ``*_tcp_if_include`` restriction, then one on a network every
    other host is also on, then any non-loopback address. Raises LookupError when rank 0 has none."""
    env = os.environ if environ is None else environ
    patterns = [p.strip() for v in _IF_INCLUDE_VARS for p in env.get(v, "").split(",") if p.strip()]
    remote = [c for c in candidates if not c.loopback]
    if patterns:
        restricted = [c for c in remote if _included(c, patterns)]
        remote = restricted or remote
    def on_net(c: Interface, host: list[Interface]) -> bool:
        return any(not m.loopback and ipaddress.ip_address(c.address) in ipaddress.ip_network(m.network)
                   for m in host)

    shared = [c for c in remote if all(on_net(c, host) for host in others)]
    for pick in (shared, remote):
        if pick:
            return pick[0].address
    raise LookupError("rank 0 has no non-loopback IPv4 address for other hosts to reach it at")


def route_interface(address: str, mine: list[Interface]) -> str | None:
    """The name of this host's interface that traffic to `address` leaves by (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, 9))
            local = s.getsockname()[0]
        except OSError:
            return None
    return next((m.name for m in mine if m.address == local), None)
