"""--json FILE accumulates runs; --plot FILE.png draws each benchmark's plot from them."""

from __future__ import annotations

import argparse
import json

from mpitrain.bench import common
from mpitrain.bench._plots import find_table, plot_runs, size_bytes

PNG = b"\x89PNG\r\n\x1a\n"


def run(benchmark: str, ranks: int, *tables: tuple[list, list]) -> dict:
    return {"benchmark": benchmark, "ranks": ranks, "date": "2026-11-22 18:00 UTC", "command": "c", "machine": "m",
            "tables": [{"headers": h, "rows": r} for h, r in tables]}


MACHINE = (["kernel", "what", "MiB", "alone ms", "all ranks ms", "slowdown", "q25-q75", "ceiling x2"],
           [["add-dram", "", 192.0, 60.0, 80.0, 1.3, "", 1.5], ["conv-block", "", 48.0, 200.0, 300.0, 1.5, "", 1.33]])


def test_save_outputs_appends_every_printed_table_and_plots_from_all_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(common, "_TABLES", [])
    p = argparse.ArgumentParser()
    common.add_outputs(p)
    args = p.parse_args(["--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")])
    common.print_table(["kernel", "slowdown"], [["matmul", 1.25]])
    common.save_outputs(args, "machine", 2)
    common.save_outputs(args, "machine", 3)
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert [r["ranks"] for r in runs] == [2, 3]
    assert runs[0]["tables"] == [{"headers": ["kernel", "slowdown"], "rows": [["matmul", 1.25]]}]
    assert (tmp_path / "r.png").read_bytes()[:8] == PNG
    common.save_outputs(args, "machine", 2, rank=1)  # other ranks write nothing
    assert len(json.loads((tmp_path / "r.json").read_text())["runs"]) == 2


def test_pipeline_plot_draws_scaling_with_the_ceiling_and_efficiency_vs_m(tmp_path):
    thr = ["batch", "M", "sequential", "model", "data", "hybrid", "model/seq", "data/seq"]
    eff = ["schedule", "P", "M", "batch", "cuts", "T_seq ms", "T_seq all ms", "T_pipe ms", "efficiency", "q25-q75",
           "ideal", "of core ideal", "of machine ideal"]
    runs = [run("machine", 2, MACHINE),
            run("pipeline", 1, (thr, [[64, 8, 100.0, 100.0, 100.0, "n/a", 1.0, 1.0]])),
            run("pipeline", 2, (thr, [[64, 8, 100.0, 150.0, 170.0, "n/a", 1.5, 1.7]]),
                (eff, [["1f1b", 2, m, 64, "3", 1.0, 1.0, 1.0, m / (m + 2), "", m / (m + 1), 0.9, 0.9]
                       for m in (2, 8)]))]
    assert find_table(runs[2], "schedule", "efficiency")[1]["M"] == 8
    plot_runs(runs, "pipeline", str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG


def test_allreduce_and_pipesgd_plots(tmp_path):
    ar = (["size", "mpi4py us", "mpi4py busbw GB/s", "mpitrain[mpi] us", "mpitrain[mpi] busbw GB/s", "mpi/raw time"],
          [["1 KiB", 10.0, 0.1, 12.0, 0.08, 1.2], ["1 MiB", 500.0, 2.0, 520.0, 1.9, 1.04]])
    assert size_bytes("1 MiB") == 1 << 20
    plot_runs([run("machine", 2, MACHINE), run("allreduce", 2, ar)], "allreduce", str(tmp_path / "a.png"))
    ps = (["model", "link", "config", "iter ms", "s to acc 0.9", "final acc"],
          [["mlp", "real", "ring-k1", 5.0, 3.2, 0.93], ["mlp", "real", "ps", 7.0, "-", 0.85]])
    plot_runs([run("pipesgd", 2, ps)], "pipesgd", str(tmp_path / "s.png"))
    assert all((tmp_path / f).read_bytes()[:8] == PNG for f in ("a.png", "s.png"))
