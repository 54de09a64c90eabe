"""`mpitrain bench machine`: the table is collective and self-consistent at any world size."""

from __future__ import annotations

import pytest

from mpitrain.bench.machine import KERNELS, main, measure
from tests.helpers import assert_all_ranks


@pytest.mark.mpi
def test_rows_agree_on_every_rank_and_ceiling_is_size_over_slowdown(comm):
    rows = measure(comm, ["add-l2"], rounds=2)
    everyone = comm.allgather_object(rows)
    (name, _, mib, alone, together, slowdown, _, ceiling), = rows
    ok = (all(r == everyone[0] for r in everyone) and name == "add-l2" and mib == pytest.approx(0.75)
          and alone > 0 and together > 0 and ceiling == pytest.approx(comm.size / slowdown))
    assert_all_ranks(comm, ok, repr(rows))


def test_every_kernel_runs_and_unknown_names_are_refused(capsys):
    for factory, _ in KERNELS.values():
        run, nbytes = factory()
        run()
        assert nbytes > 0
    with pytest.raises(SystemExit):
        main(["--kernels", "add-l2,nope"])
    assert "unknown kernel(s) ['nope']" in capsys.readouterr().err
