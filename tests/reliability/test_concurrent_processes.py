"""Two processes decoding from one store at once (issue 15, item 6).

Each child process loads the model with flashlm on the same store path, decodes greedily under a
small budget, and prints its tokens. The parent holds the two children at three barriers (started,
model loaded, first token decoded), so both load the store at the same time (for a sparse method,
both find its unit kinds missing and derive them into the shared store at once) and decode side by
side. Both must succeed with the tokens of a single process decoding alone, having read from the
store, and leave a valid store behind.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import flashlm
from flashlm.errors import BudgetTooSmallError
from flashlm.store import Store

TIMEOUT_S = 300.0

CHILD = r"""
import json, sys

import torch
import transformers

import flashlm

checkpoint, options, prompt = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
new_tokens = int(sys.argv[4])


def barrier(name):
    print(name, flush=True)
    line = sys.stdin.readline()
    if line.strip() != "go":
        sys.exit(f"expected 'go' at {name}, got {line!r}")


barrier("started")
config = flashlm.FlashConfig(**options)
model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=config)
flashlm.stats(model, reset=True)
barrier("loaded")
tokens = []
with torch.inference_mode():
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    cache = out.past_key_values
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    tokens.append(int(token))
    barrier("decoding")
    for _ in range(new_tokens - 1):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(token))
stats = flashlm.stats(model)
result = {"tokens": tokens, "bytes_read": stats.totals()["bytes_read"], "io_mode": stats.io_mode}
print("result " + json.dumps(result), flush=True)
"""

BARRIERS = ("started", "loaded", "decoding")


def decode_together(
    checkpoint: Path, options: dict, prompt: list[int], new_tokens: int, processes: int
) -> list[dict]:
    """Run `processes` children in lockstep through `BARRIERS`; return each one's result."""
    args = [
        sys.executable,
        "-c",
        CHILD,
        str(checkpoint),
        json.dumps(options),
        json.dumps(prompt),
        str(new_tokens),
    ]
    children = [spawn(args, stdin=subprocess.PIPE) for _ in range(processes)]
    try:
        for name in BARRIERS:
            for child in children:
                expect_line(child, name)
            for child in children:  # every child is at the barrier: release them all
                child.stdin.write(b"go\n")
                child.stdin.flush()
        results = []
        for child in children:
            line = expect_line(child, "result ")
            results.append(json.loads(line.removeprefix("result ")))
        for child in children:
            assert child.wait(timeout=TIMEOUT_S) == 0, stderr_of(child)
        return results
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
            for stream in (child.stdin, child.stdout, child.errors):
                stream.close()


def expect_line(child: subprocess.Popen, prefix: str) -> str:
    deadline = time.monotonic() + TIMEOUT_S
    with selectors.DefaultSelector() as selector:
        selector.register(child.stdout, selectors.EVENT_READ)
        while selector.select(timeout=max(0.0, deadline - time.monotonic())):
            line = child.stdout.readline().decode()
            if line.startswith(prefix):
                return line.strip()
            if not line:
                child.wait()
                pytest.fail(f"a child exited ({child.returncode}) before {prefix!r}:\n{stderr_of(child)}")
    pytest.fail(f"a child printed no {prefix!r} within {TIMEOUT_S} s")


def minimum_budget(checkpoint: Path, store: Path, options: dict) -> int:
    """The least budget that holds one token's working set (read off a throwaway copy of `store`:
    loading may derive unit kinds into it)."""
    probe = store.parent / f"{store.name}-probe"
    shutil.copytree(store, probe)
    try:
        config = flashlm.FlashConfig(store=str(probe), memory_budget=1, **options)
        with pytest.raises(BudgetTooSmallError) as info:
            AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=config)
        return info.value.minimum_bytes
    finally:
        shutil.rmtree(probe)


def assert_concurrent_decoding_matches_solo(
    checkpoint: Path, store: Path, options: dict, prompt: list[int], new_tokens: int, tmp_path: Path
) -> list[dict]:
    solo_store = tmp_path / "solo.flash"
    shutil.copytree(store, solo_store)  # before the pair runs: the solo run starts from the same store

    pair = decode_together(checkpoint, {**options, "store": str(store)}, prompt, new_tokens, processes=2)
    (solo,) = decode_together(
        checkpoint, {**options, "store": str(solo_store)}, prompt, new_tokens, processes=1
    )

    assert len(solo["tokens"]) == new_tokens
    for result in pair:
        assert result["tokens"] == solo["tokens"]
        assert result["bytes_read"] > 0, "the child read nothing from the store"
    Store.open(store)  # still valid after both
    assert not [p for p in store.rglob(".*")], "temporary files left in the shared store"
    return pair


@pytest.mark.parametrize(
    "method",
    [
        pytest.param({}, id="dense"),
        # Sparse: the store holds dense streaming's kinds only, so both children derive DIP's at once.
        pytest.param({"method": "dip", "density": 0.5, "input_density": 0.5}, id="dip"),
    ],
)
def test_two_processes_decode_one_tiny_store(method, make_tiny_checkpoint, tmp_path):
    checkpoint = make_tiny_checkpoint("llama", dtype=torch.float32)
    store = tmp_path / "shared.flash"
    flashlm.convert(checkpoint, store, progress=False)
    budget = minimum_budget(checkpoint, store, method) + 16 * 1024  # a few units cached: most are read
    prompt = torch.randint(3, 128, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    assert_concurrent_decoding_matches_solo(
        checkpoint, store, {**method, "memory_budget": budget}, prompt, 48, tmp_path
    )
    kinds = Store.open(store).kinds
    if method:
        assert {"dip_in", "dip_down"} <= set(kinds)


@pytest.mark.slow
def test_two_processes_decode_smollm2_from_one_store(smollm2_dir, tmp_path):
    store = tmp_path / "shared.flash"
    flashlm.convert(smollm2_dir, store, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three lighthouses and say where each one stands."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = tokenizer(text).input_ids
    pair = assert_concurrent_decoding_matches_solo(
        smollm2_dir, store, {"memory_budget": "50%"}, prompt, 24, tmp_path
    )
    assert all(result["io_mode"] == pair[0]["io_mode"] for result in pair)


def spawn(args: list[str], **options) -> subprocess.Popen:
    """Popen with stdout piped and stderr in a temporary file (`.errors`): a pipe nobody reads while
    waiting on stdout could fill up and block the child."""
    errors = tempfile.TemporaryFile()  # noqa: SIM115 (closed with the process)
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=errors, env=os.environ.copy(), **options)
    process.errors = errors
    return process


def stderr_of(process: subprocess.Popen) -> str:
    process.errors.seek(0)
    return process.errors.read().decode(errors="replace")
