"""The unit profile: how often a method needs each unit of each layer, measured offline on text and
saved beside the store (PowerInfer §6.1's activation profile, for any method's units).

A sparse method's hot set (`FlashConfig(hot_share=...)`) is placed from it: the units a method
needs most often, weighted by what a miss of one costs to read, are pinned in the caches
(`flashlm.cache.placement`, `NeuronCache.pin`). The frequencies depend on the method's selection,
so a profile belongs to one store (its content hash), one method configuration (`profile_key`) and
what the method fitted beside the store that decides its selection (DIP's calibrated split, the
predictors: `fitted_digests`); `flashlm profile` measures it (`flashlm.workflows.profile`).

DIP-CA's selections are DIP's, bent towards what happens to be resident: its profile is DIP's at the
same density and split (`cache_aware` is not part of the key).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .._version import __version__
from ..errors import ConfigError, FlashLMError

if TYPE_CHECKING:
    from ..config import FlashConfig
    from ..engine.trace import Trace
    from ..store import Store

PROFILE_PREFIX = "unit-profile-"
KEY_OPTIONS = ("method", "density", "input_density", "threshold")
"""The `FlashConfig` options that decide which units a method selects."""


class ProfileMissingError(FlashLMError):
    """A hot set or a budget split by use was asked for, but the store has no unit profile of the method."""


def profile_key(config: FlashConfig) -> dict[str, Any]:
    """The options of `config` a unit profile is measured under (and looked up by)."""
    return {name: getattr(config, name) for name in KEY_OPTIONS}


def fitted_digests(store_path: str | Path, files: tuple[str, ...]) -> dict[str, str]:
    """The sha256 of each of `files` beside the store ("" for one that is missing)."""
    digests = {}
    for name in files:
        path = Path(store_path) / name
        digests[name] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
    return digests


def _file_name(key: dict[str, Any]) -> str:
    parts = [key["method"], f"d{key['density']:g}"]
    if key.get("input_density") is not None:
        parts.append(f"in{key['input_density']:g}")
    if key.get("threshold") not in (None, "token"):
        parts.append(str(key["threshold"]))
    return f"{PROFILE_PREFIX}{'-'.join(parts)}.safetensors"


@dataclass
class UnitProfile:
    """Per (layer, kind), the share of tokens that needed each unit (float32 in [0, 1]); `fitted` holds
    the `fitted_digests` of the files the selection depended on."""

    content_sha256: str
    key: dict[str, Any]
    fitted: dict[str, str]
    corpus: str
    tokens: int
    frequencies: dict[tuple[int, str], torch.Tensor]

    @classmethod
    def from_trace(
        cls, trace: Trace, *, content_sha256: str, key: dict[str, Any], fitted: dict[str, str], corpus: str
    ) -> UnitProfile:
        """The frequencies of a trace recorded token by token (every step one token)."""
        frequencies = {(layer, kind): trace.frequencies(layer, kind) for layer, kind in trace.layer_kinds()}
        return cls(content_sha256, dict(key), dict(fitted), corpus, trace.num_steps, frequencies)

    @staticmethod
    def path(store_path: str | Path, key: dict[str, Any]) -> Path:
        return Path(store_path) / _file_name(key)

    def save(self, store_path: str | Path) -> Path:
        """Write the profile beside the store (a temporary name, renamed when complete)."""
        path = self.path(store_path, self.key)
        metadata = {
            "format": "flashlm-unit-profile",
            "flashlm_version": __version__,
            "content_sha256": self.content_sha256,
            "key": json.dumps(self.key, sort_keys=True),
            "fitted": json.dumps(self.fitted, sort_keys=True),
            "corpus": self.corpus,
            "tokens": str(self.tokens),
        }
        tensors = {f"{layer}/{kind}": f.contiguous() for (layer, kind), f in self.frequencies.items()}
        temporary = path.with_name(f".{path.name}.tmp")
        save_file(tensors, temporary, metadata=metadata)
        os.replace(temporary, path)
        return path

    @classmethod
    def of(
        cls, store: Store, config: FlashConfig, fitted_files: tuple[str, ...], *, needed_by: str
    ) -> UnitProfile:
        """The profile of `config`'s method beside `store`, measured with the method's fitted files
        `fitted_files` as they are now (`load`; `needed_by` names the option that needs it)."""
        key, fitted = profile_key(config), fitted_digests(store.path, fitted_files)
        return cls.load(store.path, store.content_sha256, key, fitted, needed_by=needed_by)

    @classmethod
    def load(
        cls,
        store_path: str | Path,
        content_sha256: str,
        key: dict[str, Any],
        fitted: dict[str, str],
        *,
        needed_by: str = "hot_share",
    ) -> UnitProfile:
        """The profile of method configuration `key` saved beside the store whose content hash is
        `content_sha256`, measured with the fitted files `fitted` (`fitted_digests`) as they are now;
        `ProfileMissingError` (naming the command that makes one) if there is none, or it was measured on
        other weights or under other fitted files, `ConfigError` if the file is damaged. `needed_by`
        names the option that needs it, for the message."""
        path = cls.path(store_path, key)
        command = (
            f"flashlm profile --store {store_path} --method {key['method']} --density {key['density']:g}"
            + ("" if key.get("input_density") is None else f" --input-density {key['input_density']:g}")
        )
        if not path.is_file():
            raise ProfileMissingError(
                f"{needed_by} needs a unit profile of {key} for the store {store_path}, and it has none. "
                f"Measure one with `{command}` (and the model's --model), or do without {needed_by}."
            )
        try:
            with safe_open(path, "pt") as f:
                metadata = f.metadata() or {}
                frequencies = {}
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    layer, kind = name.split("/", 1)
                    frequencies[(int(layer), kind)] = f.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as error:
            raise ConfigError(
                f"The unit profile {path} is damaged ({error}): measure it again with `{command}`."
            ) from error
        if metadata.get("content_sha256") != content_sha256:
            raise ProfileMissingError(
                f"The unit profile {path} was measured on other MLP weights than the store's: measure it "
                f"again with `{command}`."
            )
        measured_with = json.loads(metadata.get("fitted", "{}"))
        if measured_with != fitted:
            changed = sorted(
                name
                for name in fitted.keys() | measured_with.keys()
                if fitted.get(name) != measured_with.get(name)
            )
            raise ProfileMissingError(
                f"The unit profile {path} was measured before {', '.join(changed)} changed (the method's "
                f"selection depends on it): measure it again with `{command}`."
            )
        return cls(
            content_sha256,
            json.loads(metadata["key"]),
            measured_with,
            metadata.get("corpus", ""),
            int(metadata.get("tokens", 0)),
            frequencies,
        )
