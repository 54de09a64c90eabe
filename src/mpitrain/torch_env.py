"""``python -m mpitrain.torch_env PROGRAM [ARGS]`` (what ``mpitrain run --torch-env`` starts on every rank):
set the environment ``torchrun`` would (:func:`mpitrain.comm.torchrun_env`: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT, ...; a variable already set is kept), then run PROGRAM (a script, ``-m module``
or ``-c code``) under mpi4py's runner, so a rank's non-zero exit still ends the job. A script written for
``torchrun`` and ``init_process_group("gloo")`` / DDP thus runs under ``mpiexec`` on a cluster unchanged.
DeepSpeed's ``mpi_discovery`` and Lightning's ``MPIEnvironment`` do the same translation."""

from __future__ import annotations

import gc
import os
import sys

__all__ = ["main"]


def main() -> None:
    from mpi4py import MPI

    from .comm import MPICommunicator, torchrun_env

    for name, value in torchrun_env(MPICommunicator(MPI.COMM_WORLD)).items():
        os.environ.setdefault(name, value)
    from mpi4py.run import main as run  # reads its program from sys.argv[1:], as `python -m mpi4py` does

    sys.argv = ["mpi4py", *sys.argv[1:]]
    try:
        run()
    finally:
        # Free the program's objects while the interpreter is whole: a DDP model left to interpreter
        # shutdown is freed there with its gloo worker threads still taking the GIL, and a thread doing
        # so during finalization aborts the process ("terminate called without an active exception";
        # here 1 run in 5 of a two-line DDP script without `del model`).
        gc.collect()


if __name__ == "__main__":
    main()
