"""Emulated hosts: K Linux network namespaces on a private bridge, each with its own hostname (UTS
namespace), /etc/hosts, /tmp and /dev/shm (mount namespace), reached by an ssh-like agent.

Layout: a "switch" namespace holds a bridge; host i's namespace holds ``eth0`` (address i+1 of the
subnet), a veth whose peer is a port of the bridge. Nothing is created in the caller's namespace: each
namespace lives as long as one holder process (``unshare ... sh -c '...; read x'``) whose stdin is a pipe
from this process, so the namespaces vanish when `close()` closes the pipes, and also when this process
dies in any way (the pipe closes; no ``ip netns`` names persist). A namespace outlives its holder while
any process is still inside it, so every process in the hosts' namespaces is killed: by `reap()` after each
job (PRRTE puts every rank in a process group of its own, so killing the job's session misses ranks that
outlive it, e.g. processes a rank left behind), by `close()`, and, should this process die
without closing, by each holder itself once its stdin reaches EOF.

``tc tbf`` can shape every link (both directions). This kernel may lack ``netem``: `has_netem()` says.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["EmulatedHosts", "missing_prerequisite", "has_netem", "ROOT"]

ROOT = Path(__file__).resolve().parents[2]
_TOOLS = ("ip", "unshare", "nsenter", "tc")


def missing_prerequisite() -> str | None:
    """Why emulated hosts cannot be built here, or None."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network, UTS and mount namespaces)"
    for tool in _TOOLS:
        if shutil.which(tool) is None:
            return f"emulated hosts need '{tool}' (iproute2/util-linux), not found on PATH"
    probe = subprocess.run(["unshare", "--net", "--uts", "--mount", "--", "ip", "link", "add", "b0", "type", "bridge"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot create namespaces with a bridge here: {probe.stderr.strip()}"
    return None


def has_netem() -> bool:
    """Whether this kernel can add latency (the netem qdisc), tried in a throwaway namespace."""
    probe = subprocess.run(["unshare", "--net", "--", "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                            "1ms"], capture_output=True, timeout=30)
    return probe.returncode == 0


#: Run by a holder when its stdin closes: SIGKILL every other process in its network namespace, a few
#: rounds (a process may fork while it is being killed). The harness normally has reaped them already;
#: this covers a harness that died without closing.
#: It never runs in the machine's own namespace (PID 1's), whatever happens.
_HOLDER_REAP = ("me=$(readlink /proc/$$/ns/net); [ \"$me\" = \"$(readlink /proc/1/ns/net)\" ] && exit 0; "
                "for round in 1 2 3 4 5; do found=; "
                "for d in /proc/[0-9]*; do p=${d#/proc/}; [ \"$p\" = \"$$\" ] && continue; "
                "[ \"$(readlink $d/ns/net 2>/dev/null)\" = \"$me\" ] || continue; "
                "kill -9 $p 2>/dev/null && found=1; done; [ -z \"$found\" ] && break; sleep 0.2; done")


@dataclass
class _Holder:
    proc: subprocess.Popen[str]
    net_ns: str = ""  # the holder's network namespace, "net:[inode]"

    @property
    def pid(self) -> int:
        return self.proc.pid


def _net_ns(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:  # gone, or a kernel thread
        return None


def _outer_namespaces() -> set[str | None]:
    """This process's and the machine's (PID 1's) network namespaces: never ones of the emulated hosts."""
    return {_net_ns(os.getpid()), _net_ns(1), None, ""}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


@dataclass
class EmulatedHosts:
    """`names` hosts on `subnet`; `rate` ("1gbit") shapes each link; `self_alias` maps a host's own name
    to that address in its /etc/hosts (Debian's 127.0.1.1) while the others' names map to their real
    addresses. Hosts may share a name (then address them by `addresses`). `congctl` ("cubic"): the TCP
    congestion control of every connection between the hosts (set on each host's route to the subnet;
    None: the kernel's default, which a new namespace inherits)."""

    names: list[str]
    subnet: str = "10.213.7.0/24"
    rate: str | None = None
    congctl: str | None = None
    self_alias: str | None = None
    workdir: Path = field(init=False)
    addresses: list[str] = field(init=False)
    _switch: _Holder | None = field(init=False, default=None)
    _hosts: list[_Holder] = field(init=False, default_factory=list)
    reaped: list[tuple[int, str]] = field(init=False, default_factory=list)  # killed after the last job

    def __post_init__(self) -> None:
        net = ipaddress.ip_network(self.subnet)
        self.addresses = [str(net.network_address + i + 1) for i in range(len(self.names))]
        self.workdir = Path(tempfile.mkdtemp(prefix="mpitrain-multihost-", dir="/var/tmp"))

    # -- set-up and tear-down --------------------------------------------------------------------
    def start(self) -> EmulatedHosts:
        try:
            self._switch = self._hold(["--net"], "ip link set lo up; ip link add br0 type bridge; ip link set br0 up")
            for i, name in enumerate(self.names):
                hosts_file = self.workdir / f"hosts.{i}"
                hosts_file.write_text(self._etc_hosts(i))
                setup = (f"hostname {name}; {self._private_tmp(i)}; mount -t tmpfs tmpfs /dev/shm; "
                         f"mount --bind {hosts_file} /etc/hosts; ip link set lo up")
                self._hosts.append(self._hold(["--net", "--uts", "--mount", "--propagation", "private"], setup))
                self._link(i)
            self._write_agent()
        except BaseException:
            self.close()
            raise
        return self

    def _private_tmp(self, i: int) -> str:
        """Shell that gives host i an empty /tmp of its own, keeping visible the checkout and the Python
        the jobs run from when they live under /tmp (a fresh clone there, as CI may make): each such
        directory is bound aside before the tmpfs covers /tmp, then bound back at its own path."""
        needed = {Path(p).resolve() for p in (ROOT, sys.prefix, sys.base_prefix)}
        under = sorted(p for p in needed if Path("/tmp") in p.parents)
        keep = [p for p in under if not any(q in p.parents for q in under)]
        steps = []
        for k, path in enumerate(keep):
            aside = self.workdir / f"keep.{i}.{k}"
            aside.mkdir()
            steps.append(f"mount --bind {path} {aside}")
        steps.append("mount -t tmpfs tmpfs /tmp")
        for k, path in enumerate(keep):
            steps.append(f"mkdir -p {path} && mount --bind {self.workdir / f'keep.{i}.{k}'} {path}")
        return "; ".join(steps)

    def _hold(self, flags: list[str], setup: str) -> _Holder:
        """A process holding new namespaces: runs `setup`, says ready, waits for stdin to close."""
        script = f"set -e; {setup}; echo ready; read x || true; set +e; {_HOLDER_REAP}"
        proc = subprocess.Popen(["unshare", *flags, "--", "sh", "-c", script], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # ends at "ready", or at EOF when setup failed
        if line.strip() != "ready":
            err = proc.stderr.read() if proc.stderr else ""
            proc.wait(timeout=10)
            raise RuntimeError(f"namespace set-up failed: {setup!r}: {err.strip()}")
        # Read only now that unshare has run: before, the holder is still in the caller's namespace.
        holder = _Holder(proc, _net_ns(proc.pid) or "")
        if holder.net_ns in _outer_namespaces():
            proc.kill()
            proc.wait(timeout=10)
            raise RuntimeError("namespace holder is not in a network namespace of its own")
        return holder

    def _ns(self, pid: int, *cmd: str) -> None:
        out = subprocess.run(["nsenter", "-t", str(pid), "-n", "--", *cmd], capture_output=True, text=True,
                             timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")

    def _link(self, i: int) -> None:
        assert self._switch is not None
        sw, host = self._switch.pid, self._hosts[i].pid
        port = f"v{i}"
        self._ns(sw, "ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", str(host))
        self._ns(sw, "ip", "link", "set", port, "master", "br0", "up")
        prefix = ipaddress.ip_network(self.subnet).prefixlen
        self._ns(host, "ip", "addr", "add", f"{self.addresses[i]}/{prefix}", "dev", "eth0")
        self._ns(host, "ip", "link", "set", "eth0", "up")
        if self.congctl:  # per route: a namespace may only pick an allowed default, which may not include it
            net = str(ipaddress.ip_network(self.subnet))
            self._ns(host, "ip", "route", "replace", net, "dev", "eth0", "proto", "kernel", "scope", "link",
                     "src", self.addresses[i], "congctl", self.congctl)
        if self.rate:
            # tbf on both ends: host -> switch on eth0, switch -> host on the bridge port. The burst must
            # hold at least one timer tick of traffic at this rate.
            for pid, dev in ((host, "eth0"), (sw, port)):
                self._ns(pid, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "256kb",
                         "latency", "100ms")

    def _etc_hosts(self, i: int) -> str:
        lines = ["127.0.0.1 localhost"]
        if self.self_alias:
            lines.append(f"{self.self_alias} {self.names[i]}")
        for j, (name, addr) in enumerate(zip(self.names, self.addresses, strict=True)):
            if not (self.self_alias and j == i) and self.names.count(name) == 1:
                lines.append(f"{addr} {name}")
        return "\n".join(lines) + "\n"

    def _write_agent(self) -> None:
        """An ssh-like agent: ``agent HOST COMMAND...`` runs COMMAND in HOST's namespaces via a shell,
        as ssh would on the remote side. HOST may be a name (when unique) or an address."""
        cases = []
        for name, addr, holder in zip(self.names, self.addresses, self._hosts, strict=True):
            keys = [addr] + ([name] if self.names.count(name) == 1 else [])
            cases.append(f"  {'|'.join(keys)}) pid={holder.pid} ;;")
        body = "\n".join(cases)
        self.agent.write_text(textwrap.dedent("""\
            #!/bin/sh
            # ssh-like agent for emulated hosts: agent HOST COMMAND...
            case "$1" in
            {body}
              *) echo "emulated-hosts agent: unknown host $1" >&2; exit 255 ;;
            esac
            shift
            exec nsenter -t "$pid" -n -u -m --wd={root} -- /bin/sh -c "$*"
            """).format(body=body, root=ROOT))
        self.agent.chmod(0o755)

    def processes(self) -> list[tuple[int, str]]:
        """Every process inside the hosts' (or the switch's) namespaces but their holders: (pid, command)."""
        holders = [*self._hosts, *([self._switch] if self._switch else [])]
        spaces = {h.net_ns for h in holders} - _outer_namespaces()
        if not spaces:
            return []
        mine = {h.pid for h in holders}
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) not in mine and _net_ns(int(entry)) in spaces:
                out.append((int(entry), _cmdline(int(entry))))
        return out

    def reap(self, timeout: float = 10) -> list[tuple[int, str]]:
        """SIGKILL every process in the hosts' namespaces (see `processes`) until none is left; returns
        those it killed. Raises if some survive `timeout` seconds (then something is stuck in the kernel)."""
        killed: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while left := self.processes():
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes in the emulated hosts survive SIGKILL: {left}")
            for pid, cmd in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed.setdefault(pid, cmd)
            time.sleep(0.05)
        return sorted(killed.items())

    def close(self) -> None:
        """Kill every process left in the hosts, end every holder (its namespaces go with it) and remove
        the work directory. Idempotent."""
        holders = [*self._hosts, *([self._switch] if self._switch else [])]
        if holders:
            self.reap()
        for h in holders:
            if h.proc.stdin and not h.proc.stdin.closed:
                h.proc.stdin.close()
        for h in holders:
            try:
                h.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                h.proc.kill()
                h.proc.wait(timeout=10)
            for stream in (h.proc.stdout, h.proc.stderr):
                if stream:
                    stream.close()
        self._hosts, self._switch = [], None
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EmulatedHosts:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- using the hosts ---------------------------------------------------------------------------
    @property
    def agent(self) -> Path:
        return self.workdir / "agent"

    def hostfile(self, slots: list[int], by_address: bool = False) -> Path:
        """A hostfile with `slots[i]` slots on host i (hosts with 0 slots are left out)."""
        path = self.workdir / f"hostfile.{'-'.join(map(str, slots))}{'.ip' if by_address else ''}"
        keys = self.addresses if by_address else self.names
        path.write_text("".join(f"{k} slots={s}\n" for k, s in zip(keys, slots, strict=False) if s))
        return path

    def enter(self, i: int) -> list[str]:
        """The argv prefix that runs a command inside host i (network, hostname, mounts)."""
        return ["nsenter", "-t", str(self._hosts[i].pid), "-n", "-u", "-m", f"--wd={ROOT}", "--"]

    def link_bytes(self) -> list[tuple[int, int]]:
        """Per host link, (bytes the host sent, bytes it received), from the host end's counters."""
        out = []
        for i in range(len(self._hosts)):
            cmd = "cat /sys/class/net/eth0/statistics/tx_bytes /sys/class/net/eth0/statistics/rx_bytes"
            # /sys shows the reader's network namespace only after a remount; read it from inside.
            text = subprocess.run([*self.enter(i), "sh", "-c", f"mount -t sysfs sysfs /sys 2>/dev/null; {cmd}"],
                                  capture_output=True, text=True, timeout=30, check=True).stdout.split()
            out.append((int(text[0]), int(text[1])))
        return out

    def run(self, np: int, hostfile: Path, command: list[str], launch_args: list[str] | None = None,
            env: dict[str, str] | None = None, timeout: float = 120, verb: list[str] | None = None
            ) -> subprocess.CompletedProcess[str]:
        """``mpitrain run -n np --hostfile F [launch_args] -- command`` started inside host 0, the other
        hosts reached through the agent; TCP and out-of-band traffic restricted to the hosts' subnet;
        no binding (every emulated host sees the same cores: PRRTE would pin each host's first rank to
        core 0); idle ranks yield (all hosts share this machine's cores)."""
        mpitrain = [sys.executable, "-m", "mpitrain", *(verb or ["run"])]
        argv = [*self.enter(0), *mpitrain, "-n", str(np), "--hostfile", str(hostfile),
                "--mca", "btl_tcp_if_include", self.subnet, "--mca", "oob_tcp_if_include", self.subnet,
                "--mca", "hwloc_default_binding_policy", "none", "--mca", "mpi_yield_when_idle", "1",
                *(launch_args or [])]
        if command:  # run's COMMAND follows "--"; bench and demo take their own arguments directly
            argv += ["--", *command] if verb is None else command
        full_env = {**os.environ, "PRTE_MCA_plm_ssh_agent": str(self.agent),
                    "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}", **(env or {})}
        return self._run_job(argv, timeout, full_env)

    def _run_job(self, argv: list[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        """Run `argv` in its own session until it exits (not until its output closes: a process a rank left
        behind may hold that open) and report what it printed. On timeout kill that session, and on any
        exit every process left in the hosts (`reap`): ranks sit in process groups of their own, out of the
        session's reach. What was killed after a job is named in its stderr and kept in `reaped`."""
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True, env=env, cwd=ROOT,
                                    start_new_session=True)
            note, code = "", None
            try:
                proc.wait(timeout=timeout)
            except BaseException as e:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                if not isinstance(e, subprocess.TimeoutExpired):
                    self.reaped = self.reap()
                    raise
                note, code = f"\n[emulated hosts] killed after {timeout} s", -signal.SIGKILL
            self.reaped = self.reap()
            if self.reaped:
                note += f"\n[emulated hosts] killed what the job left running: {self.reaped}"
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(argv, proc.returncode if code is None else code, out.read(),
                                               err.read() + note)


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.multihost.emulated --hosts 4 --slots 2 --rate 1gbit -- VERB ARGS...``: build the
    hosts, run ``mpitrain VERB -n hosts*slots --hostfile ... ARGS`` from host 0, print its output, tear down."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m tests.multihost.emulated")
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--slots", type=int, default=1, help="ranks per host")
    p.add_argument("--rate", default=None, help="tc tbf rate of every link, e.g. 1gbit, 100mbit")
    p.add_argument("--congctl", default=None, help="TCP congestion control between the hosts, e.g. cubic")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- VERB ARGS (run | bench NAME | demo)")
    args = p.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    why = missing_prerequisite()
    if why:
        print(why, file=sys.stderr)
        return 2
    verb = rest[:2] if rest[:1] == ["bench"] else rest[:1]
    with EmulatedHosts([f"h{i}" for i in range(args.hosts)], rate=args.rate, congctl=args.congctl) as hosts:
        out = hosts.run(args.hosts * args.slots, hosts.hostfile([args.slots] * args.hosts), rest[len(verb):],
                        verb=verb, timeout=args.timeout)
    sys.stdout.write(out.stdout)
    sys.stderr.write(out.stderr)
    return out.returncode


if __name__ == "__main__":
    raise SystemExit(main())
