"""Exceptions raised by flashlm. Each says what is wrong and what to do about it."""

from __future__ import annotations


class FlashLMError(Exception):
    """Base class of every flashlm error."""


class ConfigError(FlashLMError, ValueError):
    """A `FlashConfig` option is out of range or inconsistent with the model."""


class RelufiedCheckpointError(FlashLMError, ValueError):
    """A relufied (FATReLU) checkpoint was built from its config alone, without its thresholds."""


class UnsupportedArchitectureError(FlashLMError, ValueError):
    """The model's `model_type` has no entry in flashlm's architecture table."""


class StoreError(FlashLMError):
    """Base class of weight-store problems."""


class StoreNotFoundError(StoreError, FileNotFoundError):
    """The store path does not hold a flashlm store."""


class StoreMismatchError(StoreError, ValueError):
    """The store was converted from a different checkpoint, or has other dimensions."""


class StoreCorruptError(StoreError, OSError):
    """The store is truncated, or its manifest or files are damaged."""


class BudgetTooSmallError(FlashLMError, ValueError):
    """The memory budget cannot hold one token's working set; `minimum_bytes` is the least that can."""

    def __init__(self, message: str, *, minimum_bytes: int) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes


class CacheDirError(FlashLMError, OSError):
    """flashlm's cache directory cannot be created or written."""


class CorpusNotFoundError(FlashLMError, FileNotFoundError):
    """An evaluation corpus is unknown, or the package that carries its text is not installed."""


class EndorFormatError(StoreCorruptError, ValueError):
    """An Endor-compressed matrix is inconsistent: its bitmap and values disagree, or it is truncated."""


class PredictorsNotFoundError(FlashLMError, FileNotFoundError):
    """A store has no trained activation predictors (`predictors.safetensors`) beside it yet."""
