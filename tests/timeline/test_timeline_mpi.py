"""The job's timeline over real MPI: a pipeline trace that is valid, nests and follows the schedule;
clock alignment; nothing recorded or written when no timeline runs; the world's splits traced by composition."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from mpitrain import timeline
from mpitrain.comm._mpi import MPICommunicator
from mpitrain.comm._torchdist import TorchCommunicator
from mpitrain.comm.base import Communicator
from mpitrain.comm.compose import backend_of
from mpitrain.comm.tracing import Traced, tracer
from mpitrain.fit import fit
from mpitrain.strategies.pipeline.schedule import SCHEDULES, render
from mpitrain.timeline import _clock, _recorder, occupancy
from tests.helpers import assert_all_ranks
from tests.strategies.pipeline.models import MLP, batches

from .trace_checks import problems, row_names, stage_orders, x_events

STEPS, MICRO = 2, 4


@pytest.fixture
def shared_dir(comm: Communicator, tmp_path) -> str:
    """Rank 0's pytest directory, which every rank sees (one host) and pytest prunes."""
    return comm.broadcast_object(str(tmp_path) if comm.rank == 0 else None)


def wrapped(cls: type) -> list[str]:
    return [name for name, fn in vars(cls).items() if callable(fn) and hasattr(fn, "__wrapped__")]


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


@pytest.mark.mpi
@pytest.mark.parametrize("schedule", ["1f1b", "zb1p"])
def test_pipeline_trace_is_valid_nests_follows_the_printed_schedule_and_measures_its_bubble(comm, shared_dir, schedule):
    path = os.path.join(shared_dir, "trace.json")
    torch.manual_seed(0)
    fit(MLP(), batches((12,), 8, STEPS), nn.CrossEntropyLoss(), sgd, strategy="model", partitions=comm.size,
        micro_batches=MICRO, schedule=schedule, progress=False, balance="params", timeline=path)
    verdict: list[str] = []
    if comm.rank == 0:
        with open(path) as f:
            doc = json.load(f)
        verdict += problems(doc)
        orders = stage_orders(doc)
        for stage in range(comm.size):
            want = " ".join([render(SCHEDULES[schedule](comm.size, MICRO, stage))] * STEPS)
            got = " ".join(orders.get(stage, []))
            if got != want:
                verdict.append(f"stage {stage} ran {got!r}, the schedule prints {want!r}")
        names = {e["name"] for e in x_events(doc)}
        for needed in ("step", "optimizer step", "isend", "irecv"):
            if needed not in names:
                verdict.append(f"no {needed!r} event")
        sends = [e for e in x_events(doc) if e["name"] == "isend"]
        if not all(e["args"]["bytes"] > 0 and "peer" in e["args"] for e in sends):
            verdict.append("an isend event lacks bytes or peer")
        rows = set(row_names(doc).values())
        if not {"compute", "comm", "waits"} <= rows:
            verdict.append(f"rows {rows} lack compute/comm/waits")
        if {e["pid"] for e in x_events(doc)} != set(range(comm.size)):
            verdict.append("not every rank has events")
        busy = occupancy(doc, skip=0)  # every step: both have actions (the first also sets up)
        if [o.rank for o in busy] != list(range(comm.size)) or not all(
                o.steps == STEPS and 0 < o.compute_ms <= o.window_ms <= o.step_ms and 0 < o.busy <= 1 for o in busy):
            verdict.append(f"occupancy {busy}")
    assert_all_ranks(comm, not verdict, "; ".join(verdict[:5]))


@pytest.mark.mpi
def test_measured_clock_offset_recovers_a_skewed_clock_within_half_a_round_trip(comm, monkeypatch):
    skew = 5_000_000_000 * comm.rank  # rank r's clock runs r * 5 s ahead
    base = _clock.now
    monkeypatch.setattr(_clock, "now", lambda: base() + skew)
    sync = _clock.measure(comm)
    error = abs(sync.offset_ns + skew)
    assert_all_ranks(comm, error <= sync.rtt_ns / 2 + 1000,
                     f"offset {sync.offset_ns} ns for a skew of {skew} ns (round trip {sync.rtt_ns} ns)")


@pytest.mark.mpi
def test_a_message_is_received_after_it_was_sent_on_the_aligned_clock(comm, shared_dir):
    path = os.path.join(shared_dir, "causal.json")
    timeline.start(path, comm)
    buf = torch.zeros(4, dtype=torch.float64)
    for r in range(1, comm.size):  # a chain 0 -> 1 -> ... : each receive ends after the previous send began
        if comm.rank == r - 1:
            comm.send(buf, r, tag=5)
        elif comm.rank == r:
            comm.recv(buf, r - 1, tag=5)
    timeline.stop()
    verdict = []
    if comm.rank == 0:
        with open(path) as f:
            doc = json.load(f)
        rtt = doc["otherData"]["clock_rtt_us"]
        ev = {(e["pid"], e["name"]): e for e in x_events(doc) if e["name"] in ("send", "recv")}
        for r in range(1, comm.size):
            send, recv = ev[(r - 1, "send")], ev[(r, "recv")]
            slack = (rtt[r - 1] + rtt[r]) / 2 + 1.0
            if recv["ts"] + recv["dur"] < send["ts"] - slack:
                verdict.append(f"rank {r}'s recv ended at {recv['ts'] + recv['dur']} us, before rank {r - 1}'s "
                               f"send began at {send['ts']} us (slack {slack} us)")
            if send["args"] != {"ranks": comm.size, "bytes": 32, "peer": r}:
                verdict.append(f"send args {send['args']}")
    assert_all_ranks(comm, not verdict, "; ".join(verdict))


@pytest.mark.mpi
def test_off_no_tracer_is_set_no_class_is_patched_no_event_is_kept_and_no_file_is_written(comm, shared_dir):
    directory = shared_dir
    classes = (type(comm), type(backend_of(comm)), Traced)  # the outer layer, the backend, the tracing layer
    torch.manual_seed(0)
    fit(MLP(), batches((12,), 4 * comm.size, 1), nn.CrossEntropyLoss(), sgd, strategy="data", progress=False)
    off = [not timeline.active(), _recorder.current is None, tracer() is None, not any(map(wrapped, classes)),
           timeline.span("x") is timeline.span("y"), timeline.stop() is None]
    timeline.start(os.path.join(directory, "t.json"), comm)
    on = [timeline.active(), tracer() is _recorder.current is not None, not any(map(wrapped, classes))]
    timeline.stop()
    after = [not timeline.active(), _recorder.current is None, tracer() is None, not any(map(wrapped, classes))]
    files = os.listdir(directory)
    assert_all_ranks(comm, all(off) and all(on) and all(after) and (comm.rank != 0 or files == ["t.json"]),
                     f"off {off} on {on} after {after} files {files}")


@pytest.mark.mpi
def test_the_world_is_an_instance_of_its_backend_and_its_splits_are_traced_by_composition(comm, shared_dir):
    backend = MPICommunicator if comm.backend == "mpi" else TorchCommunicator
    sub = comm.split(comm.rank % 2, comm.rank)
    assert sub is not None
    kinds = [isinstance(comm, backend), isinstance(sub, backend), type(comm) is Traced, type(sub) is Traced]
    path = os.path.join(shared_dir, "split.json")
    timeline.start(path, comm)
    t = torch.ones(13, dtype=torch.float64)  # 104 bytes: no other call of the job moves as many
    sub.allreduce(t)
    sub.iallreduce(t).wait()
    timeline.stop()
    sub.free()
    verdict = [] if all(kinds) else [f"isinstance/type checks {kinds}"]
    if comm.rank == 0:
        with open(path) as f:
            doc = json.load(f)
        for r in range(comm.size):
            mine = [e for e in x_events(doc) if e["pid"] == r and e["args"].get("bytes") == 104
                    and not e["name"].startswith("wait ")]  # a wait event only where the request was not done
            got, ranks = sorted(e["name"] for e in mine), {e["args"]["ranks"] for e in mine}
            if got != ["allreduce", "iallreduce"] or ranks != {len(range(r % 2, comm.size, 2))}:
                verdict.append(f"rank {r}: the split's events {got} over {ranks} ranks")
    assert_all_ranks(comm, not verdict, "; ".join(verdict))


@pytest.mark.mpi
def test_pipe_sgd_trace_has_the_communication_thread_row_with_one_allreduce_per_step(comm, shared_dir):
    path = os.path.join(shared_dir, "pipesgd.json")
    torch.manual_seed(0)
    fit(MLP(), batches((12,), 4 * comm.size, 3), nn.CrossEntropyLoss(), sgd, strategy="pipe-sgd", progress=False,
        timeline=path)
    verdict: list[str] = []
    if comm.rank == 0:
        with open(path) as f:
            doc = json.load(f)
        verdict += problems(doc)
        names = row_names(doc)
        for rank in range(comm.size):
            rows = {tid for (pid, tid), n in names.items() if pid == rank and n == "mpitrain-pipesgd-comm"}
            reduces = [e for e in x_events(doc) if e["pid"] == rank and e["tid"] in rows and e["name"] == "allreduce"]
            if len(reduces) != 3:
                verdict.append(f"rank {rank}: {len(reduces)} allreduce spans on the comm thread's row, want 3")
    assert_all_ranks(comm, not verdict, "; ".join(verdict[:5]))


@pytest.mark.mpi
def test_data_parallel_trace_nests_and_shows_the_kvstore_threads_allreduces(comm, shared_dir):
    path = os.path.join(shared_dir, "data.json")
    torch.manual_seed(0)
    fit(MLP(), batches((12,), 4 * comm.size, 2), nn.CrossEntropyLoss(), sgd, strategy="data", progress=False,
        timeline=path)
    verdict: list[str] = []
    if comm.rank == 0:
        with open(path) as f:
            doc = json.load(f)
        verdict += problems(doc)
        names = row_names(doc)
        off_main = [e for e in x_events(doc) if "allreduce" in e["name"]
                    and names[(e["pid"], e["tid"])] not in ("compute", "comm", "waits")]
        if {e["pid"] for e in off_main} != set(range(comm.size)):
            verdict.append(f"allreduces off the main thread only on ranks {sorted({e['pid'] for e in off_main})}")
        steps = [e for e in x_events(doc) if e["name"] == "optimizer step"]
        if len(steps) != 2 * comm.size:
            verdict.append(f"{len(steps)} optimizer steps, want {2 * comm.size}")
    assert_all_ranks(comm, not verdict, "; ".join(verdict[:5]))


@pytest.mark.mpi
def test_spatial_trace_shows_halo_exchanges_with_their_waits_nested(comm, shared_dir):
    from mpitrain.spatial.mesh import mesh_batch, mesh_model

    path = os.path.join(shared_dir, "spatial.json")
    torch.manual_seed(0)
    model = mesh_model(in_channels=3, widths=(4, 6), convs_per_block=1)
    data = [mesh_batch(2, 16, in_channels=3, blocks=2, seed=s) for s in range(2)]
    fit(model, data, nn.CrossEntropyLoss(), sgd, strategy="spatial", grid=(comm.size, 1), samples=1,
        progress=False, timeline=path)
    verdict: list[str] = []
    if comm.rank == 0:
        with open(path) as f:
            doc = json.load(f)
        verdict += problems(doc)
        for rank in range(comm.size):
            names = {e["name"] for e in x_events(doc) if e["pid"] == rank}
            missing = {"halo exchange start", "halo exchange finish", "isend", "irecv"} - names
            if missing:
                verdict.append(f"rank {rank} lacks {sorted(missing)}")
    assert_all_ranks(comm, not verdict, "; ".join(verdict[:5]))
