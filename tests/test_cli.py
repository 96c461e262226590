"""The `flashlm` command line: convert, info, generate, and errors reported without a traceback."""

from __future__ import annotations

import json
import re

import pytest
import torch

from flashlm.cli import main


def test_convert_then_info(make_tiny_checkpoint, tmp_path, capsys):
    path = make_tiny_checkpoint("llama", dtype=torch.float32)
    assert main(["convert", str(path), str(tmp_path / "store")]) == 0
    assert (tmp_path / "store" / "manifest.json").exists()
    capsys.readouterr()

    assert main(["info", str(tmp_path / "store")]) == 0
    text = capsys.readouterr().out
    assert "llama: 2 layers" in text and "kind bundle" in text and "kind dip_in" in text

    assert main(["info", str(tmp_path / "store"), "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["format"] == "flashlm-store" and manifest["model_type"] == "llama"


def test_errors_are_reported_not_raised(tmp_path, capsys):
    assert main(["info", str(tmp_path / "missing")]) == 2
    assert "flashlm convert" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_prints_text_and_per_token_stats(smollm2_dir, tmp_path, capsys):
    code = main(
        [
            "generate",
            "--model",
            str(smollm2_dir),
            "--max-new-tokens",
            "4",
            "--memory-budget",
            "25%",
            "--store",
            str(tmp_path / "store"),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    step_lines = [line for line in out.splitlines() if re.match(r"^\s*\d+\s+\d+\s+[\d.]+ [kMG]?B\s", line)]
    assert len(step_lines) == 4  # the prefill step, then one per generated token
    assert "hit rate" in out and "reads direct" in out
