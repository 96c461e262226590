"""transformers integration: `FlashConfig` as a quantization config and `FlashQuantizer` as its
`HfQuantizer`, so `from_pretrained(..., quantization_config=FlashConfig(...))` patches a model
while it is still on the meta device. The quantizer is a thin adapter over `flashlm.patching`."""

from __future__ import annotations

import re
from pathlib import Path

from transformers.activations import ACT2FN
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)

from ..activations import FATRELU, fatrelu_by_name
from ..config import QUANT_METHOD, FlashConfig
from ..errors import ConfigError
from ..patching import dense_weights, flashlm_modules, patch_for_loading


class FlashQuantizer(HfQuantizer):
    """Swaps every MLP for a flashlm module (`FlashMLP`) before weights load; the MLP weights are never read.

    The store is found (or converted, on first load) from the checkpoint files transformers
    resolved. The MLP tensors in the checkpoint become expected-unexpected keys, which the loader
    skips without materializing them.
    """

    requires_calibration = False

    def __init__(self, quantization_config: FlashConfig, **kwargs) -> None:
        super().__init__(quantization_config, **kwargs)

    def validate_environment(self, *args, **kwargs) -> None:
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            mlp_on_disk = [k for k, v in device_map.items() if v == "disk" and "mlp" in k]
            if mlp_on_disk:
                raise ConfigError(
                    f"device_map sends MLP modules {mlp_on_disk[:3]} to 'disk', but flashlm streams the MLPs "
                    "itself: map them to 'cpu' (flashlm keeps only its cache in memory)."
                )

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if not checkpoint_files or not str(checkpoint_files[0]).endswith(".safetensors"):
            raise ConfigError(
                "flashlm converts safetensors checkpoints; load this one without FlashConfig, then call "
                "flashlm.patch(model, config), which converts from the weights in memory."
            )
        replaced = patch_for_loading(model, Path(checkpoint_files[0]).parent, self.quantization_config)
        model._keys_to_ignore_on_load_unexpected = set(model._keys_to_ignore_on_load_unexpected or ()) | {
            rf"^{re.escape(key)}$" for key in replaced
        }
        # flashlm's modules hold state of their own, saved beside the store (a method's predictors): not
        # missing from the checkpoint. The loader still replaces it with placeholders; `reset_state`
        # (after loading) reads it again.
        model._keys_to_ignore_on_load_missing = set(model._keys_to_ignore_on_load_missing or ()) | {
            rf"^{re.escape(key)}$" for key in _own_state_keys(model)
        }
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        for module in flashlm_modules(model):
            module.reset_state()
        return model

    def get_state_dict_and_metadata(self, model):
        """The full state dict, streamed weights read back from the store: a saved checkpoint is complete."""
        own = _own_state_keys(model)
        state_dict = {key: value for key, value in model.state_dict().items() if key not in own}
        state_dict.update(dense_weights(model))
        return state_dict, {}

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False  # nothing in a flashlm model trains yet (no parameters in the streamed MLPs)


def _own_state_keys(model) -> set[str]:
    """State-dict keys of what flashlm's modules hold themselves (saved beside the store, not in a
    checkpoint)."""
    names = {id(module): name for name, module in model.named_modules()}
    return {
        f"{names[id(module)]}.{key}" for module in flashlm_modules(model) for key in module.own_state_keys()
    }


def register() -> None:
    """Make `quant_method="flashlm"` known to transformers, and `hidden_act="fatrelu"` an activation name
    that fails with what to do (`activations.fatrelu_by_name`); idempotent."""
    if FATRELU not in ACT2FN:
        ACT2FN[FATRELU] = fatrelu_by_name
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(FlashConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(FlashQuantizer)
