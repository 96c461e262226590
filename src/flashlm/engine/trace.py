"""Traces of the units each layer needed at each decode step, for offline cache studies.

A `TraceRecorder` is fed on the decode hot path: one `record(step, layer, kind, ids)` per layer,
unit kind and step, which only queues a CPU int32 copy of the ids. `finish` turns what it holds
into a `Trace`: steps renumbered `0 .. n-1`, every step's ids sorted and unique, stored per
(layer, kind) as one int32 vector of ids plus int64 offsets (CSR), so a trace of a long
generation stays a handful of tensors. A trace is saved as one safetensors file and replayed
through the cache policies by `flashlm.sim.replay`, Belady's oracle included (DIP §5.1, §6.4).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import FlashLMError

TRACE_FORMAT = "flashlm-trace"
TRACE_VERSION = 1
ID_DTYPE = torch.int32
OFFSET_DTYPE = torch.int64


class TraceError(FlashLMError, ValueError):
    """A trace file is not a flashlm trace, or is damaged; or a recording cannot become a trace."""


def _tensor_name(layer: int, kind: str, field: str) -> str:
    return f"{field}/{layer}/{kind}"


class TraceRecorder:
    """Collects, step by step, the unit ids each layer needed for each unit kind.

    `record` is cheap: a dict lookup, a list append and a device-to-host copy of the ids as int32
    (asynchronous from CUDA; `finish` waits for it). Everything else happens in `finish`.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget everything recorded."""
        self._records: defaultdict[tuple[int, str], list[tuple[int, torch.Tensor]]] = defaultdict(list)
        self._cuda = False

    def __len__(self) -> int:
        """Number of `record` calls held."""
        return sum(len(entries) for entries in self._records.values())

    def record(self, step: int, layer: int, kind: str, ids: torch.Tensor) -> None:
        """Note that decode step `step` needed the units `ids` (1-D int ids) of `kind` in `layer`.

        Recording the same (step, layer, kind) twice stores the union.
        """
        if ids.is_cuda:
            self._cuda = True
            copy = ids.detach().to(ID_DTYPE).to("cpu", non_blocking=True)
        else:
            copy = ids.detach().to(dtype=ID_DTYPE, copy=True)
        self._records[(layer, kind)].append((step, copy))

    def finish(
        self,
        *,
        num_layers: int,
        num_units: dict[str, int],
        unit_bytes: dict[str, int],
        metadata: dict[str, Any] | None = None,
    ) -> Trace:
        """The `Trace` of what was recorded (the recorder keeps it: `reset` to start over).

        `num_units[kind]` and `unit_bytes[kind]` describe each unit kind; their keys are the trace's
        kinds (a kind with nothing recorded is kept, with empty requests). `metadata` is any
        JSON-able dict (model, method, density, ...). Raises `TraceError` if a record names a layer
        or kind outside these, or a unit id out of range.
        """
        if self._cuda:
            torch.cuda.synchronize()
        if set(num_units) != set(unit_bytes):
            raise TraceError(
                f"num_units and unit_bytes must name the same unit kinds, got {sorted(num_units)} "
                f"and {sorted(unit_bytes)}."
            )
        for layer, kind in self._records:
            if kind not in num_units:
                raise TraceError(f"Recorded unit kind {kind!r} is not in num_units ({sorted(num_units)}).")
            if not 0 <= layer < num_layers:
                raise TraceError(f"Recorded layer {layer} is outside 0..{num_layers - 1}.")
        steps = sorted({step for entries in self._records.values() for step, _ in entries})
        renumber = {step: i for i, step in enumerate(steps)}
        data: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(num_layers):
            for kind in num_units:
                per_step: list[list[torch.Tensor]] = [[] for _ in steps]
                for step, ids in self._records.get((layer, kind), ()):
                    per_step[renumber[step]].append(ids.reshape(-1))
                sets = [_unique(parts) for parts in per_step]
                ids = torch.cat(sets) if sets else torch.empty(0, dtype=ID_DTYPE)
                if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_units[kind]):
                    raise TraceError(
                        f"Layer {layer}, kind {kind!r}: unit ids must be in 0..{num_units[kind] - 1}, "
                        f"got min {int(ids.min())}, max {int(ids.max())}."
                    )
                data[(layer, kind)] = (ids, _offsets([s.numel() for s in sets]))
        return Trace(
            num_layers=num_layers,
            num_units=num_units,
            unit_bytes=unit_bytes,
            data=data,
            num_steps=len(steps),
            metadata=metadata,
        )


def _unique(parts: list[torch.Tensor]) -> torch.Tensor:
    if not parts:
        return torch.empty(0, dtype=ID_DTYPE)
    ids = parts[0] if len(parts) == 1 else torch.cat(parts)
    return torch.unique(ids, sorted=True).to(ID_DTYPE)


def _offsets(counts: list[int]) -> torch.Tensor:
    offsets = torch.zeros(len(counts) + 1, dtype=OFFSET_DTYPE)
    if counts:
        offsets[1:] = torch.cumsum(torch.tensor(counts, dtype=OFFSET_DTYPE), 0)
    return offsets


class Trace:
    """The units each (layer, kind) needed at each step of one generation; read-only.

    Attributes:
        kinds: unit kinds, in the order given to `finish`.
        num_layers: layers `0 .. num_layers-1`.
        num_steps: recorded decode steps, numbered `0 .. num_steps-1`.
        num_units: units per layer of each kind.
        unit_bytes: bytes one unit of each kind reads from flash.
        metadata: free JSON-able description (model, method, density, ...).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_units: dict[str, int],
        unit_bytes: dict[str, int],
        data: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]],
        num_steps: int,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self._num_layers = int(num_layers)
        self._num_units = {str(k): int(v) for k, v in num_units.items()}
        self._unit_bytes = {k: int(unit_bytes[k]) for k in self._num_units}
        self._num_steps = int(num_steps)
        self._metadata = json.loads(json.dumps(metadata or {}))  # a private, JSON-checked copy
        self._data = data

    # ---- description ------------------------------------------------------------------------

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self._num_units)

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def num_steps(self) -> int:
        return self._num_steps

    @property
    def num_units(self) -> dict[str, int]:
        return dict(self._num_units)

    @property
    def unit_bytes(self) -> dict[str, int]:
        return dict(self._unit_bytes)

    @property
    def metadata(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._metadata))

    def layer_kinds(self) -> list[tuple[int, str]]:
        """Every (layer, kind) pair, layer-major."""
        return [(layer, kind) for layer in range(self._num_layers) for kind in self._num_units]

    # ---- content ----------------------------------------------------------------------------

    def _entry(self, layer: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self._data[(layer, kind)]
        except KeyError:
            raise KeyError(
                f"No (layer, kind) = ({layer}, {kind!r}) in this trace: layers 0..{self._num_layers - 1}, "
                f"kinds {list(self._num_units)}."
            ) from None

    def requests(self, layer: int, kind: str) -> list[torch.Tensor]:
        """The sorted unique int32 unit ids of `kind` that `layer` needed, one tensor per step.

        A step where that layer and kind recorded nothing has an empty tensor. The tensors are
        views of the trace's storage: do not modify them.
        """
        ids, offsets = self._entry(layer, kind)
        return list(torch.split(ids, torch.diff(offsets).tolist())) if self._num_steps else []

    def frequencies(self, layer: int, kind: str) -> torch.Tensor:
        """The share of steps that needed each unit of `kind` in `layer` (float32 `[num_units]`)."""
        ids, _ = self._entry(layer, kind)
        counts = torch.bincount(ids.long(), minlength=self._num_units[kind])
        return counts.float() / max(self._num_steps, 1)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        return (
            self._num_layers == other._num_layers
            and self._num_steps == other._num_steps
            and list(self._num_units.items()) == list(other._num_units.items())
            and self._unit_bytes == other._unit_bytes
            and self._metadata == other._metadata
            and self._data.keys() == other._data.keys()
            and all(
                torch.equal(a, b)
                for key in self._data
                for a, b in zip(self._data[key], other._data[key], strict=True)
            )
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"Trace(num_layers={self._num_layers}, num_steps={self._num_steps}, "
            f"num_units={self._num_units}, unit_bytes={self._unit_bytes}, metadata={self._metadata})"
        )

    # ---- files ------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the trace to `path` as one safetensors file (atomically: temp file, then rename)."""
        path = Path(path)
        tensors: dict[str, torch.Tensor] = {}
        for layer, kind in self.layer_kinds():
            ids, offsets = self._data[(layer, kind)]
            tensors[_tensor_name(layer, kind, "ids")] = ids.contiguous()
            tensors[_tensor_name(layer, kind, "offsets")] = offsets.contiguous()
        header = {
            "num_layers": self._num_layers,
            "num_steps": self._num_steps,
            "kinds": list(self._num_units),
            "num_units": self._num_units,
            "unit_bytes": self._unit_bytes,
            "metadata": self._metadata,
        }
        meta = {"format": TRACE_FORMAT, "version": str(TRACE_VERSION), "trace": json.dumps(header)}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            save_file(tensors, str(tmp), metadata=meta)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        """Read a trace written by `save`.

        Raises `FileNotFoundError` if `path` does not exist, and `TraceError` (a `FlashLMError` and
        a `ValueError`) if it is not a flashlm trace or is damaged.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No trace file at {path}.")
        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = handle.metadata() or {}
                if meta.get("format") != TRACE_FORMAT:
                    raise TraceError(
                        f"{path} is a safetensors file but not a flashlm trace (no "
                        f"format={TRACE_FORMAT!r} in its metadata)."
                    )
                if meta.get("version") != str(TRACE_VERSION):
                    raise TraceError(
                        f"{path} is a flashlm trace of version {meta.get('version')!r}; this flashlm "
                        f"reads version {TRACE_VERSION}."
                    )
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        except TraceError:
            raise
        except (SafetensorError, OSError, ValueError) as exc:
            raise TraceError(
                f"{path} is not a flashlm trace: it cannot be read as safetensors ({exc})."
            ) from exc
        try:
            header = json.loads(meta["trace"])
            num_layers = int(header["num_layers"])
            num_steps = int(header["num_steps"])
            kinds = [str(k) for k in header["kinds"]]
            num_units = {k: int(header["num_units"][k]) for k in kinds}
            unit_bytes = {k: int(header["unit_bytes"][k]) for k in kinds}
            metadata = header.get("metadata", {})
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{path}: the flashlm trace header is damaged ({exc!r}).") from exc

        data: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(num_layers):
            for kind in kinds:
                where = f"{path}: layer {layer}, kind {kind!r}"
                try:
                    ids = tensors[_tensor_name(layer, kind, "ids")]
                    offsets = tensors[_tensor_name(layer, kind, "offsets")]
                except KeyError:
                    raise TraceError(f"{where}: the ids or offsets tensor is missing.") from None
                if ids.dtype != ID_DTYPE or offsets.dtype != OFFSET_DTYPE or ids.dim() != 1:
                    raise TraceError(f"{where}: tensors have the wrong dtype or shape.")
                if offsets.shape != (num_steps + 1,):
                    raise TraceError(f"{where}: {offsets.numel()} offsets for {num_steps} steps.")
                counts = torch.diff(offsets)
                if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel() or bool((counts < 0).any()):
                    raise TraceError(f"{where}: offsets do not partition the {ids.numel()} ids.")
                if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_units[kind]):
                    raise TraceError(f"{where}: unit ids outside 0..{num_units[kind] - 1}.")
                data[(layer, kind)] = (ids, offsets)
        return cls(
            num_layers=num_layers,
            num_units=num_units,
            unit_bytes=unit_bytes,
            data=data,
            num_steps=num_steps,
            metadata=metadata,
        )
