"""Test helpers for SPMD tests: verdicts that every rank reaches together."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["assert_all_ranks", "assert_close_all_ranks", "bitwise_equal", "run_job", "calls_recorded", "ROOT"]

ROOT = Path(__file__).resolve().parents[1]


def assert_all_ranks(comm, ok: bool, msg: str = "") -> None:
    """Fail on *every* rank if `ok` is false on any rank (a rank-local failure would hang the others)."""
    verdicts = comm.allgather_object((bool(ok), msg if not ok else ""))
    bad = [(r, m) for r, (v, m) in enumerate(verdicts) if not v]
    assert not bad, "failed on ranks " + "; ".join(f"{r}: {m}" for r, m in bad)


def assert_close_all_ranks(comm, actual: torch.Tensor, expected: torch.Tensor, atol: float = 0.0,
                           rtol: float = 0.0, what: str = "") -> None:
    """`actual` equals `expected` within tolerances on every rank; the message names rank and max error."""
    same_shape = actual.shape == expected.shape
    ok = same_shape and torch.allclose(actual.double(), expected.double(), atol=atol, rtol=rtol)
    err = (actual.double() - expected.double()).abs().max().item() if same_shape and actual.numel() else 0.0
    assert_all_ranks(comm, ok, f"{what} shape {tuple(actual.shape)} vs {tuple(expected.shape)}, max abs err {err}")


def bitwise_equal(a: object, b: object) -> bool:
    """`a` and `b` (tensors, or dicts / lists / tuples of them, such as state dicts) are equal to the
    bit: same structure, keys, dtypes and values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))
    return a == b


def run_job(script: str | Path, n: int = 2, timeout: float = 120,
            flags: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """Run `script` (source text, or a path) on `n` ranks with ``mpitrain run``, from outside any job;
    returns the finished process (stdout/stderr as text). For behaviour only visible from outside: aborts,
    stall watchdogs, exit codes. The timeout turns a hang into a test failure (TimeoutExpired) and ends
    the job: the launcher gets SIGTERM, which mpiexec turns into ending every rank (subprocess.run's
    SIGKILL would leave mpiexec and the ranks running). `flags` go to ``mpitrain run`` (``--torch-env``)."""
    path = Path(script) if isinstance(script, Path) else None
    with tempfile.TemporaryDirectory() as tmp:
        if path is None:
            path = Path(tmp) / "job.py"
            path.write_text(textwrap.dedent(str(script)))
        launcher = Path(sys.executable).parent / "mpitrain"
        argv = [str(launcher), "run", "-n", str(n), *flags, "--", sys.executable, str(path)]
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) as job:
            try:
                out, err = job.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                job.terminate()
                try:
                    job.communicate(timeout=30)
                finally:
                    job.kill()
                raise
        return subprocess.CompletedProcess(argv, job.returncode, out, err)


class _CallNames:
    """A tracer (comm/tracing.py): the names of the calls made on traced communicators (not their waits)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def add(self, kind: str, name: str, t0: int, t1: int, args: dict | None = None) -> None:
        self.names.append(name)

    def add_wait(self, name: str, t0: int, t1: int, args: dict | None = None, clip: bool = True) -> None:
        pass


@contextmanager
def calls_recorded() -> Iterator[list[str]]:
    """The names of the calls this process makes on every communicator while the block runs, in order
    (the tracer of comm/tracing.py, the previous one restored after): what a test checks was sent, or
    that nothing was before a refusal."""
    from mpitrain.comm import tracing

    tracer = _CallNames()
    previous = tracing.set_tracer(tracer)
    try:
        yield tracer.names
    finally:
        tracing.set_tracer(previous)
