"""IOThread: first in, first out, errors delivered to the waiter, stopped by shutdown and when dropped."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
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


def test_a_dropped_thread_still_busy_at_exit_does_not_abort_the_interpreter() -> None:
    # The thread is inside a torch operator, GIL released, when the interpreter finalizes: it must have
    # been joined by then, or re-taking the GIL ends it by an unwind that C++ turns into abort().
    code = textwrap.dedent(
        """
        import torch
        from flashlm.engine.io_thread import IOThread

        def busy(a):
            for _ in range(200):
                a = a @ a
                a = a / a.norm()
            return a

        io = IOThread("test-io")
        io.submit(busy, torch.randn(256, 256))
        del io
        """
    )
    for _ in range(3):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
