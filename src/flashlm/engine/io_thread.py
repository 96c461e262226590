"""`IOThread`: the one background Python thread of a runtime: its large cache updates, and its reads where
the reader's C pool cannot take them (no C compiler, or behind a queued update).

A `ThreadPoolExecutor(1)` does the same, but its `submit` costs the decode thread ~13 us (locks,
thread-count bookkeeping) where a future and a queue cost ~6; a decode step of a small model submits
a few tasks per layer, so the difference is a tenth of a millisecond per token on SmolLM2-135M.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..store.reader import sleep_while_reading


def _serve(tasks: queue.SimpleQueue) -> None:
    sleep_while_reading()  # nothing computes while this thread waits for a read: it leaves the cores free
    while (task := tasks.get()) is not None:
        _run(*task)
        del task  # free the task's tensors now, not when the next task arrives


def _run(future: Future, function: Callable[..., Any], args: tuple) -> None:
    try:
        result = function(*args)
    except BaseException as exc:  # delivered to whoever waits on the future
        future.set_exception(exc)
    else:
        future.set_result(result)


_RUNNING: weakref.WeakKeyDictionary[threading.Thread, queue.SimpleQueue] = weakref.WeakKeyDictionary()
"""The thread of every IOThread, with its task queue. A running thread stays here (`threading` holds it)
after its IOThread was dropped without `shutdown`, while it finishes the tasks queued before."""


@atexit.register
def _stop_running_threads() -> None:
    """Stop and join every thread before the interpreter finalizes: a daemon thread still inside a torch
    operator then would abort the process ("terminate called without an active exception")."""
    for thread, tasks in list(_RUNNING.items()):
        tasks.put(None)
        thread.join()


class IOThread:
    """A thread that runs submitted tasks one at a time, first in, first out (`submit`, `shutdown`).

    A daemon, so a runtime never closed cannot hold the interpreter open; stopped at exit (and when
    dropped without `shutdown`)."""

    def __init__(self, name: str) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_serve, args=(self._tasks,), name=name, daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._tasks.put, None)
        _RUNNING[self._thread] = self._tasks

    def submit(self, function: Callable[..., Any], *args: Any) -> Future:
        """Run `function(*args)` after every task submitted before it; its result or error lands in the
        returned future."""
        future: Future = Future()
        self._tasks.put((future, function, args))
        return future

    def shutdown(self) -> None:
        """Let the queued tasks finish, then stop the thread."""
        self._finalizer()
        if self._thread is not threading.current_thread():
            self._thread.join()
