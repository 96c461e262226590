"""Shared fixtures for flashlm's test suite.

- Everything runs offline (`HF_HUB_OFFLINE=1`, `TRANSFORMERS_OFFLINE=1`, set at import).
- `TINY_CONFIGS` builds a tiny random config for every model_type of `flashlm.arch.ARCHITECTURES`;
  `make_tiny_checkpoint(model_type, dtype)` saves one (seeded, cached per session) and returns its dir.
- Cache directories: `FLASHLM_CACHE` points at a per-session temporary directory for the whole run, so
  no test writes stores into the user's cache. The one exception is the embedded default model
  (SmolLM2, ~20 s to convert): `smollm2_dir` converts it into the user's *real* cache, whose root is
  read here, at import, before the override (`_REAL_CACHE_ROOT`), and passed to
  `flashlm.data.models.default_model_path(cache_root=...)`, so the conversion is reused across runs.
- Tests marked `gpu` are skipped without CUDA.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest
import torch
import transformers

from flashlm.store.reader import native_reader


def _real_cache_root() -> Path | None:
    """The user's flashlm cache root (same rules as `flashlm._utils.cache_dir`), without creating it."""
    if env := os.environ.get("FLASHLM_CACHE"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg).expanduser() / "flashlm"


_REAL_CACHE_ROOT = _real_cache_root()

# --------------------------------------------------------------------------------------------------
# Tiny random configs, one per supported model_type. Intermediate sizes differ from hidden and from
# 2 x hidden so that transposed or halved shapes fail loudly.
# --------------------------------------------------------------------------------------------------
_VOCAB = 128


def _llama() -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def _mistral() -> transformers.PretrainedConfig:
    return transformers.MistralConfig(
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=None,
    )


def _qwen2() -> transformers.PretrainedConfig:
    return transformers.Qwen2Config(
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )


def _qwen3() -> transformers.PretrainedConfig:
    return transformers.Qwen3Config(
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )


def _phi3() -> transformers.PretrainedConfig:
    return transformers.Phi3Config(
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        original_max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def _gemma() -> transformers.PretrainedConfig:
    return transformers.GemmaConfig(
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=256,
    )


def _gemma2() -> transformers.PretrainedConfig:
    return transformers.Gemma2Config(
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=16,
    )


def _gemma3_text() -> transformers.PretrainedConfig:
    return transformers.Gemma3TextConfig(
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=16,
    )


def _gemma3() -> transformers.PretrainedConfig:
    """Gemma3ForConditionalGeneration: the gemma3_text decoder above plus a 1-layer SigLIP tower."""
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    return transformers.Gemma3Config(
        text_config=_gemma3_text().to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=_VOCAB - 1,
        boi_token_index=_VOCAB - 3,
        eoi_token_index=_VOCAB - 2,
    )


def _opt() -> transformers.PretrainedConfig:
    return transformers.OPTConfig(
        vocab_size=_VOCAB,
        hidden_size=48,
        ffn_dim=80,
        word_embed_proj_dim=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        enable_bias=True,
        do_layer_norm_before=True,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
    )


def _falcon(bias: bool = False) -> transformers.PretrainedConfig:
    return transformers.FalconConfig(
        vocab_size=_VOCAB,
        hidden_size=32,
        ffn_hidden_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        new_decoder_architecture=False,
        multi_query=True,
        bias=bias,
        alibi=False,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )


def _falcon_bias() -> transformers.PretrainedConfig:
    return _falcon(bias=True)


# model_type -> zero-argument builder of a tiny config, for every model_type in flashlm.arch.ARCHITECTURES.
TINY_CONFIGS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "phi3": _phi3,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3_text": _gemma3_text,
    "gemma3": _gemma3,  # Gemma3ForConditionalGeneration: tiny enough (~0.1 s to build)
    "opt": _opt,
    "falcon": _falcon,
}

# Extra variants, "<model_type>-<what>" -> builder; `config.model_type` names the architecture.
TINY_VARIANTS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "falcon-bias": _falcon_bias,
}


NO_NATIVE_READER = "the C reader needs a C compiler"
needs_native_reader = pytest.mark.skipif(native_reader() is None, reason=NO_NATIVE_READER)
"""For tests of the reader's C pool (`flashlm.store.reader.native_reader`)."""


def tiny_config(name: str) -> transformers.PretrainedConfig:
    """A fresh tiny config for `name`, a key of `TINY_CONFIGS` or `TINY_VARIANTS`."""
    return (TINY_CONFIGS | TINY_VARIANTS)[name]()


def build_tiny_model(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny random causal LM for `name` (seeded with `torch.manual_seed(0)`), in eval mode."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(name))
    return model.to(dtype).eval()


# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def _flashlm_test_cache(tmp_path_factory: pytest.TempPathFactory):
    """Point `FLASHLM_CACHE` at a per-session temporary directory for the whole run."""
    previous = os.environ.get("FLASHLM_CACHE")
    path = tmp_path_factory.mktemp("flashlm-cache")
    os.environ["FLASHLM_CACHE"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("FLASHLM_CACHE", None)
    else:
        os.environ["FLASHLM_CACHE"] = previous


@pytest.fixture(scope="session")
def make_tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """Factory `make_tiny_checkpoint(name, dtype=torch.bfloat16) -> Path` of a saved tiny checkpoint.

    `name` is a key of `TINY_CONFIGS` or `TINY_VARIANTS`. Checkpoints are cached per session per
    `(name, dtype)`; treat the directory as read-only (copy it before modifying).
    """
    made: dict[tuple[str, torch.dtype], Path] = {}

    def make(name: str, dtype: torch.dtype = torch.bfloat16) -> Path:
        key = (name, dtype)
        if key not in made:
            model = build_tiny_model(name, dtype)
            path = tmp_path_factory.mktemp(f"tiny-{name}-{str(dtype).removeprefix('torch.')}")
            model.save_pretrained(path)
            made[key] = path
        return made[key]

    return make


@pytest.fixture(params=[*TINY_CONFIGS, *TINY_VARIANTS])
def tiny_model_dir(request: pytest.FixtureRequest, make_tiny_checkpoint) -> Path:
    """A bfloat16 tiny checkpoint, parametrized over `TINY_CONFIGS` and `TINY_VARIANTS`.

    Override the list with `@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)`.
    """
    return make_tiny_checkpoint(request.param)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct, bf16) converted into the user's real flashlm cache.

    Tests using it mark themselves `@pytest.mark.slow`.
    """
    from flashlm.data.models import default_model_path

    return default_model_path(progress=False, cache_root=_REAL_CACHE_ROOT)


@pytest.fixture(scope="session")
def smollm2_store(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of SmolLM2 converted once per test session, in a temporary directory."""
    import flashlm

    path = tmp_path_factory.mktemp("smollm2") / "store.flash"
    flashlm.convert(smollm2_dir, path, progress=False)
    return path


# --------------------------------------------------------------------------------------------------
# Markers
# --------------------------------------------------------------------------------------------------


def clock_moving_in(monkeypatch: pytest.MonkeyPatch, module, owner, name: str) -> list[tuple]:
    """Make `module.perf_counter` a clock that moves one second during each call of `owner.<name>` and at
    no other time; returns the list the calls' positional arguments are recorded in, as they come."""
    clock, calls = [0.0], []
    monkeypatch.setattr(module, "perf_counter", lambda: clock[0])
    original = getattr(owner, name)

    def one_second(*args, **kwargs):
        calls.append(args)
        clock[0] += 1.0
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, one_second)
    return calls


def record_tensor_reads(monkeypatch: pytest.MonkeyPatch, module) -> list[str]:
    """The keys of the tensors read through `module.safe_open` from now on (every `get_tensor`, and every
    read through `get_slice`; a slice's shape and dtype are not reads), recorded in the returned list."""
    reads: list[str] = []
    real_safe_open = module.safe_open

    class RecordingSlice:
        def __init__(self, key, inner):
            self.key, self.inner = key, inner

        def __getitem__(self, index):
            reads.append(self.key)
            return self.inner[index]

        def __getattr__(self, name):
            return getattr(self.inner, name)

    class RecordingFile:
        def __init__(self, *args, **kwargs):
            self.inner = real_safe_open(*args, **kwargs)

        def get_slice(self, key):
            return RecordingSlice(key, self.inner.get_slice(key))

        def get_tensor(self, key):
            reads.append(key)
            return self.inner.get_tensor(key)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(module, "safe_open", RecordingFile)
    return reads


@pytest.fixture
def materialized_keys(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The checkpoint keys transformers' loader materializes from now on (`record_tensor_reads`)."""
    import transformers.modeling_utils as modeling_utils

    return record_tensor_reads(monkeypatch, modeling_utils)


@pytest.fixture
def direct_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory whose file system accepts O_DIRECT (tmp_path may be tmpfs, which refuses it)."""
    from flashlm.store.disk import supports_direct

    for base in (tmp_path, Path("/var/tmp"), Path(__file__).resolve().parents[1] / ".pytest_cache"):
        try:
            base.mkdir(parents=True, exist_ok=True)
            directory = Path(tempfile.mkdtemp(prefix="flashlm-direct-", dir=base))
        except OSError:
            continue
        if supports_direct(directory):
            yield directory
            shutil.rmtree(directory, ignore_errors=True)
            return
        shutil.rmtree(directory, ignore_errors=True)
    pytest.skip("no directory here (tmp_path, /var/tmp, .pytest_cache) supports O_DIRECT")


def save_word_tokenizer(path: Path) -> None:
    """Save a word-level tokenizer whose ids fit the tiny models' vocabulary into checkpoint `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "the and to of I you a my in is that not me it his with be your this he for have"
    vocab = {token: i for i, token in enumerate(["[UNK]", *words.split(), *".,;:!?'"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(path)


def check_token_cache(name: str, tokenizer, monkeypatch) -> torch.Tensor:
    """Tokenize corpus `name` through its token cache and check the cache and the calibration/test split;
    returns the whole token stream."""
    from flashlm.data import corpora
    from flashlm.data.corpora import corpus_path, corpus_tokens, split_tokens

    path = corpus_path(name, tokenizer)
    path.unlink(missing_ok=True)
    test = corpus_tokens(name, tokenizer)
    assert path.is_file() and not list(path.parent.glob("*.tmp"))
    stamp = path.stat().st_mtime_ns
    with monkeypatch.context() as m:
        m.setattr(corpora, "encode_text", lambda *_: pytest.fail("re-tokenized despite the cache"))
        again = corpus_tokens(name, tokenizer)
        calibration = corpus_tokens(name, tokenizer, split="calibration")
    assert torch.equal(test, again) and path.stat().st_mtime_ns == stamp
    full = torch.load(path, weights_only=True)
    assert full.dtype == torch.int64 and full.dim() == 1 and test.dtype == torch.int64
    # calibration = the first 10%, test = the rest: disjoint, and together the whole stream
    assert (
        calibration.numel() == int(0.1 * full.numel()) and calibration.numel() + test.numel() == full.numel()
    )
    assert torch.equal(torch.cat([calibration, test]), full)
    assert torch.equal(split_tokens(full, "calibration"), calibration)
    return full


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (none available on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
