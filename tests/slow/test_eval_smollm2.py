"""The corpora tokenized with SmolLM2's tokenizer."""

from __future__ import annotations

import pytest
from conftest import check_token_cache
from transformers import AutoTokenizer

from flashlm.data.corpora import corpus_text


@pytest.mark.slow
def test_corpus_tokens_with_smollm2_tokenizer(smollm2_dir, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    full = check_token_cache("shakespeare", tokenizer, monkeypatch)
    assert tokenizer.decode(full[:200]).startswith(corpus_text("shakespeare")[:100])
