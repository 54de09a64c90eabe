"""The timeline without a job: the recorder's rows and nesting, the off path, the Gantt plot and its CLI,
and MPITRAIN_TIMELINE from outside a 2-rank job."""

from __future__ import annotations

import json
import os
import threading

from mpitrain import timeline
from mpitrain.cli import main as cli
from mpitrain.timeline import _recorder
from mpitrain.timeline._recorder import Recorder
from mpitrain.timeline._trace import local_rows, merge
from tests.helpers import run_job

from .trace_checks import problems, row_names, x_events


def recorded(fn) -> dict:
    """Run `fn` with a recorder installed in this process; the merged one-rank document."""
    rec = Recorder(1000)
    _recorder.current = rec
    try:
        fn()
    finally:
        _recorder.current = None
    return merge([local_rows(rec, list(rec.events), 0, 0)], {})


def test_span_is_one_shared_no_op_when_off():
    assert _recorder.current is None and not timeline.active()
    assert timeline.span("a", micro=1) is timeline.span("b")
    with timeline.span("a"):
        pass
    timeline.record("x", 1, 2)


def test_spans_nest_on_their_thread_row_and_other_threads_get_their_own_rows():
    def work():
        with timeline.span("outer"):
            with timeline.span("inner"):
                pass
            with timeline.span("wait here", kind="wait"):
                pass
        with timeline.span("threaded"):
            worker = threading.Thread(target=lambda: [timeline.record("job", 5, 9)], name="worker-1")
            worker.start()
            worker.join()

    doc = recorded(work)
    assert problems(doc) == []
    rows = {row_names(doc)[(e["pid"], e["tid"])]: e["name"] for e in x_events(doc) if e["name"] in ("job", "wait here")}
    assert rows == {"worker-1": "job", "waits": "wait here"}
    outer, inner = (next(e for e in x_events(doc) if e["name"] == n) for n in ("outer", "inner"))
    assert outer["tid"] == inner["tid"] and outer["ts"] <= inner["ts"] and inner["dur"] <= outer["dur"]


def test_two_live_threads_of_one_name_get_separate_rows_so_their_waits_never_overlap():
    # two kvstores alive at once each run a thread named "kvstore-coordinator"
    both_waiting = threading.Barrier(2)

    def wait_then_record():
        t0 = _recorder.now()
        both_waiting.wait()
        timeline.record("wait", t0, _recorder.now() + 1, kind="wait")

    def work():
        threads = [threading.Thread(target=wait_then_record, name="kvstore-coordinator") for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    doc = recorded(work)
    assert problems(doc) == []
    labels = {row_names(doc)[(e["pid"], e["tid"])] for e in x_events(doc) if e["name"] == "wait"}
    assert labels == {"kvstore-coordinator waits", "kvstore-coordinator #2 waits"}


def test_request_waits_polled_in_turn_are_clipped_so_they_never_overlap():
    rec = Recorder(10)
    rec.add_wait("a", 100, 300)
    rec.add_wait("b", 200, 400)  # polled at the same time as a: starts where a ended
    rec.add_wait("c", 250, 350)  # entirely inside what was already counted: dropped
    assert [(e[1], e[2], e[3]) for e in rec.events] == [("a", 100, 300), ("b", 300, 400)]


def test_recorder_keeps_the_most_recent_max_events_and_counts_the_rest():
    rec = Recorder(3)
    for i in range(5):
        rec.add("compute", f"e{i}", i, i + 1)
    assert [e[1] for e in rec.events] == ["e2", "e3", "e4"] and rec.offered == 5


def test_timeline_plot_cli_draws_a_png_with_one_row_per_rank_and_thread(tmp_path):
    doc = merge([[("compute", "F0", 0.0, 10.0, None), ("compute", "B0", 10.0, 20.0, None),
                  ("comm", "isend", 9.0, 1.0, {"bytes": 8, "peer": 1})],
                 [("compute", "F0", 11.0, 10.0, None), ("waits", "wait irecv", 1.0, 9.0, None)]], {"ranks": 2})
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(doc))
    out = tmp_path / "t.png"
    assert cli(["timeline", "plot", str(trace), "-o", str(out), "--start", "0", "--end", "30"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli(["timeline", "plot", str(tmp_path / "missing.json"), "-o", str(out)]) == 2


def test_bubble_is_the_share_of_the_schedules_window_not_computed_or_spent_waiting(tmp_path, capsys):
    """Rank 0: a step of 100 ms whose actions F0 (10-30) and W0.1 (40-90, waiting 50-60 inside) span a
    window of 80 ms, 60 of them computing: busy 0.75. Its first step (the set-up) is skipped; rank 1
    has no step span (it is left out)."""
    ms = 1000.0  # merge takes microseconds
    doc = merge([[("compute", "step", 0.0, 50 * ms, None), ("compute", "F0", 5 * ms, 40 * ms, None),
                  ("compute", "step", 100 * ms, 100 * ms, None), ("compute", "F0", 110 * ms, 20 * ms, None),
                  ("compute", "W0.1", 140 * ms, 50 * ms, None), ("waits", "wait irecv", 150 * ms, 10 * ms, None),
                  ("compute", "optimizer step", 195 * ms, 3 * ms, None)],
                 [("compute", "F0", 0.0, 10 * ms, None)]], {"ranks": 2})
    (got,) = timeline.occupancy(doc, skip=1)
    assert (got.rank, got.steps, got.step_ms, got.window_ms, got.waits_ms, got.compute_ms) == (0, 1, 100, 80, 10, 60)
    assert got.busy == 0.75 and got.of_step == 0.6
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps(doc))
    assert cli(["timeline", "bubble", str(trace)]) == 0
    assert "0.750" in capsys.readouterr().out


def test_mpitrain_timeline_env_writes_one_trace_of_both_ranks_at_exit(tmp_path, monkeypatch):
    path = tmp_path / "env.json"
    monkeypatch.setenv("MPITRAIN_TIMELINE", str(path))
    job = run_job("""
        import torch, mpitrain
        comm = mpitrain.init()
        comm.allreduce(torch.ones(256))
        comm.barrier()
    """, n=2, timeout=120)
    assert job.returncode == 0, job.stderr
    doc = json.loads(path.read_text())
    assert problems(doc) == []
    reduces = [e for e in x_events(doc) if e["name"] == "allreduce"]
    assert sorted(e["pid"] for e in reduces) == [0, 1] and all(e["args"]["bytes"] == 1024 for e in reduces)
    assert doc["otherData"]["ranks"] == 2 and os.path.basename(str(path)) in job.stdout


def test_a_horovod_script_writes_a_trace_when_MPITRAIN_TIMELINE_is_set(tmp_path, monkeypatch):
    path = tmp_path / "hvd.json"
    monkeypatch.setenv("MPITRAIN_TIMELINE", str(path))
    job = run_job("""
        import torch
        import mpitrain.horovod as hvd
        hvd.init()
        out = hvd.allreduce(torch.ones(64), name="t", op=hvd.Sum)
        assert float(out[0]) == hvd.size()
        hvd.shutdown()
    """, n=2, timeout=120)
    assert job.returncode == 0, job.stderr
    doc = json.loads(path.read_text())
    assert problems(doc) == []
    reduces = [e for e in x_events(doc) if e["name"] == "allreduce" and e["args"].get("bytes") == 256]
    assert sorted({e["pid"] for e in reduces}) == [0, 1], sorted({e["name"] for e in x_events(doc)})
