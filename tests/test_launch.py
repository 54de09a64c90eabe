"""The launcher: the mpiexec line it builds, and failure propagation observed from outside the job."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from mpitrain._hosts import Host, expand_hostlist, expand_tasks_per_node, slurm_hosts
from mpitrain.launch import LaunchSpec, abort_on_exit, build_command
from tests.helpers import run_job

MPITRAIN = [sys.executable, "-m", "mpitrain"]


def test_command_allows_root_and_sets_threads():
    argv, env = build_command(LaunchSpec(np=2, command=["python", "x.py"], threads=3), flavor="openmpi")
    assert argv[1:3] == ["-n", "2"] and argv[-4:] == ["python", "-m", "mpi4py", "x.py"]
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


def test_hosts_count_slots_and_hostfile_is_passed_through(tmp_path):
    argv, _ = build_command(LaunchSpec(np=8, command=["true"], hosts="a:4,b:4"), flavor="openmpi")
    assert argv[argv.index("-H") + 1] == "a:4,b:4" and "--oversubscribe" not in argv
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("# two nodes\na slots=4\nb slots=4 max_slots=8\n")
    argv, _ = build_command(LaunchSpec(np=8, command=["true"], hostfile=str(hostfile)), flavor="openmpi")
    assert argv[argv.index("--hostfile") + 1] == str(hostfile) and "--oversubscribe" not in argv
    over, _ = build_command(LaunchSpec(np=9, command=["true"], hostfile=str(hostfile)), flavor="openmpi")
    assert "--oversubscribe" in over
    with pytest.raises(ValueError, match="not both"):
        build_command(LaunchSpec(np=2, command=["true"], hosts="a", hostfile=str(hostfile)), flavor="openmpi")


@pytest.mark.parametrize("line", ["a;reboot slots=2", "$(id) slots=1", "a slots=two", "a slots=0", "a cpu=3",
                                  "a `x`"])
def test_hostfile_accepts_only_names_and_slots(tmp_path, line):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"ok slots=1\n{line}\n")
    with pytest.raises(ValueError, match=r"hosts.txt:2"):
        build_command(LaunchSpec(np=2, command=["true"], hostfile=str(hostfile)), flavor="openmpi")


def test_bad_host_names_and_env_names_are_refused_before_launch():
    for hosts in ("a;b:1", "a:x", "a b", "-oProxyCommand=x"):
        with pytest.raises(ValueError, match="-H entry"):
            build_command(LaunchSpec(np=1, command=["true"], hosts=hosts), flavor="openmpi")
    with pytest.raises(ValueError, match="not an environment variable name"):
        build_command(LaunchSpec(np=1, command=["true"], env={"A B": "1"}), flavor="openmpi")
    with pytest.raises(ValueError, match="not an MCA parameter"):
        build_command(LaunchSpec(np=1, command=["true"], mca=[("a;b", "1")]), flavor="openmpi")


def test_every_mpitrain_variable_and_each_x_name_is_forwarded(monkeypatch):
    monkeypatch.setenv("MPITRAIN_BACKEND", "torch")
    monkeypatch.setenv("MPITRAIN_SOMETHING_NEW", "1")
    monkeypatch.setenv("MINE", "here")
    argv, env = build_command(LaunchSpec(np=2, command=["true"], env={"MINE": None, "SET": "v"},
                                         mca=[("btl_tcp_if_include", "10.0.0.0/24")]), flavor="openmpi")
    forwarded = {argv[i + 1] for i, a in enumerate(argv) if a == "-x"}
    assert {"MPITRAIN_BACKEND", "MPITRAIN_SOMETHING_NEW", "MINE", "SET"} <= forwarded and env["SET"] == "v"
    i = argv.index("--mca")
    assert argv[i:i + 3] == ["--mca", "btl_tcp_if_include", "10.0.0.0/24"]
    monkeypatch.delenv("MINE")
    with pytest.raises(ValueError, match="not set here"):
        build_command(LaunchSpec(np=2, command=["true"], env={"MINE": None}), flavor="openmpi")


def test_threads_get_that_many_cores_or_no_binding():
    cores = os.cpu_count() or 1
    argv, _ = build_command(LaunchSpec(np=1, command=["true"], threads=cores), flavor="openmpi")
    if cores > 1:
        assert argv[argv.index("--map-by") + 1] == f"slot:PE={cores}"
    argv, _ = build_command(LaunchSpec(np=1, command=["true"], threads=cores + 1), flavor="openmpi")
    assert argv[argv.index("--bind-to") + 1] == "none" and "--map-by" not in argv
    argv, _ = build_command(LaunchSpec(np=2, command=["true"], hosts="a:1,b:1", threads=2), flavor="openmpi")
    assert argv[argv.index("--bind-to") + 1] == "none"  # remote cores are unknown here: never one core


def test_slurm_allocation_supplies_hosts_and_ranks(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[01-03,07],gpu5")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x3),1,4")
    monkeypatch.setenv("SLURM_NTASKS", "11")
    argv, _ = build_command(LaunchSpec(np=11, command=["true"]), flavor="openmpi")
    assert argv[argv.index("-H") + 1] == "node01:2,node02:2,node03:2,node07:1,gpu5:4"
    assert "--oversubscribe" not in argv
    out = subprocess.run([*MPITRAIN, "run", "--dry-run", "--", "true"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "-n 11 " in out.stdout, out.stderr
    argv, _ = build_command(LaunchSpec(np=2, command=["true"], hosts="x:2"), flavor="openmpi")
    assert argv[argv.index("-H") + 1] == "x:2"  # explicit hosts win over the allocation


def test_hostlist_expansion_follows_slurm():
    assert expand_hostlist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07", "gpu5"]
    assert expand_hostlist("r[1-2]n[8-9]") == ["r1n8", "r1n9", "r2n8", "r2n9"]
    assert expand_hostlist("a,b-c[009-011]") == ["a", "b-c009", "b-c010", "b-c011"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm_hosts({"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NTASKS": "4"}) == (
        [Host("n1", 2), Host("n2", 1), Host("n3", 1)], 4)
    assert slurm_hosts({}) is None
    for bad in ("n[1-", "n[a-b]", "n[1-2];x"):
        with pytest.raises(ValueError):
            expand_hostlist(bad)


def test_cli_launch_arguments_reach_bench_and_demo(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1 slots=2\nh2 slots=2\n")
    for verb in (["bench", "allreduce"], ["demo"]):
        out = subprocess.run([*MPITRAIN, *verb, "-n", "4", "--hostfile", str(hostfile), "-x", "A=1",
                              "--mca", "k", "v", "--dry-run"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert f"--hostfile {hostfile}" in out.stdout and "-x A" in out.stdout and "--mca k v" in out.stdout
    out = subprocess.run([*MPITRAIN, "bench", "allreduce", "-H", "a;b", "--dry-run"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "not a host name" in out.stderr


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
    assert "mpiexec -n 3" in out.stdout and out.stdout.rstrip().endswith("python -m mpi4py train.py --lr 0.1")


@pytest.mark.parametrize("flag", ["-n", "-np", "--np"])
def test_rank_count_takes_mpiruns_spellings(flag):
    out = subprocess.run([*MPITRAIN, "run", flag, "3", "--dry-run", "python", "train.py"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "mpiexec -n 3" in out.stdout


@pytest.mark.parametrize(("command", "expected"), [
    ("python train.py a", "python -m mpi4py train.py a"),
    ("python -u -W ignore train.py", "python -u -W ignore -m mpi4py train.py"),
    ("python -X dev -m pkg.mod --x 1", "python -X dev -m mpi4py -m pkg.mod --x 1"),
    ("python3 -Wignore -Xdev x.py", "python3 -Wignore -Xdev -m mpi4py x.py"),
    ("python -c code a", "python -m mpi4py -c code a"),
    ("python -ccode", "python -m mpi4py -c code"),
    ("python -um pkg", "python -u -m mpi4py -m pkg"),
    ("python -- x.py", "python -m mpi4py x.py"),
    ("/abs/path/python3.11 x.py", "/abs/path/python3.11 -m mpi4py x.py"),
    ("python -m mpi4py x.py", "python -m mpi4py x.py"),
    ("python -m mpi4py -m pytest -x", "python -m mpi4py -m pytest -x"),
    ("python", "python"),
    ("python -u -", "python -u -"),
    ("python -V", "python -V"),
    ("./run.sh a", "./run.sh a"),
    ("bash -c x", "bash -c x"),
    ("pythonista x.py", "pythonista x.py"),
])
def test_python_commands_run_under_mpi4pys_runner_others_unchanged(command, expected):
    assert abort_on_exit(command.split()) == expected.split()
    assert abort_on_exit([sys.executable, "x.py"]) == [sys.executable, "-m", "mpi4py", "x.py"]
    argv, _ = build_command(LaunchSpec(np=2, command=command.split()), flavor="mpich")
    assert argv[-len(expected.split()):] == expected.split()


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
    assert rc != 0 and "boom from rank one" in out, out
    assert "[mpitrain] rank 1: uncaught exception, aborting the job" in out, out
    assert 0 < secs < 10, f"job ended {secs:.1f}s after the failure"


@pytest.mark.parametrize(("exit_with", "status", "shown"), [
    ("sys.exit(3)", 3, "Errorcode: 3"),
    ("raise SystemExit('bye from rank one')", 1, "bye from rank one"),
    ("raise KeyboardInterrupt", 1, "[mpitrain] rank 1: uncaught exception, aborting the job"),
])
def test_non_zero_exit_of_one_rank_ends_the_job_with_its_status(exit_with, status, shown):
    # SystemExit never reaches sys.excepthook: without mpi4py's runner the rank's exit calls
    # MPI_Finalize, which waits for rank 0 in its barrier forever.
    rc, out, secs = _run_job(JOB_HEAD + f"""
    import sys
    if comm.rank == 1:
        print("FAIL_AT", time.time(), flush=True)
        {exit_with}
    comm.barrier()
    time.sleep(60)
    """)
    assert rc == status and shown in out and "MPI_ABORT was invoked on rank 1" in out, out
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


def test_successful_job_ending_in_sys_exit_zero_exits_zero_quietly():
    rc, out, _ = _run_job(JOB_HEAD + """
    import sys
    comm.allreduce(t)
    assert t[0].item() == comm.size
    print("sum ok on", comm.rank)
    sys.exit(0)
    """, n=3)
    assert rc == 0 and out.count("sum ok on") == 3, out
    assert "MPI_ABORT" not in out and "prterun" not in out, out  # finalized, no complaint from Open MPI


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


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores to give a rank 2")
def test_a_rank_with_two_threads_is_not_pinned_to_one_core():
    out = subprocess.run([*MPITRAIN, "run", "-n", "1", "--threads", "2", "--", sys.executable, "-c",
                          "import os; print('CORES', len(os.sched_getaffinity(0)))"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "CORES 2" in out.stdout, out.stdout + out.stderr
