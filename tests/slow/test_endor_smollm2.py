"""Endor offload of a Wanda-pruned SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import flashlm
from flashlm.methods.endor import endor_linears


@pytest.mark.slow
def test_smollm2_pruned_endor_decodes_like_the_pruned_model_in_ram(smollm2_dir: Path, tmp_path: Path) -> None:
    """Wanda 50% on SmolLM2 (a quick calibration), then Endor with a quarter of the layers' bytes: layers
    in memory and on disk, 24 greedy tokens identical to the pruned model in RAM, 56.25% of the bytes."""
    from transformers import AutoTokenizer

    from flashlm.workflows.prune import prune_checkpoint

    pruned = tmp_path / "pruned"
    prune_checkpoint(smollm2_dir, pruned, sparsity=0.5, num_windows=4, context_length=128, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(pruned)
    inputs = tokenizer("The printing press changed Europe because", return_tensors="pt")
    reference = AutoModelForCausalLM.from_pretrained(pruned).eval()
    with torch.no_grad():
        expected = reference.generate(**inputs, max_new_tokens=24, do_sample=False)
    config = flashlm.FlashConfig(method="endor", store=str(tmp_path / "store"), memory_budget="25%")
    model = AutoModelForCausalLM.from_pretrained(pruned, quantization_config=config).eval()
    with torch.no_grad():
        got = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    assert torch.equal(got, expected)
    stats = flashlm.stats(model)
    assert {"cpu", "disk"} <= set(stats.placement)
    store = endor_linears(model)[0].runtime.store
    assert store.nbytes() == 0.5625 * store.dense_nbytes()
    assert stats.totals(decode_only=True)["bytes_read_per_step"] >= sum(
        layer.data_bytes
        for layer, where in zip(store.layers, stats.placement, strict=True)
        if where == "disk"
    )
