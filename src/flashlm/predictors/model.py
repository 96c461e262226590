"""Low-rank activation predictors and their file beside the store.

A predictor guesses, from the MLP input x, which intermediate neurons a token will need, so only
their rows are read from the store (LLM in a flash §3.1, appendix B; the Deja Vu design): two
linears, d_model -> r (no bias) -> d_ff, whose outputs are per-neuron logits. A rank r far below
d_model keeps it a few percent of the MLP's size; PowerInfer §5.1 picks r per layer (see
`flashlm.predictors.train`). A neuron is predicted active when its sigmoid reaches the layer's
threshold (a probability, as in the paper's "sigmoid threshold 0.7"), chosen after training so that
a target share of the truly active neurons is caught.

All layers' predictors are saved in one safetensors file in the store directory
(`<store>/predictors.safetensors`), with a JSON block in the safetensors metadata naming the store's
content hash, the ranks, thresholds, label rule and training reports. The content hash ties the
predictors to the weights they were trained on, as for the calibration record
(`flashlm.methods.calibration`): loading them onto another store's weights raises
`StoreMismatchError`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .._version import __version__
from ..errors import PredictorsNotFoundError, StoreCorruptError, StoreMismatchError
from ..store import Store
from ..store.format import dtype_of_safetensors_name
from .labels import LabelRule

PREDICTORS_FILE = "predictors.safetensors"
"""Name of the predictors file inside a store directory."""
FORMAT = "flashlm-predictors"
FORMAT_VERSION = 1
_METADATA_KEY = "flashlm"


def probability_to_logit(p: float) -> float:
    """logit(p), with logit(0) = -inf (everything active) and logit(1) = +inf (nothing active)."""
    if not 0 <= p <= 1:
        raise ValueError(f"A predictor threshold is a probability in [0, 1], got {p}.")
    if p == 0:
        return -math.inf
    if p == 1:
        return math.inf
    return math.log(p) - math.log1p(-p)


def logit_to_probability(z: float) -> float:
    """sigmoid(z), written not to overflow for large |z| (the inverse of `probability_to_logit`)."""
    if z >= 0:
        return 1 / (1 + math.exp(-z))
    e = math.exp(z)
    return e / (1 + e)


class LowRankPredictor(nn.Module):
    """Per-neuron activation logits of one MLP: `expand(reduce(x))`, x [.., d_model] -> [.., d_ff].

    `threshold_logit` is the layer's decision threshold in logit space (exact, as training chose it;
    `threshold` gives it as a probability). A neuron is predicted active when its logit is >= it.
    """

    def __init__(self, d_model: int, d_ff: int, rank: int, *, threshold_logit: float = 0.0) -> None:
        super().__init__()
        if rank <= 0:
            raise ValueError(f"A predictor's rank must be positive, got {rank}.")
        self.reduce = nn.Linear(d_model, rank, bias=False)
        self.expand = nn.Linear(rank, d_ff)
        self.threshold_logit = float(threshold_logit)

    @property
    def d_model(self) -> int:
        return self.reduce.in_features

    @property
    def d_ff(self) -> int:
        return self.expand.out_features

    @property
    def rank(self) -> int:
        return self.reduce.out_features

    @property
    def threshold(self) -> float:
        """The decision threshold as a probability."""
        return logit_to_probability(self.threshold_logit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.reduce.weight
        return self.expand(self.reduce(x.to(weight.dtype)))

    def _cut(self, threshold: float | None) -> float:
        return self.threshold_logit if threshold is None else probability_to_logit(threshold)

    @torch.no_grad()
    def predict(self, x: torch.Tensor, threshold: float | None = None) -> torch.Tensor:
        """Bool mask [.., d_ff] of the neurons predicted active for each row of `x`.

        `threshold` is a probability; None uses the layer's trained threshold.
        """
        return self(x) >= self._cut(threshold)

    @torch.no_grad()
    def active_indices(self, x: torch.Tensor, threshold: float | None = None) -> torch.Tensor:
        """Sorted int64 indices of the neurons predicted active for any row of `x`.

        For one token ([d_model]) these are the neurons to load; for many (prefill), their union.
        """
        mask = self.predict(x, threshold).reshape(-1, self.d_ff).any(0)
        return mask.nonzero().flatten()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def extra_repr(self) -> str:
        return f"rank={self.rank}, threshold={self.threshold:.4g}"


@dataclass
class LayerReport:
    """How one layer's predictor did on held-out rows at its chosen threshold.

    `recall` / `precision` are over every (token, neuron) pair; `density` is the share of neurons
    predicted active (what gets loaded), `label_density` the share truly active; `size_percent` the
    predictor's parameters as a percentage of the MLP's (None when unknown); `ranks_tried` maps each
    rank tried to its held-out recall at probability 0.5 (the rank-growth criterion), `touched_tried`
    to the parameters a token touches with it, as a percentage of the MLP's (its predicted neurons'
    share the loading method reads, plus the predictor: growth stops where that stops shrinking;
    empty where growth went by recall alone).
    """

    layer: int
    rank: int
    threshold: float
    recall: float
    precision: float
    density: float
    label_density: float
    size_percent: float | None
    ranks_tried: dict[int, float]
    touched_tried: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerReport:
        data = dict(data)
        for name in ("ranks_tried", "touched_tried"):
            data[name] = {int(k): float(v) for k, v in data.get(name, {}).items()}
        return cls(**data)


class Predictors(nn.Module):
    """One `LowRankPredictor` per layer (ranks may differ), with what they were trained for.

    `label_rule` is the rule the labels followed; `reports` the per-layer training reports. Both are
    saved with the weights.
    """

    def __init__(
        self,
        layers: Sequence[LowRankPredictor],
        *,
        label_rule: LabelRule | None = None,
        reports: Sequence[LayerReport] | None = None,
    ) -> None:
        super().__init__()
        if not layers:
            raise ValueError("Predictors needs at least one layer's predictor.")
        if len({(p.d_model, p.d_ff) for p in layers}) != 1:
            raise ValueError("Every layer's predictor must have the same d_model and d_ff.")
        self.layers = nn.ModuleList(layers)
        self.label_rule = label_rule
        self.reports = list(reports) if reports is not None else []

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int) -> LowRankPredictor:
        return self.layers[layer]  # type: ignore[return-value]

    def __iter__(self) -> Iterator[LowRankPredictor]:
        return iter(self.layers)  # type: ignore[arg-type]

    @property
    def d_model(self) -> int:
        return self[0].d_model

    @property
    def d_ff(self) -> int:
        return self[0].d_ff

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's weights, as held in memory."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    @property
    def ranks(self) -> list[int]:
        return [p.rank for p in self]

    @property
    def thresholds(self) -> list[float]:
        return [p.threshold for p in self]

    # ---- persistence ------------------------------------------------------------------------

    def save(self, store: Store | str | os.PathLike) -> Path:
        """Write `<store>/predictors.safetensors` (temporary name, then rename) and return its path.

        The store is opened to record its content hash, and must have this collection's dimensions.
        """
        store = _open(store)
        _check_dimensions(store, len(self), self.d_model, self.d_ff, what="These predictors")
        metadata = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "flashlm_version": __version__,
            "content_sha256": store.content_sha256,
            "fingerprint": store.fingerprint,
            "model_type": store.model_type,
            "num_layers": len(self),
            "d_model": self.d_model,
            "d_ff": self.d_ff,
            "label_rule": None if self.label_rule is None else self.label_rule.to_dict(),
            "layers": [
                {"rank": p.rank, "threshold_logit": p.threshold_logit, "threshold": p.threshold} for p in self
            ],
            "reports": [asdict(report) for report in self.reports],
        }
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in self.state_dict().items()}
        path = store.path / PREDICTORS_FILE
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            save_file(tensors, str(tmp), metadata={_METADATA_KEY: json.dumps(metadata)})
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, store: Store | str | os.PathLike, *, device: torch.device | str = "cpu") -> Predictors:
        """The predictors saved in `store`, checked against its weights, on `device`. On the meta device
        only their shapes and dtypes are read (for transformers' loader, which allocates them itself and
        whose `reset_state` reads them once).

        Raises `PredictorsNotFoundError` when the store has none, `StoreMismatchError` when they were
        trained on other weights or dimensions, and `StoreCorruptError` when the file is damaged.
        """
        store = _open(store)
        path = store.path / PREDICTORS_FILE
        if not path.is_file():
            raise PredictorsNotFoundError(
                f"The store {store.path} has no activation predictors ({PREDICTORS_FILE}): collect labels "
                "with `flashlm.predictors.collect_activations(model, batches)`, train with "
                "`flashlm.predictors.train_predictors(samples)` and save with `.save(store)`."
            )
        retrain = f"Delete {path} and train the predictors again for this store."
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                metadata = json.loads((f.metadata() or {})[_METADATA_KEY])
                if torch.device(device).type == "meta":
                    tensors = {name: _meta_tensor(f.get_slice(name)) for name in f.keys()}  # noqa: SIM118
                else:
                    tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
            if metadata.get("format") != FORMAT or metadata.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"format {metadata.get('format')!r} v{metadata.get('format_version')!r}")
            layers_meta = metadata["layers"]
            num_layers, d_model, d_ff = metadata["num_layers"], metadata["d_model"], metadata["d_ff"]
            trained_for = str(metadata["content_sha256"])
        except Exception as exc:  # safetensors raises its own SafetensorError (no public base class)
            raise StoreCorruptError(f"The predictors file {path} is unreadable ({exc}). {retrain}") from exc
        if trained_for != store.content_sha256:
            raise StoreMismatchError(
                f"The predictors in {path} were trained for other weights (content sha256 "
                f"{trained_for[:12]}..., flashlm {metadata.get('flashlm_version')}) than the "
                f"store {store.path} now holds ({store.content_sha256[:12]}...): the store was converted "
                f"again from another checkpoint. {retrain}"
            )
        _check_dimensions(store, num_layers, d_model, d_ff, what=f"The predictors in {path}")
        try:
            with torch.device("meta"):  # no initialization: the saved tensors (in their dtype) are assigned
                layers = [
                    LowRankPredictor(
                        d_model, d_ff, int(entry["rank"]), threshold_logit=entry["threshold_logit"]
                    )
                    for entry in layers_meta
                ]
            predictors = cls(
                layers,
                label_rule=None
                if metadata["label_rule"] is None
                else LabelRule.from_dict(metadata["label_rule"]),
                reports=[LayerReport.from_dict(r) for r in metadata.get("reports", [])],
            )
            predictors.load_state_dict(tensors, strict=True, assign=True)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise StoreCorruptError(f"The predictors file {path} is inconsistent ({exc}). {retrain}") from exc
        return predictors.to(device)


def _meta_tensor(saved: Any) -> torch.Tensor:
    """A meta tensor of the shape and dtype of a saved tensor (a safetensors slice), nothing read."""
    return torch.empty(saved.get_shape(), dtype=dtype_of_safetensors_name(saved.get_dtype()), device="meta")


def _open(store: Store | str | os.PathLike) -> Store:
    return store if isinstance(store, Store) else Store.open(store)


def _check_dimensions(store: Store, num_layers: int, d_model: int, d_ff: int, *, what: str) -> None:
    ours = (num_layers, d_model, d_ff)
    theirs = (store.num_layers, store.d_model, store.d_ff)
    if ours != theirs:
        raise StoreMismatchError(
            f"{what} have (layers, d_model, d_ff) = {ours} but the store {store.path} has {theirs}: "
            "train predictors for this store's model."
        )
