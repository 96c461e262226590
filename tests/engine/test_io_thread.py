"""IOThread: first in, first out, errors delivered to the waiter, stopped by shutdown and when dropped."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from flashlm.engine.io_thread import IOThread


def test_tasks_run_in_order_on_one_thread() -> None:
    io = IOThread("test-io")
    ran: list[tuple[int, str]] = []

    def task(i: int) -> int:
        time.sleep(0.001 * (i % 3))  # uneven lengths: order must not depend on them
        ran.append((i, threading.current_thread().name))
        return i * i

    futures = [io.submit(task, i) for i in range(20)]
    assert [f.result(timeout=10) for f in futures] == [i * i for i in range(20)]
    assert [i for i, _ in ran] == list(range(20))
    assert {name for _, name in ran} == {"test-io"}
    io.shutdown()


def test_an_error_reaches_the_waiter_and_later_tasks_still_run() -> None:
    io = IOThread("test-io")

    def fail() -> None:
        raise ValueError("boom")

    failed, after = io.submit(fail), io.submit(lambda: 7)
    with pytest.raises(ValueError, match="boom"):
        failed.result(timeout=10)
    assert after.result(timeout=10) == 7
    io.shutdown()


def test_shutdown_finishes_queued_tasks_then_stops() -> None:
    io = IOThread("test-io")
    gate = threading.Event()
    first = io.submit(gate.wait, 10)
    second = io.submit(lambda: "done")
    gate.set()
    io.shutdown()
    assert first.done() and second.result() == "done"
    assert not io._thread.is_alive()


def test_a_dropped_thread_stops() -> None:
    io = IOThread("test-io")
    thread = io._thread
    del io
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()
