"""Which hosts a job runs on and how many slots each has: ``-H`` lists, hostfiles, Slurm allocations.

Everything here is parsed and validated in Python before mpiexec starts: a host name is letters, digits,
``.``, ``-``, ``_`` (or an IPv4/IPv6 address), a slot count a positive integer, so nothing from a
hostfile or an allocation can reach a shell (mpiexec's ssh agent runs a remote shell with the name).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Host", "parse_hosts", "read_hostfile", "expand_hostlist", "expand_tasks_per_node", "slurm_hosts",
           "format_hosts"]

_NAME = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9._-]{0,252})|\[?[0-9A-Fa-f:.]+\]?)$")
_HOSTFILE_KEYS = ("slots", "max_slots", "max-slots")


@dataclass(frozen=True)
class Host:
    """One host and the ranks it may take (None: let MPI count its cores)."""

    name: str
    slots: int | None = None


def _check_name(name: str, where: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"{where}: {name!r} is not a host name (letters, digits, '.', '-', '_' or an address)")
    return name


def _check_slots(text: str, where: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{where}: slots must be a positive integer, got {text!r}")
    return int(text)


def parse_hosts(spec: str) -> list[Host]:
    """``"a:2,b,c:4"`` -> hosts with slots (None where not given); raises ValueError naming the bad entry."""
    out = []
    for item in (i.strip() for i in spec.split(",")):
        where = f"-H entry {item!r}"
        # one ':' separates the slots; more than one is an IPv6 address without slots
        name, _, slots = item.partition(":") if item.count(":") == 1 else (item, "", "")
        out.append(Host(_check_name(name, where), _check_slots(slots, where) if slots else None))
    if not out:
        raise ValueError("-H needs at least one host")
    return out


def read_hostfile(path: str | os.PathLike[str]) -> list[Host]:
    """Parse an Open MPI style hostfile: ``name [slots=N] [max_slots=N]`` per line, ``#`` comments.

    Only names and slot counts are accepted; any other token is an error naming file and line."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read hostfile {str(p)!r}: {e.strerror}") from None
    out = []
    for no, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{p}:{no}"
        name, *opts = line.split()
        slots = None
        for opt in opts:
            key, eq, val = opt.partition("=")
            if not eq or key not in _HOSTFILE_KEYS:
                raise ValueError(f"{where}: unexpected {opt!r} (a hostfile line is 'name [slots=N] [max_slots=N]')")
            n = _check_slots(val, where)
            if key == "slots":
                slots = n
        out.append(Host(_check_name(name, where), slots))
    if not out:
        raise ValueError(f"hostfile {str(p)!r} names no host")
    return out


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced brackets in host list {text!r}")
    return [*parts, cur]


def _expand_range(body: str, text: str) -> list[str]:
    out = []
    for part in body.split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ValueError(f"bad range {part!r} in host list {text!r}")
        width = len(lo)
        out += [str(i).zfill(width) for i in range(int(lo), int(hi if dash else lo) + 1)]
    return out


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list -> names: ``"node[01-03,07],gpu5"`` -> node01 node02 node03 node07 gpu5.

    Several bracket groups in one name expand as a product (``"r[1-2]n[1-2]"`` -> r1n1 r1n2 r2n1 r2n2);
    zero padding follows the range's lower bound, as Slurm does."""
    names: list[str] = []
    for item in _split_top(text.strip()):
        if not item:
            continue
        partial = [""]
        rest = item
        while rest:
            m = re.match(r"([^\[]*)\[([^\]]*)\](.*)$", rest)
            if m is None:
                partial = [p + rest for p in partial]
                break
            prefix, body, rest = m.groups()
            partial = [p + prefix + r for p in partial for r in _expand_range(body, text)]
        names += [_check_name(n, "Slurm host list") for n in partial]
    if not names:
        raise ValueError(f"empty host list {text!r}")
    return names


def expand_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``) -> [2, 2, 2, 1]."""
    out: list[int] = []
    for item in text.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m is None:
            raise ValueError(f"bad SLURM_TASKS_PER_NODE entry {item!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def slurm_hosts(environ: Mapping[str, str] | None = None) -> tuple[list[Host], int] | None:
    """Inside a Slurm allocation: (hosts with their task slots, SLURM_NTASKS); None outside one."""
    env = os.environ if environ is None else environ
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    names = expand_hostlist(nodelist)
    per_node = env.get("SLURM_TASKS_PER_NODE") or env.get("SLURM_JOB_TASKS_PER_NODE")
    counts = expand_tasks_per_node(per_node) if per_node else []
    ntasks = env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
    total = int(ntasks) if ntasks and ntasks.isdigit() else (sum(counts) if counts else len(names))
    if len(counts) != len(names):  # no per-node counts: spread the tasks as evenly as Slurm's block layout
        base, extra = divmod(total, len(names))
        counts = [base + (i < extra) for i in range(len(names))]
    return [Host(n, max(c, 1)) for n, c in zip(names, counts, strict=True)], total


def format_hosts(hosts: list[Host]) -> str:
    """Hosts as mpiexec's ``-H`` argument ("a:2,b:1")."""
    return ",".join(h.name if h.slots is None else f"{h.name}:{h.slots}" for h in hosts)
