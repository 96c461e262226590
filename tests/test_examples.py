"""Every script in examples/ runs on a tiny random model and prints what it promises.

Each script runs as a subprocess (`python examples/X.py --model <tiny checkpoint> --store <tmp> ...`), with
`HF_HUB_OFFLINE=1` and the session's `FLASHLM_CACHE`, so nothing touches the network or the user's cache.
Scripts are discovered by glob: a new example fails here until `EXAMPLES` says how to run it small.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_word_tokenizer

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = sorted(EXAMPLES_DIR.glob("*.py"))

# script name -> (extra arguments that make it fast on a tiny model, regular expressions its output must
# match, line by line). A tiny model's budget is given in bytes: a share of its few KB of weights cannot
# hold the working memory. Its weights are random, so only the sentences are checked, not the numbers;
# except that dense streaming must give the in-RAM model's tokens.
EXAMPLES: dict[str, tuple[list[str], list[str]]] = {
    "generate_under_budget.py": (
        ["--new-tokens", "4", "--memory-budget", "1MB"],
        [r"^stats: [\d.]+ MB read per token, hit rate [\d.]+%"],
    ),
    "compare_methods.py": (
        ["--new-tokens", "4", "--density", "0.6", "--memory-budget", "1MB"],
        [
            r"^in RAM .* tok/s",
            r"^dense .* MB read per token, .* tokens equal: True$",
            r"^dip .* MB read per token, .* tokens equal: (True|False)$",
            r"^dip-ca .* MB read per token, .* tokens equal: (True|False)$",
        ],
    ),
    "calibrate.py": (
        ["--tokens", "128", "--context-length", "64", "--densities", "0.5,0.7", "--memory-budget", "1MB"],
        [
            r"^calibrated on 128 tokens of shakespeare$",
            r"^density 50%: input columns [\d.]+%, down columns [\d.]+%$",
            r"^density 70%: input columns [\d.]+%, down columns [\d.]+%$",
        ],
    ),
    "prune_and_endor.py": (
        ["--windows", "2", "--context-length", "64", "--new-tokens", "4", "--memory-budget", "160KB"],
        [
            r"^pruned 14 linears to 50\.0% sparsity",
            # 160 KB: the working memory and one compressed layer, so the other layer is read from disk
            r"^endor: layers 1 in memory, 1 on disk \(compressed\), [\d.]+ MB read per token",
        ],
    ),
}


@pytest.fixture(scope="module")
def tiny_with_tokenizer(make_tiny_checkpoint, tmp_path_factory) -> Path:
    """A copy of the tiny bf16 llama checkpoint with a word-level tokenizer whose ids fit its vocabulary."""
    path = tmp_path_factory.mktemp("examples") / "tiny"
    shutil.copytree(make_tiny_checkpoint("llama", dtype=torch.bfloat16), path)
    save_word_tokenizer(path)
    return path


def test_every_example_has_a_case() -> None:
    assert SCRIPTS, f"no examples found in {EXAMPLES_DIR}"
    assert sorted(EXAMPLES) == [script.name for script in SCRIPTS]


@pytest.mark.parametrize("script", SCRIPTS, ids=[script.name for script in SCRIPTS])
def test_example_runs_on_a_tiny_model(script: Path, tiny_with_tokenizer: Path, tmp_path: Path) -> None:
    extra, expected = EXAMPLES.get(script.name, ([], []))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    assert env["FLASHLM_CACHE"]  # the session's temporary cache (conftest), inherited by the script
    command = [
        sys.executable,
        str(script),
        "--model",
        str(tiny_with_tokenizer),
        "--store",
        str(tmp_path / "s"),
    ]
    result = subprocess.run(
        [*command, *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, f"{script.name} failed:\n{result.stdout}\n{result.stderr}"
    for pattern in expected:
        assert re.search(pattern, result.stdout, re.MULTILINE), (
            f"{script.name} printed no line matching {pattern!r}:\n{result.stdout}"
        )
