"""A conversion killed midway (SIGKILL: no cleanup handler runs) leaves no half store (issue 15, item 6).

`flashlm.convert` runs in a child process. Where the kill lands is made deterministic by the child
itself: it converts from a `TensorSource` that stops for good when asked for a given layer's tensors,
or with `os.replace` wrapped to stop before the staging directory is renamed onto the destination,
and says so on stdout; the parent then sends SIGKILL. One more test kills a plain conversion at a
point found by polling the staging directory, as an outside observer would.

After each kill: the destination holds no store (or, when overwriting, still the old one, intact),
the only trace is a hidden staging sibling that does not open as a store, and converting again (or
loading the model, which converts) gives a store identical to an uninterrupted conversion.
"""

from __future__ import annotations

import hashlib
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import transformers

import flashlm
from flashlm.errors import StoreNotFoundError
from flashlm.store import Store

LAYERS = 48
"""Layers of the checkpoint converted here: 144 row files, each fsynced, so a conversion lasts long
enough for the polling test to catch it midway (tenths of a second on the development disk)."""
GATED_FILES_PER_LAYER = 3  # gate, up, down
TIMEOUT_S = 600.0
"""How long a child may take to reach a line or exit: a guard against a hang, not a speed check (a
child that imports torch and transformers on a loaded 2-core machine took over 120 s)."""

CHILD = r"""
import importlib, os, sys, time
from pathlib import Path

import flashlm
from flashlm.store import SafetensorsSource

source_dir, dest, pause, overwrite = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"


def stop_here(what):
    print(what, flush=True)
    while True:
        time.sleep(60)


class PausingSource:
    # The checkpoint, except that asking for a tensor of layer `at` stops the process for good.
    def __init__(self, inner, at):
        self.inner, self.at = inner, at
        self.model_type, self.path = inner.model_type, inner.path

    def names(self):
        return self.inner.names()

    def has(self, name):
        return self.inner.has(name)

    def fingerprint(self):
        return self.inner.fingerprint()

    def get(self, name):
        if f".layers.{self.at}." in name:
            stop_here(f"paused reading layer {self.at}")
        return self.inner.get(name)


source = SafetensorsSource(source_dir)
if pause.startswith("layer-"):
    source = PausingSource(source, int(pause.removeprefix("layer-")))
elif pause == "rename":
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if Path(dst) == dest and Path(src).name.startswith(f".{dest.name}.tmp-"):
            stop_here("paused renaming the staging directory onto the destination")
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace
    convert_module = importlib.import_module("flashlm.store.convert")  # `flashlm.store.convert`: a function
    real_exchange = convert_module._exchange

    def exchange(a, b):
        if Path(b) == dest:
            stop_here("paused exchanging the staging directory with the old store")
        return real_exchange(a, b)

    convert_module._exchange = exchange
print("converting", flush=True)
flashlm.convert(source, dest, progress=False, overwrite=overwrite)
print("done", flush=True)
"""


# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved random llama of `LAYERS` small layers (bf16)."""
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    path = tmp_path_factory.mktemp("checkpoint-48-layers")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Every file of an uninterrupted conversion of `checkpoint`, by relative path -> sha256."""
    path = tmp_path_factory.mktemp("reference") / "store"
    flashlm.convert(checkpoint, path, progress=False)
    return tree(path)


@pytest.fixture(scope="module")
def old_store(make_tiny_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of another model (the tiny llama), for conversions that overwrite one."""
    path = tmp_path_factory.mktemp("old") / "store"
    flashlm.convert(make_tiny_checkpoint("llama"), path, progress=False)
    return path


def tree(path: Path) -> dict[str, str]:
    return {
        str(file.relative_to(path)): hashlib.sha256(file.read_bytes()).hexdigest()
        for file in sorted(path.rglob("*"))
        if file.is_file()
    }


# --------------------------------------------------------------------------------------------------
# Running and killing the child
# --------------------------------------------------------------------------------------------------


def start(checkpoint: Path, dest: Path, pause: str, *, overwrite: bool = False) -> subprocess.Popen:
    # The child inherits conftest's offline switches and FLASHLM_CACHE.
    return spawn([sys.executable, "-c", CHILD, str(checkpoint), str(dest), pause, "1" if overwrite else "0"])


def wait_for_line(process: subprocess.Popen, prefix: str) -> None:
    """Block until the child prints a line starting with `prefix` (fail if it exits or takes too long)."""
    deadline = time.monotonic() + TIMEOUT_S
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not selector.select(timeout=deadline - time.monotonic()):
                break
            line = process.stdout.readline().decode()
            if line.startswith(prefix):
                return
            if not line:  # EOF: the child exited
                process.wait()
                stderr = stderr_of(process)
                pytest.fail(f"the child exited ({process.returncode}) before {prefix!r}:\n{stderr}")
    kill(process)
    pytest.fail(f"the child printed no {prefix!r} within {TIMEOUT_S} s")


def kill(process: subprocess.Popen) -> None:
    """SIGKILL the child (unless it already exited), reap it, close its streams."""
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=TIMEOUT_S)
    process.stdout.close()
    process.errors.close()


def converted_with_a_kill(
    checkpoint: Path, dest: Path, pause: str, *, overwrite: bool = False
) -> tuple[Path, subprocess.Popen]:
    """Run the child until it reaches `pause`, SIGKILL it; return its staging directory and itself."""
    process = start(checkpoint, dest, pause, overwrite=overwrite)
    try:
        wait_for_line(process, "paused")
    finally:
        kill(process)
    assert process.returncode == -signal.SIGKILL
    return dest.parent / f".{dest.name}.tmp-{process.pid}", process


def assert_converts_again(
    checkpoint: Path, dest: Path, reference: dict[str, str], *, overwrite: bool
) -> None:
    store = flashlm.convert(checkpoint, dest, progress=False, overwrite=overwrite)
    assert store.num_layers == LAYERS
    assert tree(dest) == reference, "the store converted after the kill differs from an uninterrupted one"


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer", [0, 1, LAYERS // 2, LAYERS - 1])
def test_killed_while_writing_layers_leaves_no_store(checkpoint, reference, tmp_path, layer) -> None:
    dest = tmp_path / "out" / "store.flash"
    staging, _ = converted_with_a_kill(checkpoint, dest, f"layer-{layer}")

    # Killed midway: the staging directory holds exactly the layers before `layer`, and no manifest.
    written = sorted(p.name for p in (staging / "layers").iterdir())
    assert len(written) == GATED_FILES_PER_LAYER * layer
    assert all(name.startswith(tuple(f"{i:03d}." for i in range(layer))) for name in written)
    assert not (staging / "manifest.json").exists()

    # No store at the destination; the only trace is the hidden staging sibling, which is no store.
    assert not dest.exists()
    with pytest.raises(StoreNotFoundError):
        Store.open(dest)
    assert sorted(p.name for p in dest.parent.iterdir()) == [staging.name]
    with pytest.raises(StoreNotFoundError):
        Store.open(staging)

    assert_converts_again(checkpoint, dest, reference, overwrite=False)


def test_killed_before_the_rename_leaves_no_store(checkpoint, reference, tmp_path) -> None:
    """Killed with the staging directory complete (manifest written and fsynced) but not yet renamed."""
    dest = tmp_path / "out" / "store.flash"
    staging, _ = converted_with_a_kill(checkpoint, dest, "rename")
    assert (staging / "manifest.json").is_file()
    assert not dest.exists()
    assert sorted(p.name for p in dest.parent.iterdir()) == [staging.name]
    assert_converts_again(checkpoint, dest, reference, overwrite=False)


@pytest.mark.parametrize("layer", [0, LAYERS // 2])
def test_killed_overwrite_keeps_the_old_store(checkpoint, reference, old_store, tmp_path, layer) -> None:
    dest = tmp_path / "out" / "store.flash"
    dest.parent.mkdir()
    shutil.copytree(old_store, dest)
    before = tree(dest)
    staging, _ = converted_with_a_kill(checkpoint, dest, f"layer-{layer}", overwrite=True)

    assert tree(dest) == before, "the old store changed"
    assert Store.open(dest).num_layers == 2  # still the tiny llama's store, and valid
    assert sorted(p.name for p in dest.parent.iterdir()) == sorted([dest.name, staging.name])

    assert_converts_again(checkpoint, dest, reference, overwrite=True)


def test_killed_while_an_overwrite_moves_into_place_keeps_the_old_store(
    checkpoint, old_store, tmp_path
) -> None:
    dest = tmp_path / "out" / "store.flash"
    dest.parent.mkdir()
    shutil.copytree(old_store, dest)
    before = tree(dest)
    converted_with_a_kill(checkpoint, dest, "rename", overwrite=True)
    assert Store.open(dest).num_layers == 2
    assert tree(dest) == before


def test_killed_at_a_polled_point_then_loading_converts_again(checkpoint, reference, tmp_path) -> None:
    """A plain conversion, killed once its staging directory has a first row file on disk, as seen from
    outside; then loading the model with that store path converts it again and runs exactly."""
    dest = tmp_path / "out" / "store.flash"
    dest.parent.mkdir()
    process = start(checkpoint, dest, "none")
    staging = dest.parent / f".{dest.name}.tmp-{process.pid}"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and process.poll() is None:
            layers = staging / "layers"
            if layers.is_dir() and any(layers.iterdir()):
                break
            time.sleep(0.001)
    finally:
        kill(process)  # a no-op on a child that already exited
    assert process.returncode == -signal.SIGKILL, "the conversion ended before it could be killed midway"
    assert staging.is_dir() and not (staging / "manifest.json").exists()
    assert not dest.exists()

    config = flashlm.FlashConfig(store=str(dest), memory_budget="64MB")
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=config)
    assert tree(dest) == reference
    plain = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, plain(ids).logits)


def spawn(args: list[str]) -> subprocess.Popen:
    """Popen with stdout piped and stderr in a temporary file (`.errors`): a pipe nobody reads while
    waiting on stdout could fill up and block the child."""
    errors = tempfile.TemporaryFile()  # noqa: SIM115 (closed with the process)
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=errors, env=os.environ.copy())
    process.errors = errors
    return process


def stderr_of(process: subprocess.Popen) -> str:
    process.errors.seek(0)
    return process.errors.read().decode(errors="replace")
