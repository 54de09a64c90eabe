"""The benchmarks' plots, drawn from the runs that ``--json FILE`` accumulates (bench/common.py).

One function per kind of plot; :func:`plot_runs` picks by benchmark name:

* pipeline: img/s vs ranks (one run per ``-n``) with the ideal and the machine's ceiling (from the
  run's own "T_seq all": the sequential step on every rank at once, in the same job), and the
  pipeline efficiency vs M against the ideal M / (M + P - 1);
* allreduce: bus bandwidth vs message size per contender, with the machine's memory bandwidth;
* pipesgd: seconds to the target accuracy per configuration;
* anything else: the first numeric column of each printed table, as bars.

The machine's ceiling comes from ``mpitrain bench machine --json`` runs in the same file (same -n).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["plot_runs", "find_table", "size_bytes"]

Run = dict[str, Any]


def find_table(run: Run, *columns: str) -> list[dict[str, Any]] | None:
    """Rows (as header -> value dicts) of the first table of `run` whose headers start with each of
    `columns` (a column "x" matches headers "x", "x ms", ...); None if no table has them all."""
    for table in run.get("tables", []):
        heads = table["headers"]
        if all(any(h == c or h.startswith(c + " ") for h in heads) for c in columns):
            return [dict(zip(heads, row)) for row in table["rows"]]
    return None


def size_bytes(text: str) -> int:
    """ "4 KiB" -> 4096, "2 MiB" -> 2097152 (the allreduce benchmark's size column)."""
    value, unit = text.split()
    return int(value) << {"B": 0, "KiB": 10, "MiB": 20, "GiB": 30}[unit]


def _latest_per_ranks(runs: Sequence[Run]) -> dict[int, Run]:
    out: dict[int, Run] = {}
    for run in runs:
        out[int(run["ranks"])] = run  # later runs replace earlier ones
    return dict(sorted(out.items()))


def _ceiling(machines: dict[int, Run], ranks: int, kernel: str) -> float | None:
    """The machine's speed-up ceiling at `ranks` for `kernel` (bench machine's "ceiling xN" column)."""
    run = machines.get(ranks)
    rows = find_table(run, "kernel", "slowdown") if run else None
    for row in rows or []:
        if row["kernel"] == kernel:
            return float(ranks / row["slowdown"])
    return None


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _stamp(ax: Any, runs: Sequence[Run]) -> None:
    dates = sorted({r["date"] for r in runs})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} .. {dates[-1]}"
    ax.annotate(f"{when}; {runs[-1]['machine'][:90]}", (0, 0), (0, -42), xycoords="axes fraction",
                textcoords="offset points", fontsize=6, color="grey", va="top")


def _pipeline(ax_scale: Any, ax_eff: Any, runs: Sequence[Run], machines: dict[int, Run]) -> None:
    by_ranks = _latest_per_ranks(runs)
    series: dict[str, list[tuple[int, float]]] = {}
    seq: list[float] = []  # one rank alone, measured in every run: the 1-rank point of every curve
    ceiling: list[tuple[int, float]] = []
    for n, run in by_ranks.items():
        rows = find_table(run, "batch", "sequential", "model")
        if not rows:
            continue
        row = rows[-1]  # the largest batch
        if _number(row.get("sequential")) is not None:
            seq.append(float(row["sequential"]))
        for name in ("model", "data", "hybrid"):
            v = _number(row.get(name))
            if v is not None:
                series.setdefault(name, []).append((n, v))
        eff = find_table(run, "schedule", "T_seq all")
        if eff:  # the same job ran the sequential step on every rank at once: n x that is the ceiling
            row1 = min(eff, key=lambda r: r["M"])
            ceiling.append((n, n * row1["batch"] / (row1["T_seq all ms"] / 1e3)))
        else:
            c = _ceiling(machines, n, "conv-block")
            if c is not None and seq:
                ceiling.append((n, seq[-1] * c))
    if seq:
        one = sorted(seq)[len(seq) // 2]
        ranks = [1, *by_ranks]
        ax_scale.plot([1], [one], "o", color="black", label="sequential (1 rank)")
        ax_scale.plot(ranks, [one * n for n in ranks], ":", color="grey", label="ideal (sequential x ranks)")
        for name, pts in series.items():
            ax_scale.plot([1, *(n for n, _ in pts)], [one, *(v for _, v in pts)], marker="o", label=name)
        if ceiling:
            ax_scale.plot([1, *(n for n, _ in ceiling)], [one, *(v for _, v in ceiling)], "--", color="black",
                          label="machine ceiling (ranks x the sequential step run on every rank at once)")
        ax_scale.set_xticks(ranks)
    ax_scale.set(xlabel="ranks", ylabel="img/s (largest batch)", title="throughput vs ranks")
    ax_scale.legend(fontsize=7)
    last = list(by_ranks.values())[-1]
    rows = find_table(last, "schedule", "M", "efficiency", "ideal") or []
    for schedule in sorted({r["schedule"] for r in rows}):
        pts = sorted((r["M"], r["efficiency"]) for r in rows if r["schedule"] == schedule)
        ax_eff.plot(*zip(*pts), marker="o", label=f"{schedule} measured")
    if rows:
        P = rows[0]["P"]
        ms = sorted({r["M"] for r in rows})
        fine = [m / 4 for m in range(4 * min(ms), 4 * max(ms) + 1)]
        ax_eff.plot(fine, [m / (m + P - 1) for m in fine], ":", color="grey", label="ideal M/(M+P-1)")
        ax_eff.set(xlabel="micro-batches M", ylabel="efficiency T_seq / (P T_pipe)",
                   title=f"pipeline efficiency, P={P}", ylim=(0, 1.05))
        ax_eff.legend(fontsize=7)


def _allreduce(ax: Any, runs: Sequence[Run], machines: dict[int, Run]) -> None:
    by_ranks = _latest_per_ranks(runs)
    n, run = list(by_ranks.items())[-1]
    rows = find_table(run, "size") or []
    names = [h[:-len(" busbw GB/s")] for h in (rows[0] if rows else {}) if h.endswith(" busbw GB/s")]
    xs = [size_bytes(r["size"]) for r in rows]
    for name in names:
        ax.plot(xs, [r[f"{name} busbw GB/s"] for r in rows], marker="o", label=name)
    m = machines.get(n)
    dram = [r for r in (find_table(m, "kernel", "all ranks") or []) if r["kernel"] == "add-dram"] if m else []
    if dram:
        buffers = dram[0]["MiB"] * 2**20  # one call of the kernel passes over them until ~400 MiB moved
        moved = max(1, (400 << 20) // int(buffers)) * buffers
        bw = moved / (dram[0]["all ranks ms"] / 1e3) / 1e9
        ax.axhline(bw, ls="--", color="black", label=f"memory bandwidth per rank, all ranks streaming ({bw:.1f} GB/s)")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="message size (bytes)", ylabel="bus bandwidth GB/s", title=f"allreduce, {n} ranks")
    ax.legend(fontsize=7)


def _pipesgd(ax: Any, runs: Sequence[Run]) -> None:
    run = runs[-1]
    table = next((t for t in run["tables"] if any(h.startswith("s to acc") for h in t["headers"])), None)
    if table is None:
        return
    col = next(h for h in table["headers"] if h.startswith("s to acc"))
    rows = [dict(zip(table["headers"], r)) for r in table["rows"]]
    labels = [f"{r['model']} {r['link']}\n{r['config']}" for r in rows]
    values = [r[col] if _number(r[col]) is not None else float("nan") for r in rows]
    ax.bar(range(len(rows)), values, color="#4C72B0")
    few = len(rows) <= 8
    ax.set_xticks(range(len(rows)), labels, fontsize=7 if few else 6, rotation=0 if few else 60,
                  ha="center" if few else "right")
    ax.set(ylabel=f"seconds {col[2:]}", title=f"Pipe-SGD time to accuracy, {run['ranks']} ranks")


def _generic(ax: Any, runs: Sequence[Run]) -> None:
    run = runs[-1]
    table = run["tables"][-1] if run["tables"] else {"headers": [], "rows": []}
    heads, rows = table["headers"], table["rows"]
    col = next((i for i in range(1, len(heads)) if rows and all(_number(r[i]) is not None for r in rows)), None)
    if col is None:
        return
    ax.bar(range(len(rows)), [r[col] for r in rows], color="#4C72B0")
    ax.set_xticks(range(len(rows)), [" ".join(str(v) for v in r[:col]) for r in rows], fontsize=6, rotation=60,
                  ha="right")
    ax.set(ylabel=heads[col], title=f"{run['benchmark']}, {run['ranks']} ranks")


def plot_runs(runs: Sequence[Run], benchmark: str, out: str) -> None:
    """Draw `benchmark`'s plot from `runs` (every run of the --json file) into the image `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in runs if r["benchmark"] == benchmark]
    machines = _latest_per_ranks([r for r in runs if r["benchmark"] == "machine"])
    if benchmark == "pipeline":
        fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
        _pipeline(a, b, mine, machines)
        _stamp(a, mine)
    else:
        fig, a = plt.subplots(figsize=(8, 4.5))
        if benchmark == "allreduce":
            _allreduce(a, mine, machines)
        elif benchmark == "pipesgd":
            _pipesgd(a, mine)
        else:
            _generic(a, mine)
        _stamp(a, mine)
    for ax in fig.axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
