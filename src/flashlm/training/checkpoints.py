"""Loading checkpoints the relufication recipe wrote (`flashlm train relufy`) beside any other.

A relufied checkpoint's config says `hidden_act="fatrelu"`, which transformers cannot build (it has no
per-layer thresholded ReLU), and records the thresholds under `relufication`. These functions build
its layers as ReLU and install FATReLU with the recorded thresholds; every loader on the eval side goes
through them, so a relufied checkpoint works wherever a plain one does.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from ..activations import CONFIG_FIELD, RELU, restore_relufication
from .trainer import TrainingError


class NotRelufiedError(TrainingError, ValueError):
    """`load_relufied` was given a checkpoint that relufication did not write."""


def load_relufied(path: str | os.PathLike, *, dtype: torch.dtype | None = None, **kwargs: Any) -> nn.Module:
    """A relufied checkpoint (saved by this recipe) as a model with its FATReLU modules, eval mode.

    transformers cannot build a thresholded ReLU from `hidden_act`, so the config is read first, its
    activation key set to `"relu"` for construction, and `relufy` then installs FATReLU with the
    per-layer thresholds from `config.relufication`; the weights are the checkpoint's, untouched.
    `kwargs` go to `from_pretrained`. Raises `NotRelufiedError` for a checkpoint without that record.
    """
    from transformers import AutoModelForCausalLM

    config = buildable_config(path)
    record = getattr(config, CONFIG_FIELD, None)
    if not isinstance(record, dict) or "thresholds" not in record:
        raise NotRelufiedError(
            f"{path} has no '{CONFIG_FIELD}' record in its config.json, so it was not written by "
            "flashlm.training.relufy: load it with AutoModelForCausalLM.from_pretrained."
        )
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = AutoModelForCausalLM.from_pretrained(path, config=config, **kwargs)
    restore_relufication(model)
    return model.eval()


def buildable_config(path: str | os.PathLike) -> Any:
    """The checkpoint's config as transformers can build a model from it: a relufied checkpoint's
    activation key reads `"relu"` (its layers are the same; `load_relufied` installs the thresholds),
    any other config is returned as it is."""
    from transformers import AutoConfig

    from ..arch import model_type_of, spec_for

    config = AutoConfig.from_pretrained(path)
    if isinstance(getattr(config, CONFIG_FIELD, None), dict):
        setattr(config.get_text_config(), spec_for(model_type_of(config)).act_config_key, RELU)
    return config


def is_relufied_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the checkpoint at `path` was written by this recipe (its config records the relufication)."""
    from transformers import AutoConfig

    return isinstance(getattr(AutoConfig.from_pretrained(path), CONFIG_FIELD, None), dict)


def load_checkpoint(path: str | os.PathLike, **kwargs: Any) -> nn.Module:
    """The checkpoint at `path` in memory, eval mode: `load_relufied` for one this recipe wrote,
    `AutoModelForCausalLM.from_pretrained` for any other. `kwargs` go to `from_pretrained`."""
    from transformers import AutoModelForCausalLM

    if is_relufied_checkpoint(path):
        return load_relufied(path, **kwargs)
    return AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
