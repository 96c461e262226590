"""`FlashRuntime`: what the streaming MLPs of one model share — the store, its reader, the staging
buffer that receives one layer's misses, the budget plan, and the stats recorder."""

from __future__ import annotations

import torch

from .cache import BudgetPlan, NeuronCache, make_policy, split_budget
from .config import FlashConfig
from .stats import FlashStats, StatsRecorder
from .store import Store, StoreReader

STREAMED_KIND = "bundle"
READER_BUFFER_CAP = 16 * 2**20
"""Largest reader I/O buffer: bigger reads are served in batches of this size."""


class FlashRuntime:
    """Owns the reader and the shared buffers; builds each layer's cache from one memory budget.

    The budget covers everything flashlm allocates for streaming: the staging buffer (one layer's
    worth of missed units), the down-projection workspace, the reader's I/O buffer, and every
    layer's cache slots and indices.
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
            buffer_bytes=min(largest + 2 * 4096, READER_BUFFER_CAP),
        )
        first = row_files[0]
        self.width = first.width
        self.unit_bytes = first.row_bytes
        self.max_units = max(f.rows for f in row_files.values())
        self.d_model = store.d_model
        staging_bytes = self.max_units * first.row_bytes
        workspace_bytes = self.max_units * store.d_model * store.dtype.itemsize
        self.budget_bytes = config.budget.resolve(store.nbytes(STREAMED_KIND))
        self.plan: BudgetPlan = split_budget(
            self.budget_bytes,
            unit_bytes=[f.row_bytes for f in row_files.values()],
            num_units=[f.rows for f in row_files.values()],
            overhead_bytes=staging_bytes + workspace_bytes + self.reader.buffer_bytes,
            policy=config.policy,
        )
        self.staging = torch.empty(self.max_units, first.width, dtype=store.dtype, device="cpu")
        self._workspaces: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.down_workspace(torch.device("cpu"), store.dtype)
        self.stats = StatsRecorder()

    @staticmethod
    def store_key(layer: int) -> tuple[int, str]:
        return (layer, STREAMED_KIND)

    def down_workspace(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """`[units, d_model]` matrix where a layer's down-projection rows are assembled in unit order.

        One per (device, dtype) the model computes in, allocated on first use and then reused.
        """
        key = (torch.device(device), dtype)
        if key not in self._workspaces:
            self._workspaces[key] = torch.empty(self.max_units, self.d_model, dtype=dtype, device=device)
        return self._workspaces[key]

    def make_cache(self, layer: int) -> NeuronCache:
        """Layer `layer`'s cache, with the capacity the budget plan gives it (allocated on the CPU)."""
        num_units = self.store.row_file(layer, STREAMED_KIND).rows
        policy = make_policy(self.config.policy, num_units, **self._policy_options())
        return NeuronCache(
            num_units, self.plan.capacities[layer], self.width, self.store.dtype, policy, device=torch.device("cpu")
        )

    def _policy_options(self) -> dict:
        return {"window": self.config.window} if self.config.policy == "window" else {}

    def resident_bytes(self, caches: list[NeuronCache]) -> int:
        """Bytes really allocated: caches (slots, indices, policy state), staging and reader buffers."""
        cache_bytes = sum(
            cache.nbytes + sum(b.numel() * b.element_size() for b in cache.policy.buffers()) for cache in caches
        )
        buffers = [self.staging, *self._workspaces.values()]
        return cache_bytes + sum(b.numel() * b.element_size() for b in buffers) + self.reader.buffer_bytes

    def snapshot(self, caches: list[NeuronCache]) -> FlashStats:
        mode = "direct" if self.reader.mode == "direct" else f"buffered ({self.reader.fallback_reason or 'asked'})"
        return self.stats.snapshot(
            io_mode=mode, resident_bytes=self.resident_bytes(caches), budget_bytes=self.budget_bytes
        )

    def close(self) -> None:
        self.reader.close()
