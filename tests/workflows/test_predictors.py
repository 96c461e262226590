"""`train_store_predictors`: labels from the dense model on a corpus, one predictor per layer, saved
beside the model's store, where `method="predictor"` loads them."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import save_word_tokenizer
from transformers import AutoModelForCausalLM

import flashlm
import flashlm.workflows.predictors as workflow
from flashlm.errors import ConfigError
from flashlm.patching import streaming_mlps
from flashlm.predictors import Predictors, TrainOptions
from flashlm.workflows.predictors import train_store_predictors

SHAKESPEARE = ("shakespeare",)
"""The corpus of the tests that are not about corpora: the Debian ones (the default's others) may be
missing where the tests run."""


@pytest.fixture
def tiny_opt(make_tiny_checkpoint, tmp_path):
    """The tiny OPT checkpoint (ReLU, plain fc1/fc2 with biases), fp32, with a word-level tokenizer."""
    path = tmp_path / "opt"
    shutil.copytree(make_tiny_checkpoint("opt", dtype=torch.float32), path)
    save_word_tokenizer(path)
    return path


def test_trained_predictors_are_saved_beside_the_store_and_drive_the_method(tiny_opt, tmp_path):
    store = tmp_path / "store"
    options = TrainOptions(ranks=(8, 16), epochs=3, target_recall=0.9)
    trained = train_store_predictors(
        tiny_opt,
        corpora=SHAKESPEARE,
        tokens=1024,
        sequence_length=64,
        options=options,
        store=store,
        progress=False,
    )
    saved = Predictors.load(store)
    assert saved.ranks == trained.ranks and all(rank in (8, 16) for rank in saved.ranks)
    assert [r.layer for r in saved.reports] == [0, 1]
    # held-out recall is reported as measured; the threshold was set for 0.9 on those rows
    assert all(report.recall >= 0.85 for report in saved.reports)

    config = flashlm.FlashConfig(method="predictor", density=0.9, store=str(store), memory_budget=10**7)
    model = AutoModelForCausalLM.from_pretrained(tiny_opt, quantization_config=config)
    for module, predictor in zip(streaming_mlps(model), saved, strict=True):
        torch.testing.assert_close(module.predictor.expand.weight, predictor.expand.weight, rtol=0, atol=0)
    ids = torch.randint(3, 30, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False)
    assert 0 < flashlm.stats(model).totals()["density"] < 1


def test_predictors_are_held_in_the_stores_dtype(make_tiny_checkpoint, tmp_path):
    """A bfloat16 checkpoint's predictors are bfloat16 (half the memory of float32), as saved, as the
    method runs them, and as the budget counts them."""
    path = tmp_path / "opt"
    shutil.copytree(make_tiny_checkpoint("opt", dtype=torch.bfloat16), path)
    save_word_tokenizer(path)
    options = TrainOptions(ranks=(8,), epochs=2, target_recall=0.9)
    trained = train_store_predictors(
        path, corpora=SHAKESPEARE, tokens=512, sequence_length=64, options=options, progress=False
    )
    assert {p.dtype for p in trained.parameters()} == {torch.bfloat16}
    config = flashlm.FlashConfig(method="predictor", density=0.9, memory_budget=10**7)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config)
    modules = streaming_mlps(model)
    assert {p.dtype for module in modules for p in module.predictor.parameters()} == {torch.bfloat16}
    assert modules[0].runtime.fitted_bytes == trained.nbytes
    ids = torch.randint(3, 30, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, do_sample=False)


def test_predictors_sized_for_a_method_record_what_each_rank_costs(tiny_opt, make_tiny_checkpoint, tmp_path):
    """`method` turns on the cost that stops rank growth, at that method's read share (OPT's plain MLP
    reads whole bundles); predictor-gate is refused for an MLP without a gate; without a method the
    growth goes by recall alone."""
    from flashlm.methods import PredictorMLP
    from flashlm.workflows.predictors import read_share

    options = TrainOptions(ranks=(4, 8), epochs=2, target_recall=0.9)
    common = dict(corpora=SHAKESPEARE, tokens=512, sequence_length=64, options=options, progress=False)
    sized = train_store_predictors(tiny_opt, store=tmp_path / "a", method="predictor", **common)
    assert all(set(report.touched_tried) <= {4, 8} and report.touched_tried for report in sized.reports)
    plain = train_store_predictors(tiny_opt, store=tmp_path / "b", **common)
    assert all(report.touched_tried == {} for report in plain.reports)
    plain_mlp = flashlm.Store.open(tmp_path / "a")
    gated = flashlm.convert(
        make_tiny_checkpoint("llama", dtype=torch.float32), tmp_path / "gated", progress=False
    )
    assert read_share("predictor", plain_mlp) == PredictorMLP.READ_SHARE == 1.0
    assert read_share("predictor-gate", gated) == pytest.approx(1 / 3)
    with pytest.raises(ConfigError, match="no gate"):
        read_share("predictor-gate", plain_mlp)
    with pytest.raises(ConfigError, match="not method='dip'"):
        read_share("dip", gated)


def test_too_few_tokens_for_one_window_is_refused_before_any_work(tiny_opt):
    with pytest.raises(ConfigError, match="at least one window"):
        train_store_predictors(tiny_opt, corpora=SHAKESPEARE, tokens=32, sequence_length=64, progress=False)


def test_each_corpus_gives_an_equal_share_of_the_labelled_windows(tiny_opt, monkeypatch):
    """Several corpora: the windows are the start of each one's calibration split, an equal whole number
    of windows each, in the order given; a corpus with fewer gives all it has and the others make up
    the difference. Fewer windows than corpora, or more tokens than the corpora hold, are refused
    before any labelling."""
    from transformers import AutoTokenizer

    from flashlm.data.corpora import CorpusNotFoundError, corpus_tokens, require

    try:
        require("jargon")
    except CorpusNotFoundError as exc:
        pytest.skip(str(exc))
    seen = []

    def collect(model, batches, **kwargs):
        seen.append(torch.cat(batches, dim=1)[0])
        raise RuntimeError("stop after the windows")  # the rest is the single-corpus path

    monkeypatch.setattr(workflow, "collect_activations", collect)
    tokenizer = AutoTokenizer.from_pretrained(tiny_opt)
    shakespeare, jargon = (
        corpus_tokens(name, tokenizer, split="calibration") for name in ("shakespeare", "jargon")
    )
    both = ("shakespeare", "jargon")
    with pytest.raises(RuntimeError, match="stop after the windows"):
        train_store_predictors(tiny_opt, corpora=both, tokens=300, sequence_length=64)
    assert torch.equal(seen[-1], torch.cat((shakespeare[:128], jargon[:128])))  # 4 windows: 2 each

    jargon_windows = jargon.numel() // 64
    assert shakespeare.numel() // 64 > jargon_windows + 10
    with pytest.raises(RuntimeError, match="stop after the windows"):
        train_store_predictors(
            tiny_opt, corpora=both, tokens=(2 * jargon_windows + 10) * 64, sequence_length=64
        )
    expected = torch.cat((shakespeare[: (jargon_windows + 10) * 64], jargon[: jargon_windows * 64]))
    assert torch.equal(seen[-1], expected)  # jargon gives all it has, Shakespeare the rest

    with pytest.raises(ConfigError, match="per corpus"):
        train_store_predictors(tiny_opt, corpora=both, tokens=100, sequence_length=64)
    with pytest.raises(
        ConfigError,
        match=rf"hold fewer than the {jargon.numel() + 64} tokens asked.*jargon: {jargon.numel()}",
    ):
        train_store_predictors(tiny_opt, corpora=("jargon",), tokens=jargon.numel() + 64, sequence_length=64)
    assert len(seen) == 2  # the refused calls labelled nothing


def test_window_shares_fill_equally_as_far_as_each_corpus_has() -> None:
    window_shares = workflow.window_shares
    assert window_shares([100, 100, 100], 90) == [30, 30, 30]
    assert window_shares([100, 100], 7) == [3, 4]  # the larger (here the last) takes what rounding leaves
    assert window_shares([10, 100, 50], 90) == [10, 40, 40]
    assert window_shares([10, 100, 25], 90) == [10, 55, 25]
    assert window_shares([10, 20], 90) == [10, 20]  # the corpora hold less than asked


def test_the_cli_trains_and_reports_per_layer(tiny_opt, tmp_path, capsys):
    from flashlm.cli.main import main

    store = tmp_path / "store"
    args = [
        "train",
        "predictors",
        "--model",
        str(tiny_opt),
        "--store",
        str(store),
        "--corpora",
        "shakespeare",
    ]
    code = main([*args, "--tokens", "512", "--sequence-length", "64", "--epochs", "2", "--max-rank", "8"])
    assert code == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:4] == ["layer", "rank", "threshold", "recall"]
    assert "% of the MLP parameters" in out
    saved = Predictors.load(store)
    assert saved.ranks == [8, 8]  # below the smallest listed rank (16), the cap itself


def test_a_relufied_checkpoint_trains_with_its_thresholds_and_streams_after_patch(tmp_path):
    """A FATReLU checkpoint (`flashlm train relufy`) does not load with plain `from_pretrained`; the
    workflow loads it with its thresholds (`load_checkpoint`), and `flashlm.patch` streams it from the
    checkpoint's own store, where the predictors were saved: the labels are its FATReLU's exact zeros,
    and the patched model keeps the FATReLU modules."""
    from conftest import build_tiny_model

    from flashlm.activations import FATReLU, relufy
    from flashlm.training.checkpoints import load_checkpoint
    from flashlm.training.relufy import save_relufied

    model = build_tiny_model("llama").float()
    relufy(model, [0.05, 0.1])
    path = save_relufied(model, tmp_path / "relufied")
    save_word_tokenizer(path)
    options = TrainOptions(ranks=(8, 16), epochs=3, target_recall=0.9)
    trained = train_store_predictors(
        path, corpora=SHAKESPEARE, tokens=1024, sequence_length=64, options=options, progress=False
    )
    # exact zeros of a thresholded ReLU are fewer than half the neurons: a plain ReLU's labels would differ
    assert all(0 < report.label_density < 1 for report in trained.reports)

    loaded = load_checkpoint(path)
    config = flashlm.FlashConfig(method="predictor", density=0.9, memory_budget=10**7)
    # No store named: patch finds the checkpoint's, with the predictors (else PredictorsNotFoundError).
    patched = flashlm.patch(load_checkpoint(path), config, progress=False)
    modules = streaming_mlps(patched)
    assert [type(m.act) for m in modules] == [FATReLU, FATReLU]
    assert [m.act.threshold for m in modules] == pytest.approx([0.05, 0.1])
    ids = torch.randint(3, 30, (1, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        streamed, dense = patched(ids).logits, loaded(ids).logits
    assert streamed.shape == dense.shape and torch.isfinite(streamed).all()
    assert 0 < flashlm.stats(patched).totals()["density"] < 1


def test_a_relufied_checkpoint_streams_through_from_pretrained_with_its_thresholds(
    tmp_path, materialized_keys
):
    """`load_streaming` builds a relufied checkpoint from its buildable config; the loader puts the
    FATReLU thresholds back before the MLPs are swapped, so no MLP weight is read and dense streaming
    is the relufied model."""
    from conftest import build_tiny_model

    from flashlm.activations import FATReLU, relufy
    from flashlm.eval.perplexity import load_streaming
    from flashlm.training.checkpoints import load_checkpoint
    from flashlm.training.relufy import save_relufied

    model = build_tiny_model("llama").float()
    relufy(model, [0.05, 0.1])
    path = save_relufied(model, tmp_path / "relufied")
    reference = load_checkpoint(path)
    flashlm.convert(path, tmp_path / "store", progress=False)
    materialized_keys.clear()
    streamed = load_streaming(path, flashlm.FlashConfig(store=str(tmp_path / "store"), memory_budget=10**7))
    assert materialized_keys and not [key for key in materialized_keys if ".mlp." in key]
    modules = streaming_mlps(streamed)
    assert [type(m.act) for m in modules] == [FATReLU, FATReLU]
    assert [m.act.threshold for m in modules] == pytest.approx([0.05, 0.1])
    ids = torch.randint(3, 30, (2, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(streamed(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_labelling_more_tokens_than_memory_holds_is_refused_before_any_is_labelled(
    tiny_opt, tmp_path, monkeypatch
):
    labelled = []
    monkeypatch.setattr(workflow, "collect_activations", lambda *args, **kwargs: labelled.append(1))
    monkeypatch.setattr(workflow, "available_memory_bytes", lambda: 100_000)
    # 1024 rows x 2 layers x (48 float32 inputs + 80 / 8 label bytes + an 8-byte key) = 430,080 bytes
    with pytest.raises(ConfigError, match=r"Labelling 1024 tokens would hold 430.08 KB .* fewer tokens"):
        train_store_predictors(
            tiny_opt,
            corpora=SHAKESPEARE,
            tokens=1024,
            sequence_length=64,
            store=tmp_path / "s",
            progress=False,
        )
    assert not labelled and not (tmp_path / "s" / "predictors.safetensors").exists()
