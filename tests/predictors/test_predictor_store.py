"""Predictors saved beside a store: round trip, and refusal when the store holds other weights."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model
from safetensors import safe_open
from safetensors.torch import save_file

from flashlm._version import __version__
from flashlm.errors import PredictorsNotFoundError, StoreCorruptError, StoreMismatchError
from flashlm.predictors import (
    PREDICTORS_FILE,
    LabelRule,
    LowRankPredictor,
    Predictors,
    TrainOptions,
    collect_activations,
    train_predictors,
)
from flashlm.store import Store, convert


@pytest.fixture(scope="module")
def stores(make_tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two stores of the tiny llama with the same dimensions but other weights (float32 / bfloat16)."""
    root = tmp_path_factory.mktemp("predictor-stores")
    return {
        name: convert(make_tiny_checkpoint("llama", dtype), root / f"{name}.flash", progress=False).path
        for name, dtype in (("a", torch.float32), ("b", torch.bfloat16))
    }


@pytest.fixture
def store(stores: dict[str, Path], tmp_path: Path) -> Path:
    """A private copy of store "a" (tests write predictors into it)."""
    return Path(shutil.copytree(stores["a"], tmp_path / "a.flash"))


def make_predictors(ranks: tuple[int, ...] = (3, 5), d_model: int = 64, d_ff: int = 96) -> Predictors:
    torch.manual_seed(0)
    layers = [LowRankPredictor(d_model, d_ff, r, threshold_logit=0.25 * i) for i, r in enumerate(ranks)]
    return Predictors(layers, label_rule=LabelRule.top(0.2))


def test_round_trip(store: Path) -> None:
    predictors = make_predictors()
    path = predictors.save(store)
    assert path == store / PREDICTORS_FILE and path.is_file()
    assert not [p for p in store.iterdir() if ".tmp" in p.name]  # written under a temporary name
    loaded = Predictors.load(store)
    assert loaded.ranks == [3, 5] and loaded.label_rule == LabelRule.top(0.2)
    assert [p.threshold_logit for p in loaded] == [0.0, 0.25]
    for name, tensor in predictors.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)
    x = torch.randn(4, 64)
    assert torch.equal(loaded[1].predict(x), predictors[1].predict(x))
    # the metadata says what the predictors are for
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["flashlm"])
    opened = Store.open(store)
    assert meta["content_sha256"] == opened.content_sha256 and meta["flashlm_version"] == __version__
    assert [layer["rank"] for layer in meta["layers"]] == [3, 5]
    assert meta["label_rule"] == {"kind": "top_fraction", "value": 0.2}
    # an opened Store works as well as a path
    assert Predictors.load(opened).ranks == [3, 5]


def test_predictors_load_in_the_dtype_they_were_saved_in(store: Path) -> None:
    predictors = make_predictors().to(torch.bfloat16)
    predictors.save(store)
    loaded = Predictors.load(store)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    assert loaded.nbytes == predictors.nbytes == make_predictors().nbytes // 2
    for name, tensor in predictors.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor)


def test_predictors_for_other_weights_are_refused(
    stores: dict[str, Path], store: Path, tmp_path: Path
) -> None:
    make_predictors().save(store)
    other = Path(shutil.copytree(stores["b"], tmp_path / "b.flash"))
    shutil.copy(store / PREDICTORS_FILE, other / PREDICTORS_FILE)
    with pytest.raises(StoreMismatchError, match="trained for other weights") as error:
        Predictors.load(other)
    message = str(error.value)
    assert str(other) in message and "train the predictors again" in message


def test_dimensions_must_match_the_store(store: Path) -> None:
    with pytest.raises(StoreMismatchError, match=r"\(layers, d_model, d_ff\) = \(3, 64, 96\)"):
        make_predictors(ranks=(2, 2, 2)).save(store)
    with pytest.raises(StoreMismatchError, match="d_model"):
        make_predictors(d_model=32).save(store)
    assert not (store / PREDICTORS_FILE).exists()


def test_missing_and_corrupt_files(store: Path) -> None:
    with pytest.raises(PredictorsNotFoundError, match="collect_activations") as error:
        Predictors.load(store)
    assert isinstance(error.value, FileNotFoundError)
    (store / PREDICTORS_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(StoreCorruptError, match="Delete"):
        Predictors.load(store)
    # a valid file whose tensors disagree with its metadata
    path = make_predictors().save(store)
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()["flashlm"])
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    meta["layers"][0]["rank"] = 4
    save_file(tensors, str(path), metadata={"flashlm": json.dumps(meta)})
    with pytest.raises(StoreCorruptError, match="inconsistent"):
        Predictors.load(store)


def test_collect_train_save_load_on_a_tiny_llama(store: Path) -> None:
    """The whole offline pipeline on the weights the store was converted from."""
    model = build_tiny_model("llama")  # the weights store "a" was converted from (in float32)
    ids = torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    samples = collect_activations(model, [ids[:2], ids[2:]], rule=LabelRule.top(0.25), progress=False)
    options = TrainOptions(ranks=(4, 8), target_recall=0.9, epochs=3, lr=1e-2)
    predictors = train_predictors(samples, options, progress=False)
    for report, s in zip(predictors.reports, samples, strict=True):
        assert report.rank in (4, 8) and report.recall >= 0.9
        assert report.label_density == pytest.approx(0.25, abs=0.01)
        assert report.size_percent == pytest.approx(
            100 * predictors[report.layer].num_parameters() / s.mlp_params
        )
    predictors.save(store)
    loaded = Predictors.load(store)
    assert loaded.reports == predictors.reports
    assert loaded.label_rule == LabelRule.top(0.25)
    assert os.path.getsize(store / PREDICTORS_FILE) > 0
