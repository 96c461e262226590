"""Endor offloading: every decoder layer's linears mapped to the execution device, to memory or to the SSD
store, moved compressed and decompressed on the execution device just before use (Endor §3.3, §5).

`EndorReplacer` puts the modules in (through `flashlm.patching`'s one create-and-replace walk): layers
mapped to `"device"` keep their `nn.Linear`s (dense weights, loaded by transformers as usual); in the
others every linear becomes an `EndorLinear`, which holds no weight parameter (its bias stays a
parameter). At use, the `EndorRuntime` hands it the layer's compressed matrix — resident in memory
(`"cpu"`), or read with one O_DIRECT request per layer from the store (`"disk"`), the next disk layer's
read running on a background thread while this layer computes — which is moved to the input's device and
decompressed there into a reused workspace.

Every use is timed by phase (read, move, decompress, compute) into the engine's `FlashStats`, one row per
step, layer and linear, with a timeline of when each phase ran (the Endor paper's Figs. 3 and 5).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._utils import format_bytes
from ..arch import decoder_layers
from ..endor.codec import Decompressor, EndorMatrix, decompress
from ..endor.kernel import decompression_path
from ..endor.store import EndorStore, convert_endor, endor_layout, layer_placement
from ..engine.runtime import Runtime
from ..errors import BudgetTooSmallError, StoreMismatchError
from ..ops.linear import linear_in_dtype
from ..store import ModuleSource, SafetensorsSource
from ..store.format import update_content_hash
from ..store.location import open_or_convert
from ..store.reader import aligned_buffer, pin_for_gpu
from ..store.rowfile import whole_blocks
from .base import DenseOnly, MethodModule, Replacer, Target, register_method

if TYPE_CHECKING:
    from ..config import FlashConfig


def largest_linear_bytes(store: EndorStore) -> int:
    """Dense bytes of the store's largest linear: the decompression workspace."""
    return max(
        rows * cols * store.dtype.itemsize
        for layer in store.layers
        for rows, cols in (linear.shape for linear in layer.linears.values())
    )


def working_bytes(store: EndorStore) -> int:
    """What an Endor runtime allocates besides memory-resident layers: two staging buffers of the largest
    compressed layer, the CPU decompression workspace (the largest linear, dense) and the decompressor's
    scratch (an int32 index and a values copy per element of it). The smallest budget it accepts."""
    largest = largest_linear_bytes(store)
    numel = largest // store.dtype.itemsize
    return (
        2 * whole_blocks(max(layer.data_bytes for layer in store.layers))
        + largest
        + numel * 4
        + (numel + 1) * store.dtype.itemsize
    )


@dataclass
class _Loaded:
    layer: int
    matrices: dict[str, EndorMatrix]


class EndorRuntime(Runtime):
    """What the `EndorLinear`s of one model share, beyond every runtime's store, reader, I/O thread and
    stats: the placement, the memory-resident compressed layers, the two staging buffers the disk
    layers are read into, the decompression workspaces.

    The budget covers the resident compressed layers, the two staging buffers (one disk layer each)
    and the CPU decompression workspace (the largest linear, dense).
    """

    def __init__(self, store: EndorStore, config: FlashConfig, *, device_budget: int = 0) -> None:
        self.dtype = store.dtype
        compressed = [layer.data_bytes for layer in store.layers]
        dense = [layer.dense_bytes for layer in store.layers]
        largest_linear = largest_linear_bytes(store)
        budget_bytes = config.budget.resolve(store.dense_nbytes())
        overhead = working_bytes(store)
        if budget_bytes < overhead:
            raise BudgetTooSmallError(
                f"memory_budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) cannot hold "
                f"the staging buffers of one disk layer and the decompression workspace: give at least "
                f"{format_bytes(overhead)} ({overhead} bytes).",
                minimum_bytes=overhead,
            )
        placement = layer_placement(
            compressed, dense, budget=budget_bytes - overhead, device_budget=device_budget
        )
        disk = [index for index, where in enumerate(placement) if where == "disk"]
        super().__init__(
            store, config, {index: store.layers[index].file for index in disk}, "flashlm-endor-io"
        )
        self.budget_bytes = budget_bytes
        self.placement = placement
        self.resident = {
            index: {name: _pinned(m) for name, m in store.load_layer(index).items()}
            for index, where in enumerate(self.placement)
            if where == "cpu"
        }
        self._next_disk = dict(pairwise(disk))
        self._staging: list[torch.Tensor] = []
        if disk:
            largest = whole_blocks(max(compressed[index] for index in disk))
            self._staging = [aligned_buffer(largest) for _ in range(2)]
        self._pending: dict[int, tuple[Future, int]] = {}
        self._loaded: _Loaded | None = None
        self._next_buffer = 0
        self._workspaces: dict[torch.device, torch.Tensor] = {
            torch.device("cpu"): torch.empty(largest_linear // store.dtype.itemsize, dtype=store.dtype)
        }
        self._largest_linear_numel = largest_linear // store.dtype.itemsize
        self._decompressors: dict[torch.device, Decompressor] = {}
        self._resident_bytes = (
            sum(compressed[index] for index in self.resident)
            + sum(buffer.numel() for buffer in self._staging)
            + largest_linear
            + self._decompressor(torch.device("cpu")).nbytes
        )
        self.linear_names = sorted({name for layer in store.layers for name in layer.linears})
        self._linear_index = {name: i for i, name in enumerate(self.linear_names)}
        self._tokens = 0
        self._last_layer = None

    def resident_bytes(self) -> int:
        return self._resident_bytes

    def begin_use(self, layer: int, tokens: int) -> None:
        """Called by each linear before it asks for its weight: a layer below the last one starts a step."""
        if self._last_layer is None or layer < self._last_layer:
            self.stats.begin_step()
            self._tokens = tokens
            self._loaded = None  # a disk layer is read again every step: staging is not a cache
        self._last_layer = layer

    def _read(self, layer: int, buffer: int) -> tuple[torch.Tensor, int, int, float, float]:
        """On the I/O thread: layer `layer`'s data region into staging buffer `buffer`; returns it, the
        bytes and requests read, and when the read started and ended."""
        started = perf_counter()
        done = self.reader.read_all(layer, self._staging[buffer])
        data = self._staging[buffer][: self.store.layers[layer].data_bytes]
        return data, done.bytes_read, done.reads, started, perf_counter()

    def _submit(self, layer: int) -> tuple[Future, int]:
        buffer = self._next_buffer
        self._next_buffer = 1 - buffer
        return self._io.submit(self._read, layer, buffer), buffer

    def compressed(self, layer: int, linear: str) -> tuple[EndorMatrix, float, int, int]:
        """Layer `layer`'s compressed `linear`, the seconds spent waiting for it, and the bytes and requests
        read for it."""
        if layer in self.resident:
            return self.resident[layer][linear], 0.0, 0, 0
        if self._loaded is not None and self._loaded.layer == layer:
            return self._loaded.matrices[linear], 0.0, 0, 0
        pending = self._pending.pop(layer, None) or self._submit(layer)
        waited = perf_counter()
        data, nbytes, reads, started, ended = pending[0].result()
        now = perf_counter()
        self.stats.events.append(("read", layer, -1, started, ended))
        entry = self.store.layers[layer]
        self._loaded = _Loaded(
            layer, {name: lin.matrix(data, self.dtype) for name, lin in entry.linears.items()}
        )
        if (following := self._next_disk.get(layer)) is not None:
            self._pending[following] = self._submit(following)
        return self._loaded.matrices[linear], now - waited, nbytes, reads

    def weight(self, layer: int, linear: str, device: torch.device) -> torch.Tensor:
        """The dense weight of `linear` in layer `layer`, decompressed on `device` into a reused workspace.

        Valid until the next call: the caller uses it at once."""
        matrix, read_s, nbytes, reads = self.compressed(layer, linear)
        t0 = perf_counter()
        moved = matrix.to(device, non_blocking=True) if matrix.device != device else matrix
        t1 = perf_counter()
        rows, cols = matrix.shape
        out = self._workspace(device)[: rows * cols].view(rows, cols)
        self._decompressor(device)(moved, out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t2 = perf_counter()
        index = self._linear_index[linear]
        if moved is not matrix:
            self.stats.events.append(("move", layer, index, t0, t1))
        self.stats.events.append(("decompress", layer, index, t1, t2))
        dense = self._tokens * rows * cols * self.dtype.itemsize
        self._row = {
            "tokens": self._tokens,
            "bytes_read": nbytes,
            "reads": reads,
            "used_bytes": dense,  # lossless: every weight of the (pruned) model is used
            "dense_bytes": dense,
            "moved_bytes": matrix.nbytes if moved is not matrix else 0,
            "io_s": read_s,
            "move_s": t1 - t0 if moved is not matrix else 0.0,
            "decompress_s": t2 - t1,
        }
        return out

    def record_compute(self, layer: int, linear: str, started: float, ended: float) -> None:
        """Close the row `weight` opened with the linear's compute time."""
        self.stats.events.append(("compute", layer, self._linear_index[linear], started, ended))
        self.stats.record(layer, **self._row, compute_s=ended - started)

    def _workspace(self, device: torch.device) -> torch.Tensor:
        if device not in self._workspaces:
            self._workspaces[device] = torch.empty(
                self._largest_linear_numel, dtype=self.dtype, device=device
            )
        return self._workspaces[device]

    def _decompressor(self, device: torch.device) -> Decompressor:
        if device not in self._decompressors:
            self._decompressors[device] = Decompressor(self._largest_linear_numel, self.dtype, device)
        return self._decompressors[device]

    def _snapshot_details(self) -> dict[str, Any]:
        paths = (
            decompression_path() if device.type == "cpu" else f"torch ops on {device}"
            for device in self._decompressors
        )
        return {"placement": tuple(self.placement), "decompression": ", ".join(paths) or "none yet"}

    def reset_stats(self) -> None:
        super().reset_stats()
        self._last_layer = None

    def drain(self) -> None:
        for pending, _ in self._pending.values():
            pending.result()
        self._pending.clear()


def _pinned(matrix: EndorMatrix) -> EndorMatrix:
    """`matrix` in pinned host memory where a GPU may copy from it asynchronously, else as it is."""
    if not pin_for_gpu():
        return matrix
    return EndorMatrix(
        bitmap=matrix.bitmap.pin_memory(), values=matrix.values.pin_memory(), shape=matrix.shape
    )


class EndorReplacer(Replacer):
    """Puts an `EndorLinear` in the place of every linear of every decoder layer not mapped to the
    execution device, reading the Endor store (`.endor`)."""

    def open_store(
        self, model: nn.Module, config: FlashConfig, checkpoint_dir: Path | None, *, progress: bool = True
    ) -> EndorStore:
        source = SafetensorsSource(checkpoint_dir) if checkpoint_dir is not None else ModuleSource(model)
        fingerprint = source.fingerprint()
        name = source.path or getattr(model.config, "_name_or_path", "") or type(model).__name__
        key = fingerprint or _decoder_weights_sha256(source, model)
        store = open_or_convert(
            config.store,
            str(name),
            key,
            ".endor",
            lambda path: convert_endor(source, path, endor_layout(model), progress=progress),
            EndorStore.open,
        )
        store.check_matches(model_type=source.model_type, fingerprint=fingerprint)
        if fingerprint is None and store.content_sha256 != key:
            raise StoreMismatchError(
                f"The Endor store {store.path} was compressed from other weights than this model's. "
                "Delete it or pass another `store=` path."
            )
        return store

    def prepare(
        self, model: nn.Module, store: EndorStore, config: FlashConfig
    ) -> tuple[EndorRuntime, list[Target]]:
        layers = decoder_layers(model)
        mismatched = [
            name
            for (index, name, _), entry in zip(layers, store.layers, strict=False)
            if entry.prefix != name or entry.index != index
        ]
        if len(layers) != store.num_layers or mismatched:
            raise StoreMismatchError(
                f"The Endor store {store.path} holds {store.num_layers} layers "
                f"({store.layers[0].prefix}, ...), the model has {len(layers)} ({layers[0][1]}, ...)"
                f"{'; first mismatch: ' + mismatched[0] if mismatched else ''}. "
                "Convert the store from this model."
            )
        with torch.device("cpu"):  # transformers builds the model under a meta-device context
            runtime = EndorRuntime(
                store, config, device_budget=config.device_budget_bytes(store.dense_nbytes())
            )
        targets = []
        for (index, prefix, layer), entry in zip(layers, store.layers, strict=True):
            if runtime.placement[index] == "device":
                continue
            for name, linear in entry.linears.items():
                old = layer.get_submodule(name)
                if not isinstance(old, nn.Linear) or (old.out_features, old.in_features) != linear.shape:
                    raise StoreMismatchError(
                        f"{prefix}.{name} is not a [{linear.shape[0]}, {linear.shape[1]}] linear as in the "
                        f"Endor store {store.path}. Convert the store from this model."
                    )
                released = (f"{prefix}.{name}.weight",)
                targets.append(Target(f"{prefix}.{name}", index, old, released, details={"linear": name}))
        return runtime, targets

    def create(self, runtime: EndorRuntime, target: Target) -> EndorLinear:
        old = target.module
        return EndorLinear(
            target.layer, target.details["linear"], old.in_features, old.out_features, old.bias, runtime
        )

    def dense_weights(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Each `EndorLinear`'s weight, decompressed (each layer's file read once)."""
        layers: dict[int, dict] = {}
        weights = {}
        for name, module in model.named_modules():
            if isinstance(module, EndorLinear):
                if module.layer not in layers:
                    layers[module.layer] = module.runtime.store.load_layer(module.layer)
                weights[f"{name}.weight"] = decompress(layers[module.layer][module.name])
        return weights

    def restore(self, model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
        for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, EndorLinear)]:
            linear = nn.Linear(
                module.in_features, module.out_features, bias=module.bias is not None, device="meta"
            )
            linear.weight = nn.Parameter(weights[f"{name}.weight"], requires_grad=False)
            linear.bias = module.bias
            model.set_submodule(name, linear)


def _decoder_weights_sha256(source: ModuleSource, model: nn.Module) -> str:
    """sha256 of the decoder linears' weights in layout order, as `convert_endor` records it."""
    digest = hashlib.sha256()
    for prefix, names in endor_layout(model):
        for name in names:
            update_content_hash(digest, {name: source.get(f"{prefix}.{name}.weight").contiguous()})
    return digest.hexdigest()


@register_method("endor")
class EndorLinear(DenseOnly, MethodModule):
    """A linear whose weight lives compressed in an `EndorRuntime`; it has no weight parameter."""

    OPTIONS = ("device_budget",)
    replacer = EndorReplacer()

    def __init__(
        self,
        layer: int,
        name: str,
        in_features: int,
        out_features: int,
        bias: nn.Parameter | None,
        runtime: EndorRuntime,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.name = name
        self.in_features = in_features
        self.out_features = out_features
        self.bias = bias
        self.runtime = runtime

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        runtime = self.runtime
        runtime.begin_use(self.layer, x.numel() // x.shape[-1])
        weight = runtime.weight(self.layer, self.name, x.device)
        started = perf_counter()
        out = linear_in_dtype(x, weight, self.bias)
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        runtime.record_compute(self.layer, self.name, started, perf_counter())
        return out

    def extra_repr(self) -> str:
        where = self.runtime.placement[self.layer]
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, on={where}"
        )


def endor_linears(model: nn.Module) -> list[EndorLinear]:
    return [module for module in model.modules() if isinstance(module, EndorLinear)]
