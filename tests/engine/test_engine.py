"""Dependency engine: hazards kept, independence exploited, errors re-raised, stress vs sequential."""

from __future__ import annotations

import random
import threading
import time

import pytest

from mpitrain.engine import Engine, EngineError, Var


@pytest.fixture
def eng():
    e = Engine({"compute": 4, "comm": 2}, warn_after=30)
    yield e
    e.close()


def test_read_after_write_sees_the_write(eng):
    a, b, box = Var("a"), Var("b"), {"a": 0}
    eng.push(lambda: (time.sleep(0.05), box.__setitem__("a", 1)), mutates=[a])
    eng.push(lambda: box.__setitem__("b", box["a"] + 1), reads=[a], mutates=[b])
    eng.wait(b)
    assert box["b"] == 2


def test_write_after_read_waits_for_the_readers(eng):
    a, log = Var("a"), []
    for i in range(3):
        eng.push(lambda i=i: (time.sleep(0.03), log.append(("r", i))), reads=[a])
    eng.push(lambda: log.append(("w", 0)), mutates=[a])
    eng.wait(a)
    assert log[-1] == ("w", 0) and len(log) == 4


def test_writes_run_one_at_a_time_in_push_order(eng):
    a, log, running = Var("a"), [], []

    def write(i):
        running.append(i)
        assert len(running) == 1, "two writers at once"
        time.sleep(random.random() * 0.005)
        log.append(i)
        running.pop()

    for i in range(50):
        eng.push(lambda i=i: write(i), mutates=[a], pool=random.choice(["compute", "comm"]))
    eng.wait(a)
    assert log == list(range(50))


def test_reads_of_one_variable_run_concurrently(eng):
    a, barrier = Var("a"), threading.Barrier(3, timeout=5)
    tasks = [eng.push(barrier.wait, reads=[a]) for _ in range(3)]  # deadlocks unless concurrent
    eng.wait_all()
    assert all(t.error is None for t in tasks)


def test_independent_variables_do_not_wait_for_each_other(eng):
    a, b, gate = Var("a"), Var("b"), threading.Event()
    eng.push(lambda: gate.wait(5), mutates=[a])
    eng.push(gate.set, mutates=[b])  # would never run if it queued behind a's task
    eng.wait(b)
    eng.wait(a)
    assert gate.is_set()


def test_comm_pool_runs_while_compute_pool_is_busy():
    eng = Engine({"compute": 1, "comm": 1})
    gate = threading.Event()
    eng.push(lambda: gate.wait(5), mutates=[Var()], pool="compute")
    eng.push(gate.set, mutates=[Var()], pool="comm")
    eng.wait_all(timeout=10)
    eng.close()
    assert gate.is_set()


def test_exception_is_reraised_to_waiter_of_mutated_var_and_poisons_dependents(eng):
    a, b, ran = Var("a"), Var("b"), []

    def boom():
        raise ValueError("task failed on purpose")

    eng.push(boom, mutates=[a])
    eng.push(lambda: ran.append(1), reads=[a], mutates=[b])
    with pytest.raises(ValueError, match="on purpose"):
        eng.wait(b)
    with pytest.raises(ValueError, match="on purpose"):
        eng.wait(a)
    assert ran == []
    eng.wait(a)  # the error was delivered once; the variable is usable again
    eng.push(lambda: ran.append(2), mutates=[a])
    eng.wait(a)
    assert ran == [2]


def test_wait_all_reraises(eng):
    eng.push(lambda: 1 / 0, mutates=[Var()])
    with pytest.raises(ZeroDivisionError):
        eng.wait_all()


def test_wait_timeout_names_the_variable(eng):
    a, gate = Var("slowvar"), threading.Event()
    eng.push(lambda: gate.wait(5), mutates=[a])
    with pytest.raises(EngineError, match="slowvar"):
        eng.wait(a, timeout=0.2)
    gate.set()
    eng.wait(a)


def test_unknown_pool_is_refused(eng):
    with pytest.raises(EngineError, match="unknown pool"):
        eng.push(lambda: None, pool="gpu")


def test_stress_random_dependencies_match_sequential_execution():
    rng = random.Random(1234)
    nvars, ntasks = 12, 3000
    ops = []
    for _ in range(ntasks):
        reads = rng.sample(range(nvars), rng.randint(0, 3))
        writes = rng.sample([v for v in range(nvars) if v not in reads], rng.randint(1, 2))
        ops.append((reads, writes, rng.randint(1, 97)))

    def apply(state, reads, writes, c):
        acc = sum(state[r] for r in reads) + c
        for w in writes:
            state[w] = (state[w] * 31 + acc) % 1_000_003

    expected = [0] * nvars
    for op in ops:
        apply(expected, *op)

    eng = Engine({"compute": 4, "comm": 3})
    state, vars_ = [0] * nvars, [Var(f"v{i}") for i in range(nvars)]
    for reads, writes, c in ops:
        eng.push(lambda r=reads, w=writes, c=c: apply(state, r, w, c), reads=[vars_[i] for i in reads],
                 mutates=[vars_[i] for i in writes], pool=rng.choice(["compute", "comm"]))
    eng.wait_all(timeout=60)
    eng.close()
    assert state == expected


def test_a_long_wait_warns_naming_the_variable_and_pending_tasks(caplog):
    eng = Engine({"compute": 1}, warn_after=0.1)
    a, gate = Var("slowvar"), threading.Event()
    eng.push(lambda: gate.wait(5), mutates=[a], name="blocker")
    threading.Timer(0.35, gate.set).start()
    with caplog.at_level("WARNING", logger="mpitrain.engine"):
        eng.wait(a)
    eng.close()
    assert "slowvar" in caplog.text and "blocker" in caplog.text


def test_a_helping_waiter_runs_queued_pool_tasks_itself_while_the_pool_thread_is_busy():
    eng = Engine({"comm": 1}, warn_after=30)
    busy, gate, mine = Var("busy"), threading.Event(), Var("mine")
    ran_on = []
    eng.push(lambda: gate.wait(10), mutates=[busy], pool="comm", name="occupies the only thread")
    time.sleep(0.05)
    for i in range(3):
        eng.push(lambda i=i: ran_on.append((i, threading.current_thread().name)), mutates=[mine], pool="comm")
    eng.wait(mine, timeout=5, help="comm")  # would time out without helping: the pool thread is blocked
    gate.set()
    eng.close()
    assert ran_on == [(i, threading.main_thread().name) for i in range(3)]


def test_helping_keeps_write_order_and_one_writer_at_a_time():
    eng = Engine({"comm": 2}, warn_after=30)
    a, log, running = Var("a"), [], []

    def write(i):
        running.append(i)
        assert len(running) == 1, "two writers at once"
        time.sleep(random.random() * 0.002)
        log.append(i)
        running.pop()

    for i in range(60):
        eng.push(lambda i=i: write(i), mutates=[a], pool="comm")
    eng.wait(a, help="comm")
    eng.wait_all()
    eng.close()
    assert log == list(range(60))


def test_help_with_an_unknown_pool_is_refused_before_anything_is_queued(eng):
    a = Var("a")
    with pytest.raises(EngineError, match="unknown pool"):
        eng.wait(a, help="nope")
