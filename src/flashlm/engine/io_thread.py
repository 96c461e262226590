"""`IOThread`: the one background thread a runtime runs its reads and cache updates on.

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


def _serve(tasks: queue.SimpleQueue) -> None:
    while (task := tasks.get()) is not None:
        future, function, args = task
        try:
            result = function(*args)
        except BaseException as exc:  # delivered to whoever waits on the future
            future.set_exception(exc)
        else:
            future.set_result(result)


_LIVE: weakref.WeakSet[IOThread] = weakref.WeakSet()


@atexit.register
def _stop_live_threads() -> None:
    """Stop every thread before the interpreter finalizes: a daemon thread still inside a torch
    operator then would abort the process ("terminate called without an active exception")."""
    for thread in list(_LIVE):
        thread.shutdown()


class IOThread:
    """A thread that runs submitted tasks one at a time, first in, first out (`submit`, `shutdown`).

    A daemon, so a runtime never closed cannot hold the interpreter open; stopped at exit (and when
    dropped without `shutdown`)."""

    def __init__(self, name: str) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_serve, args=(self._tasks,), name=name, daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._tasks.put, None)
        _LIVE.add(self)

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
