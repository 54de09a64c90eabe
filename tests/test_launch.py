"""The launcher: the mpiexec line it builds, and failure propagation observed from outside the job."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mpitrain.launch import LaunchSpec, build_command
from tests.helpers import run_job

MPITRAIN = [sys.executable, "-m", "mpitrain"]


def test_command_allows_root_and_sets_threads():
    argv, env = build_command(LaunchSpec(np=2, command=["python", "x.py"], threads=3), flavor="openmpi")
    assert argv[1:3] == ["-n", "2"] and argv[-2:] == ["python", "x.py"]
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1" and env["OMP_NUM_THREADS"] == "3"
    assert "-x" in argv and "OMP_NUM_THREADS" in argv


def test_malloc_tunables_are_set_unless_the_user_chose_them(monkeypatch):
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")
    argv, env = build_command(LaunchSpec(np=2, command=["true"]), flavor="openmpi")
    assert env["MALLOC_TRIM_THRESHOLD_"] == str(1 << 30) and "MALLOC_TRIM_THRESHOLD_" in argv
    assert "MALLOC_MMAP_THRESHOLD_" not in env and "MALLOC_MMAP_THRESHOLD_" in argv  # the user's own value, forwarded


def test_oversubscription_disables_binding_only_beyond_the_cores():
    cores = os.cpu_count() or 1
    over, env = build_command(LaunchSpec(np=cores + 1, command=["true"]), flavor="openmpi")
    assert "--oversubscribe" in over and over[over.index("--bind-to") + 1] == "none"
    assert env["OMPI_MCA_mpi_yield_when_idle"] == "1"
    fits, _ = build_command(LaunchSpec(np=1, command=["true"]), flavor="openmpi")
    assert "--oversubscribe" not in fits


def test_hosts_count_slots_and_hostfile_is_passed_through():
    argv, _ = build_command(LaunchSpec(np=8, command=["true"], hosts="a:4,b:4"), flavor="openmpi")
    assert argv[argv.index("-H") + 1] == "a:4,b:4" and "--oversubscribe" not in argv
    argv, _ = build_command(LaunchSpec(np=8, command=["true"], hostfile="hosts.txt"), flavor="openmpi")
    assert argv[argv.index("--hostfile") + 1] == "hosts.txt"
    with pytest.raises(ValueError, match="not both"):
        build_command(LaunchSpec(np=2, command=["true"], hosts="a", hostfile="f"), flavor="openmpi")


def test_mpich_flavor_uses_hydra_flags():
    argv, _ = build_command(LaunchSpec(np=2, command=["true"], hosts="a:1,b:1", threads=2), flavor="mpich")
    assert "-hosts" in argv and "-genv" in argv and "--oversubscribe" not in argv


def test_bad_launch_arguments_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        build_command(LaunchSpec(np=0, command=["true"]), flavor="openmpi")
    with pytest.raises(ValueError, match="no command"):
        build_command(LaunchSpec(np=1, command=[]), flavor="openmpi")


def test_dry_run_prints_the_exact_command():
    out = subprocess.run([*MPITRAIN, "run", "-n", "3", "--dry-run", "--", "python", "train.py", "--lr", "0.1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "mpiexec -n 3" in out.stdout and out.stdout.rstrip().endswith("python train.py --lr 0.1")


def _run_job(body: str, n: int = 2) -> tuple[int, str, float]:
    """Run `body` on `n` ranks; returns (exit code, output, seconds from the FAIL_AT mark to job end).

    The clock starts at the moment a rank prints FAIL_AT (just before failing), so launch time on a
    loaded machine does not count against the 10 s the job has to end."""
    out = run_job(body, n=n)
    end = time.time()
    text = out.stdout + out.stderr
    marks = [float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("FAIL_AT ")]
    return out.returncode, text, (end - marks[0]) if marks else 0.0


JOB_HEAD = """
    import os, signal, time, torch, mpitrain
    comm = mpitrain.init()
    comm.barrier()
    t = torch.ones(4)
"""


def test_uncaught_exception_in_one_rank_aborts_the_job_quickly():
    rc, out, secs = _run_job(JOB_HEAD + """
    if comm.rank == 1:
        print("FAIL_AT", time.time(), flush=True)
        raise RuntimeError("boom from rank one")
    comm.allreduce(t)          # rank 0 would wait here forever without the abort hook
    time.sleep(60)
    """)
    assert rc != 0 and "boom from rank one" in out and "rank 1" in out, out
    assert 0 < secs < 10, f"job ended {secs:.1f}s after the failure"


def test_rank_killed_by_sigkill_ends_the_job_quickly():
    rc, out, secs = _run_job(JOB_HEAD + """
    if comm.rank == 1:
        print("FAIL_AT", time.time(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    comm.allreduce(t)
    time.sleep(60)
    """)
    assert rc != 0 and ("signal 9" in out or "Killed" in out), out
    assert 0 < secs < 10, f"job ended {secs:.1f}s after the failure"


def test_successful_job_exits_zero_and_python_dash_m_works():
    rc, out, _ = _run_job(JOB_HEAD + """
    comm.allreduce(t)
    assert t[0].item() == comm.size
    print("sum ok on", comm.rank)
    """, n=3)
    assert rc == 0 and out.count("sum ok on") == 3, out


def test_stalled_wait_warns_naming_rank_and_tensor_then_aborts():
    rc, out, secs = _run_job(JOB_HEAD + """
    from mpitrain.comm._wait import StallPolicy, wait_request
    if comm.rank == 0:     # rank 1 never sends: a logical deadlock, not a dead rank
        print("FAIL_AT", time.time(), flush=True)
        req = comm.irecv(torch.empty(3), source=1, tag=77)
        wait_request(req, "recv of 'activation 3' from rank 1", StallPolicy(1.0, 3.0), f"rank {comm.rank}", comm.abort)
    time.sleep(60)
    """)
    assert rc != 0 and "rank 0: still waiting" in out and "'activation 3' from rank 1" in out, out
    assert 3 <= secs < 13, f"job ended {secs:.1f}s after the stall began"
