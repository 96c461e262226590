"""`FlashRuntime`: what the streaming MLPs of one model share — the store, its reader, the two
staging buffers that receive a layer's missed units, the down-projection workspace, the budget
plan, the layer-ahead prefetcher and the stats recorder."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from time import perf_counter

import torch

from .cache import BudgetPlan, NeuronCache, make_policy, split_budget
from .config import FlashConfig
from .stats import FlashStats, StatsRecorder
from .store import ALIGNMENT, Store, StoreReader

STREAMED_KIND = "bundle"
READER_BUFFER_CAP = 16 * 2**20
"""Largest reader I/O buffer: bigger reads are served in batches of this size."""


@dataclass(frozen=True)
class Fetch:
    """One layer's missed units, read into a staging buffer: rows[k] is unit ids[k]."""

    layer: int
    ids: torch.Tensor
    rows: torch.Tensor
    buffer: int
    bytes_read: int
    reads: int
    busy_s: float


class FlashRuntime:
    """Owns the reader and the shared buffers; builds each layer's cache from one memory budget.

    The budget covers everything flashlm allocates for streaming: two staging buffers (one
    layer's missed units each, so the next layer's reads land while this layer computes), the
    down-projection workspace, the reader's I/O buffer, and every layer's cache slots and indices.

    Reads run on one background thread (which fans out over the reader's pool), one at a time,
    so counters measured around a read belong to it alone. Once a layer has its rows, the read
    of the next layer's misses starts (`prefetch`), overlapping this layer's compute and the next
    layer's attention; it is valid because a layer's cache changes only in that layer's forward.
    """

    def __init__(self, store: Store, config: FlashConfig) -> None:
        self.store = store
        self.config = config
        row_files = store.row_files(STREAMED_KIND)
        largest = max(f.nbytes for f in row_files.values())
        self.reader = StoreReader(
            {(layer, STREAMED_KIND): f for layer, f in row_files.items()},
            direct_io=config.direct_io,
            threads=config.io_threads,
            chunk_bytes=config.io_chunk_bytes,
            buffer_bytes=min(largest + 2 * ALIGNMENT, READER_BUFFER_CAP),
        )
        first = row_files[0]
        self.num_layers = len(row_files)
        self.width = first.width
        self.max_units = max(f.rows for f in row_files.values())
        self.d_model = store.d_model
        staging_bytes = 2 * self.max_units * first.row_bytes
        workspace_bytes = self.max_units * store.d_model * store.dtype.itemsize
        self.budget_bytes = config.budget.resolve(store.nbytes(STREAMED_KIND))
        self.plan: BudgetPlan = split_budget(
            self.budget_bytes,
            unit_bytes=[f.row_bytes for f in row_files.values()],
            num_units=[f.rows for f in row_files.values()],
            overhead_bytes=staging_bytes + workspace_bytes + self.reader.buffer_bytes,
            policy=config.policy,
        )
        self.staging = [
            torch.empty(self.max_units, first.width, dtype=store.dtype, device="cpu") for _ in range(2)
        ]
        self._workspaces: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.down_workspace(torch.device("cpu"), store.dtype)
        self.caches: dict[int, NeuronCache] = {}
        self._unit_ids = torch.arange(self.max_units)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="flashlm-prefetch")
        self._pending: Future[Fetch] | None = None
        self.stats = StatsRecorder()

    def make_cache(self, layer: int) -> NeuronCache:
        """Layer `layer`'s cache, with the capacity the budget plan gives it (allocated on the CPU)."""
        num_units = self.store.row_file(layer, STREAMED_KIND).rows
        policy = make_policy(self.config.policy, num_units, **self._policy_options())
        cache = NeuronCache(
            num_units,
            self.plan.capacities[layer],
            self.width,
            self.store.dtype,
            policy,
            device=torch.device("cpu"),
        )
        self.caches[layer] = cache
        return cache

    def _policy_options(self) -> dict:
        return {"window": self.config.window} if self.config.policy == "window" else {}

    def down_workspace(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """`[units, d_model]` matrix where a layer's down-projection rows are assembled in unit order.

        One per (device, dtype) the model computes in, allocated on first use and then reused.
        """
        key = (torch.device(device), dtype)
        if key not in self._workspaces:
            self._workspaces[key] = torch.empty(self.max_units, self.d_model, dtype=dtype, device=device)
        return self._workspaces[key]

    def _read(self, layer: int, ids: torch.Tensor, buffer: int) -> Fetch:
        rows = self.staging[buffer][: ids.numel()]
        bytes_before, reads_before = self.reader.bytes_read, self.reader.reads_issued
        started = perf_counter()
        self.reader.read((layer, STREAMED_KIND), ids, rows)
        return Fetch(
            layer,
            ids,
            rows,
            buffer,
            self.reader.bytes_read - bytes_before,
            self.reader.reads_issued - reads_before,
            perf_counter() - started,
        )

    def fetch(self, layer: int, miss_ids: torch.Tensor) -> Fetch:
        """The rows of `miss_ids` in `layer`: the prefetched read if it is that one, else a read now."""
        pending, self._pending = self._pending, None
        if pending is not None:
            fetched = pending.result()
            if fetched.layer == layer and torch.equal(fetched.ids, miss_ids):
                return fetched
            buffer = 1 - fetched.buffer
        else:
            buffer = 0
        return self._submit(layer, miss_ids, buffer).result()

    def prefetch(self, current: Fetch) -> None:
        """Start reading the next layer's misses into the staging buffer `current` does not use."""
        layer = (current.layer + 1) % self.num_layers
        cache = self.caches[layer]
        ids = self._unit_ids[: cache.num_units]
        self._pending = self._submit(layer, ids[cache.slot_of[ids] < 0], 1 - current.buffer)

    def _submit(self, layer: int, ids: torch.Tensor, buffer: int) -> Future[Fetch]:
        """A read on the I/O thread, or, with nothing to read, a finished one without the thread hop."""
        if ids.numel():
            return self._io.submit(self._read, layer, ids, buffer)
        done: Future[Fetch] = Future()
        done.set_result(Fetch(layer, ids, self.staging[buffer][:0], buffer, 0, 0, 0.0))
        return done

    def drain(self) -> None:
        """Wait for and drop an outstanding prefetch (before the caches change outside a forward)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def resident_bytes(self) -> int:
        """Bytes really allocated: caches (slots, indices, policy), staging, workspaces, reader buffer."""
        cache_bytes = sum(
            cache.nbytes + sum(b.numel() * b.element_size() for b in cache.policy.buffers())
            for cache in self.caches.values()
        )
        buffers = [*self.staging, *self._workspaces.values()]
        return cache_bytes + sum(b.numel() * b.element_size() for b in buffers) + self.reader.buffer_bytes

    def snapshot(self) -> FlashStats:
        mode = (
            "direct"
            if self.reader.mode == "direct"
            else f"buffered ({self.reader.fallback_reason or 'asked'})"
        )
        return self.stats.snapshot(
            io_mode=mode, resident_bytes=self.resident_bytes(), budget_bytes=self.budget_bytes
        )

    def close(self) -> None:
        self.drain()
        self._io.shutdown()
        self.reader.close()
