"""Training data for activation predictors: each MLP's input and which of its neurons fired.

A predictor learns, from the MLP input x, which intermediate neurons a token needs (LLM in a flash
§3.1 and appendix B; PowerInfer §5.1). The labels come from running the dense model on text:

- the MLP input x is what the first input projection (`gate`/`up`/`gate_up`/`fc1`) receives;
- the intermediate vector h is what the down projection receives: `act(gate x) * up x` for a gated
  MLP, `act(up x + b)` for a plain one. Neuron j's bundle (gate row j, up row j, down column j) is
  needed exactly when h_j is not negligible, so the label is a rule on |h| (`LabelRule`): above a
  threshold (0 for ReLU / FATReLU models: "exactly nonzero"), or among the top fraction of the
  token's |h| (SwiGLU, where nothing is exactly zero and the method's density decides).

Hooks sit on the projections rather than on the MLP owner because the owner's input is not the MLP
input in every family (OPT's owner is the whole decoder layer). Memory is bounded: each layer keeps
at most `max_rows` token rows, a uniform sample of all rows seen (every row draws a random key; the
rows with the smallest keys are kept), while the per-neuron activation counts are exact over every
row, so the offline profile (`activation_frequency`) is not subsampled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from .._utils import model_device
from ..arch import find_mlps, model_type_of, spec_for

RELU_ACTIVATIONS = frozenset({"relu", "relu2", "relu6", "fatrelu"})
"""Activation names (as configs spell them) whose outputs are exactly zero for most inputs."""


@dataclass(frozen=True)
class LabelRule:
    """Which neurons count as active, from the MLP's intermediate vector h (the down projection's input).

    `kind="threshold"`: |h_j| > `value` (0: exactly nonzero, for ReLU / FATReLU MLPs).
    `kind="top_fraction"`: h_j is among the `ceil(value * d_ff)` largest |h| of its token (SwiGLU).
    """

    kind: Literal["threshold", "top_fraction"]
    value: float

    def __post_init__(self) -> None:
        if self.kind == "threshold":
            if not (self.value >= 0 and math.isfinite(self.value)):
                raise ValueError(f"A threshold label rule needs a finite value >= 0, got {self.value}.")
        elif self.kind == "top_fraction":
            if not 0 < self.value <= 1:
                raise ValueError(f"A top_fraction label rule needs a value in (0, 1], got {self.value}.")
        else:
            raise ValueError(f"Unknown label rule kind {self.kind!r}: use 'threshold' or 'top_fraction'.")

    @classmethod
    def above(cls, threshold: float = 0.0) -> LabelRule:
        """Active when |h_j| > `threshold` (the default 0: exactly nonzero)."""
        return cls("threshold", float(threshold))

    @classmethod
    def top(cls, fraction: float) -> LabelRule:
        """Active when |h_j| is among the top `fraction` of the token's neurons."""
        return cls("top_fraction", float(fraction))

    def labels(self, h: torch.Tensor) -> torch.Tensor:
        """Bool labels of the same shape as `h` ([..., d_ff])."""
        magnitude = h.abs()
        if self.kind == "threshold":
            return magnitude > self.value
        k = max(1, math.ceil(self.value * h.shape[-1] - 1e-9))
        mask = torch.zeros(h.shape, dtype=torch.bool, device=h.device)
        return mask.scatter_(-1, magnitude.topk(k, dim=-1).indices, True)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LabelRule:
        return cls(data["kind"], float(data["value"]))


def default_label_rule(config: Any, *, density: float = 0.1) -> LabelRule:
    """`above(0)` for a ReLU-family model, else `top(density)`: a SwiGLU neuron is never exactly zero,
    so "active" can only mean "among the largest", at the density the sparse method will run at."""
    spec = spec_for(model_type_of(config))
    text_config = getattr(config, "text_config", None) or config
    act = getattr(text_config, spec.act_config_key, None) or getattr(config, spec.act_config_key, "")
    if str(act).lower() in RELU_ACTIVATIONS:
        return LabelRule.above(0.0)
    return LabelRule.top(density)


_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def packed_width(d_ff: int) -> int:
    """Bytes of one row of packed labels: eight neurons a byte, `ceil(d_ff / 8)`."""
    return -(-d_ff // 8)


def pack_labels(labels: torch.Tensor) -> torch.Tensor:
    """Bool labels [n, d_ff] as bits: uint8 [n, packed_width(d_ff)], neuron j bit j % 8 of byte j // 8."""
    n, d_ff = labels.shape
    n_bytes = packed_width(d_ff)
    padded = torch.zeros(n, n_bytes * 8, dtype=torch.uint8)
    padded[:, :d_ff] = labels
    return (padded.view(n, n_bytes, 8) << _BIT_SHIFTS).sum(-1, dtype=torch.uint8)


def unpack_labels(packed: torch.Tensor, d_ff: int) -> torch.Tensor:
    """The bool labels [n, d_ff] that `pack_labels` packed."""
    bits = (packed.unsqueeze(-1) >> _BIT_SHIFTS) & 1
    return bits.view(packed.shape[0], packed.shape[1] * 8)[:, :d_ff].bool()


def sample_bytes(rows: int, layers: int, d_model: int, d_ff: int, input_dtype: torch.dtype) -> int:
    """Bytes `collect_activations` holds for `rows` kept rows of each of `layers` layers: an input in
    `input_dtype`, labels as bits and a sampling key per row."""
    return rows * layers * (d_model * input_dtype.itemsize + packed_width(d_ff) + 8)


class LayerSamples:
    """One layer's collected rows: MLP inputs, their labels, and exact activation counts over all rows.

    `inputs` is [n, d_model] (on CPU), `labels` [n, d_ff] bool; n <= max_rows is a uniform sample of
    the `rows_seen` token rows, while `active_counts` [d_ff] counts every row. `mlp_params` is the
    MLP's parameter count, to size predictors against it; `rule` the label rule.

    The labels are held as bits (`packed_labels`) and unpacked when read: as one bool per neuron they
    were most of a sample's memory (Qwen2.5-1.5B: 8960 bytes of labels a row against 6144 of float32
    input).
    """

    def __init__(
        self,
        layer: int,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        rows_seen: int,
        active_counts: torch.Tensor,
        mlp_params: int,
        rule: LabelRule | None = None,
    ) -> None:
        self.layer, self.inputs, self.rows_seen = layer, inputs, rows_seen
        self.active_counts, self.mlp_params, self.rule = active_counts, mlp_params, rule
        self.packed_labels = pack_labels(labels)
        self._keys = torch.empty(0, dtype=torch.float64)
        self._storage: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        """While the sample fills: (inputs, packed labels, keys) rows allocated ahead, of which
        `inputs`, `packed_labels` and `_keys` are the first, grown by doubling. Concatenating per
        batch copied the whole sample every batch; holding the batches apart kept thousands of small
        blocks that the allocator did not give back (122880 SmolLM2 rows ran out of 23 GB)."""

    def __repr__(self) -> str:
        return (
            f"LayerSamples(layer={self.layer}, rows={len(self.inputs)}, rows_seen={self.rows_seen}, "
            f"d_model={self.d_model}, d_ff={self.d_ff})"
        )

    @property
    def labels(self) -> torch.Tensor:
        """The bool labels [n, d_ff], unpacked (a new tensor at each read)."""
        return unpack_labels(self.packed_labels, self.d_ff)

    @property
    def d_model(self) -> int:
        return self.inputs.shape[-1]

    @property
    def d_ff(self) -> int:
        return self.active_counts.shape[-1]

    def _add(self, x: torch.Tensor, labels: torch.Tensor, max_rows: int, generator: torch.Generator) -> None:
        """Count `labels` and merge the rows into the sample of the `max_rows` smallest keys.

        Once the sample is full, arriving rows overwrite the slots of the rows they displace, so a
        batch costs a copy of its own rows, not of the whole sample.
        """
        self.rows_seen += x.shape[0]
        self.active_counts += labels.sum(0, dtype=torch.int64)
        if max_rows <= 0:
            return
        packed = pack_labels(labels)
        keys = torch.rand(x.shape[0], generator=generator, dtype=torch.float64)
        held = self._keys.numel()
        total = held + x.shape[0]
        if total <= max_rows:  # still filling up
            inputs, all_labels, all_keys = self._reserve(total, max_rows, x.dtype if held == 0 else None)
            inputs[held:total] = x
            all_labels[held:total], all_keys[held:total] = packed, keys
            self.inputs, self.packed_labels, self._keys = inputs[:total], all_labels[:total], all_keys[:total]
            return
        self._storage = None  # from here on the sample is its own tensors, of max_rows rows
        if held < max_rows:  # fills up with this batch
            inputs = torch.cat([self.inputs.to(x.dtype), x])  # the first rows set the dtype
            all_labels, all_keys = torch.cat([self.packed_labels, packed]), torch.cat([self._keys, keys])
            if all_keys.numel() > max_rows:
                keep = all_keys.topk(max_rows, largest=False).indices.sort().values
                inputs, all_labels, all_keys = inputs[keep], all_labels[keep], all_keys[keep]
            self.inputs, self.packed_labels, self._keys = inputs, all_labels, all_keys
            return
        keep = torch.cat([self._keys, keys]).topk(max_rows, largest=False).indices
        arriving = keep[keep >= held] - held
        if arriving.numel() == 0:
            return
        staying = torch.zeros(held, dtype=torch.bool)
        staying[keep[keep < held]] = True
        slots = (~staying).nonzero().flatten()
        self.inputs[slots] = x[arriving].to(self.inputs.dtype)
        self.packed_labels[slots] = packed[arriving]
        self._keys[slots] = keys[arriving]

    def _reserve(
        self, rows: int, max_rows: int, dtype: torch.dtype | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Storage for `rows` rows holding the sample so far: the current one, or one twice as large
        (at most `max_rows`) with the rows copied in. `dtype` sets the inputs' (the first rows')."""
        capacity = 0 if self._storage is None else self._storage[2].numel()
        if rows <= capacity:
            return self._storage
        capacity = min(max_rows, max(rows, 2 * capacity))
        held = self._keys.numel()
        storage = (
            torch.empty(capacity, self.d_model, dtype=dtype or self.inputs.dtype),
            torch.empty(capacity, self.packed_labels.shape[-1], dtype=torch.uint8),
            torch.empty(capacity, dtype=torch.float64),
        )
        for new, old in zip(storage, (self.inputs, self.packed_labels, self._keys), strict=True):
            new[:held] = old
        self._storage = storage
        return storage

    def _finish(self) -> None:
        """End a collection: a sample that stopped short of its storage is copied out of it."""
        if self._storage is not None and self._storage[2].numel() > self._keys.numel():
            self.inputs, self.packed_labels, self._keys = (
                self.inputs.clone(),
                self.packed_labels.clone(),
                self._keys.clone(),
            )
        self._storage = None


def _batch_tensors(
    batch: torch.Tensor | Mapping[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(batch, Mapping):
        ids, mask = batch["input_ids"], batch.get("attention_mask")
    else:
        ids, mask = batch, None
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
        mask = None if mask is None else mask.reshape(1, -1)
    return ids, mask


def collect_activations(
    model: nn.Module,
    batches: Iterable[torch.Tensor | Mapping[str, torch.Tensor]],
    *,
    rule: LabelRule | None = None,
    max_rows: int = 16384,
    layers: Sequence[int] | None = None,
    seed: int = 0,
    input_dtype: torch.dtype | None = None,
    progress: bool = True,
) -> list[LayerSamples]:
    """Run a dense (unpatched) causal LM over `batches` and collect, per MLP, inputs and neuron labels.

    Args:
        model: a Hugging Face causal LM of a supported architecture, in memory and not patched.
        batches: token batches: [B, T] (or [T]) id tensors, or mappings with `input_ids` and an
            optional `attention_mask`, whose padded positions are left out.
        rule: the label rule; None: `default_label_rule(model.config)`.
        max_rows: token rows kept per layer (a uniform sample); 0 keeps none and only counts
            activations (the profile of `activation_frequency`).
        layers: which layers to collect (all by default).
        seed: seeds the subsampling, so a collection can be repeated exactly.
        input_dtype: the dtype the kept inputs are held in (None: the model's). The dtype the
            predictors will run in holds what they will see, in half of float32's memory for bf16.
        progress: show a progress bar over batches.

    Returns one `LayerSamples` per collected layer, in layer order.
    """
    from tqdm.auto import tqdm

    spec = spec_for(model_type_of(model.config))
    rule = rule or default_label_rule(model.config)
    owners = find_mlps(model, spec)
    wanted = set(range(len(owners))) if layers is None else set(layers)
    if not wanted <= set(range(len(owners))):
        raise ValueError(f"layers {sorted(wanted)} out of range: the model has layers 0..{len(owners) - 1}.")
    generator = torch.Generator().manual_seed(seed)
    samples: dict[int, LayerSamples] = {}
    captured: dict[int, torch.Tensor] = {}
    keep_rows: list[torch.Tensor | None] = [None]
    handles: list[torch.utils.hooks.RemovableHandle] = []

    def capture_input(layer: int) -> Callable[[nn.Module, tuple], None]:
        def hook(_module: nn.Module, args: tuple) -> None:
            captured[layer] = args[0]

        return hook

    def capture_intermediate(layer: int) -> Callable[[nn.Module, tuple], None]:
        def hook(_module: nn.Module, args: tuple) -> None:
            x = captured.pop(layer, None)
            if x is None:
                raise RuntimeError(
                    f"Layer {layer}'s down projection ran before its input projection: flashlm cannot "
                    "collect activations from this MLP."
                )
            h = args[0]
            x, h = x.reshape(-1, x.shape[-1]), h.reshape(-1, h.shape[-1])
            keep = keep_rows[0]
            if keep is not None:
                if keep.numel() != x.shape[0]:
                    raise ValueError(
                        f"The attention mask covers {keep.numel()} tokens but layer {layer}'s MLP saw "
                        f"{x.shape[0]} rows."
                    )
                x, h = x[keep.to(x.device)], h[keep.to(h.device)]
            x = x.detach().to("cpu", input_dtype or x.dtype)
            samples[layer]._add(x, rule.labels(h.detach()).cpu(), max_rows, generator)

        return hook

    try:
        for layer, _name, owner in owners:
            if layer not in wanted:
                continue
            down = owner.get_submodule(spec.down)
            first = owner.get_submodule(spec.input_projections[0])
            projections = [owner.get_submodule(name) for name in {spec.down, *spec.input_projections}]
            d_model, d_ff = first.in_features, down.in_features
            samples[layer] = LayerSamples(
                layer=layer,
                inputs=torch.empty(0, d_model),
                labels=torch.empty(0, d_ff, dtype=torch.bool),
                rows_seen=0,
                active_counts=torch.zeros(d_ff, dtype=torch.int64),
                mlp_params=sum(p.numel() for m in projections for p in m.parameters()),
                rule=rule,
            )
            handles.append(first.register_forward_pre_hook(capture_input(layer)))
            handles.append(down.register_forward_pre_hook(capture_intermediate(layer)))
        device = model_device(model)
        total = len(batches) if hasattr(batches, "__len__") else None  # type: ignore[arg-type]
        with torch.no_grad():  # not inference_mode: the rows are trained on later
            for batch in tqdm(
                batches, total=total, desc="Collecting activations", unit="batch", disable=not progress
            ):
                ids, mask = _batch_tensors(batch)
                keep_rows[0] = None if mask is None else mask.reshape(-1).bool()
                kwargs = {} if mask is None else {"attention_mask": mask.to(device)}
                model(input_ids=ids.to(device), use_cache=False, **kwargs)
                captured.clear()
    finally:
        for handle in handles:
            handle.remove()
    for layer_samples in samples.values():
        layer_samples._finish()
    return [samples[layer] for layer in sorted(samples)]
