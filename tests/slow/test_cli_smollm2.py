"""The CLI on the real SmolLM2 checkpoint."""

from __future__ import annotations

import json
import re

import pytest

from flashlm.cli.main import main


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


@pytest.mark.slow
def test_eval_ppl_on_smollm2(smollm2_dir, tmp_path, capsys):
    argv = ["eval", "ppl", "--model", str(smollm2_dir), "--tokens", "256", "--context-length", "128"]
    assert main([*argv, "--store", str(tmp_path / "store"), "--memory-budget", "25%", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["windows"] == 2 and record["tokens"] == 2 * 127
    assert 2 < record["perplexity"] < 500 and record["mlp_density"] == pytest.approx(1.0)
    assert record["bytes_read"] > 0 and 0 <= record["hit_rate"] <= 1
