"""Wanda pruning of the real SmolLM2."""

from __future__ import annotations

import math

import pytest

from flashlm.workflows.prune import prune_model


@pytest.mark.slow
def test_smollm2_pruned_at_half_stays_usable(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flashlm.data.corpora import corpus_tokens
    from flashlm.eval.perplexity import perplexity

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    calibration = corpus_tokens("shakespeare", tokenizer, split="calibration")
    test = corpus_tokens("shakespeare", tokenizer, split="test")
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    dense = perplexity(model, test, context_length=256, num_tokens=1024, progress=False).perplexity
    report = prune_model(model, calibration, sparsity=0.5, context_length=256, num_windows=16, progress=False)
    pruned = perplexity(model, test, context_length=256, num_tokens=1024, progress=False).perplexity
    assert report.achieved_sparsity == pytest.approx(0.5, abs=1e-3)
    assert len(report.linears) == 30 * 7
    assert math.isfinite(pruned) and dense < pruned < 3 * dense, (dense, pruned)
