"""The store: conversion round trips on every architecture family, the on-disk format, and the errors
that a missing, damaged or mismatched store raises."""

from __future__ import annotations

import errno
import filecmp
import importlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    FalconConfig,
    GPT2Config,
    LlamaConfig,
    OPTConfig,
    Phi3Config,
    PretrainedConfig,
)

from flashlm.arch import find_mlps, spec_for
from flashlm.errors import (
    StoreCorruptError,
    StoreMismatchError,
    StoreNotFoundError,
    UnsupportedArchitectureError,
)
from flashlm.store import (
    ALIGNMENT,
    KINDS,
    ModuleSource,
    RowFile,
    SafetensorsSource,
    Store,
    add_kinds,
    convert,
    mlp_content_sha256,
)

convert_module = importlib.import_module("flashlm.store.convert")  # the package's `convert` is the function

CONFIGS = {
    "llama": lambda: LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    ),
    "phi3": lambda: Phi3Config(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "opt": lambda: OPTConfig(
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=128,
        word_embed_proj_dim=32,
        max_position_embeddings=64,
    ),
    "falcon": lambda: FalconConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=128
    ),
}
GATED = {"llama", "phi3"}


@dataclass
class Checkpoint:
    model_type: str
    model: torch.nn.Module
    path: Path


@pytest.fixture(scope="module", autouse=True)
def _offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


def _build(config: PretrainedConfig, directory: Path, **save_kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    model.save_pretrained(directory, **save_kwargs)
    return model


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    directory = tmp_path_factory.mktemp(request.param)
    return Checkpoint(request.param, _build(CONFIGS[request.param](), directory), directory)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Checkpoint:
    directory = tmp_path_factory.mktemp("llama")
    return Checkpoint("llama", _build(CONFIGS["llama"](), directory), directory)


@pytest.fixture(scope="module", params=sorted(GATED))
def gated(request, tmp_path_factory) -> Checkpoint:
    """A gated checkpoint: llama (separate gate and up) and phi3 (fused gate_up)."""
    directory = tmp_path_factory.mktemp(f"gated-{request.param}")
    return Checkpoint(request.param, _build(CONFIGS[request.param](), directory), directory)


def all_kinds(model_type: str) -> tuple[str, ...]:
    return KINDS if model_type in GATED else ("up", "down", "bundle")


def default_kinds(model_type: str) -> tuple[str, ...]:
    return ("gate", "up", "down") if model_type in GATED else ("up", "down")


def expected_rows(model: torch.nn.Module, layer: int, kind: str) -> torch.Tensor:
    """The matrix a store should hold, built row by row from the model's own linears."""
    spec = spec_for(model.config.model_type)
    owner = find_mlps(model, spec)[layer][2]
    down = getattr(owner, spec.down).weight.detach()
    d_ff = down.shape[1]
    if spec.gate_up is not None:
        fused = getattr(owner, spec.gate_up).weight.detach()
        gate, up = fused[:d_ff], fused[d_ff:]
    else:
        up = getattr(owner, spec.up).weight.detach()
        gate = getattr(owner, spec.gate).weight.detach() if spec.gate else None
    if kind == "dip_in":
        return torch.stack([torch.cat([up[:, i], gate[:, i]]) for i in range(down.shape[0])])
    if kind == "down":
        return torch.stack([down[i] for i in range(down.shape[0])])
    row = {
        "bundle": (lambda j: [up[j], down[:, j]])
        if gate is None
        else (lambda j: [gate[j], up[j], down[:, j]]),
        "dip_down": lambda j: [down[:, j]],
        "gate": lambda j: [gate[j]],
        "up": lambda j: [up[j]],
        "gate_down": lambda j: [gate[j], down[:, j]],
        "up_down": lambda j: [up[j], down[:, j]],
    }[kind]
    return torch.stack([torch.cat(row(j)) for j in range(d_ff)])


def read_rows(row_file: RowFile, ids: list[int]) -> torch.Tensor:
    """Rows read straight from the file at the offsets `RowFile` gives, as the reader would."""
    chunks = []
    with open(row_file.path, "rb") as f:
        for i in ids:
            f.seek(row_file.data_offset + i * row_file.row_bytes)
            chunks.append(f.read(row_file.row_bytes))
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=row_file.dtype).view(len(ids), row_file.width)


def test_round_trip(checkpoint: Checkpoint, tmp_path: Path) -> None:
    kinds = all_kinds(checkpoint.model_type)
    store = convert(checkpoint.path, tmp_path / "store", kinds=kinds[::-1], progress=False)
    config = checkpoint.model.config
    gated = checkpoint.model_type in GATED
    assert store.model_type == checkpoint.model_type
    assert store.gated is gated
    assert store.kinds == kinds
    assert store.kinds == (
        ("gate", "up", "down", "bundle", "dip_in", "dip_down", "gate_down", "up_down")
        if gated
        else ("up", "down", "bundle")
    )
    assert store.num_layers == config.num_hidden_layers
    assert store.d_model == config.hidden_size
    assert store.dtype == torch.bfloat16
    assert store.manifest["format"] == "flashlm-store"
    assert store.manifest["format_version"] == 1
    generator = torch.Generator().manual_seed(0)
    for kind in store.kinds:
        for layer in range(store.num_layers):
            expected = expected_rows(checkpoint.model, layer, kind)
            row_file = store.row_file(layer, kind)
            assert row_file.data_offset % ALIGNMENT == 0
            assert (row_file.rows, row_file.width) == tuple(expected.shape)
            with safe_open(row_file.path, framework="pt") as f:
                assert list(f.keys()) == ["rows"]
                assert torch.equal(f.get_tensor("rows"), expected)
            ids = torch.randperm(row_file.rows, generator=generator)[:7].tolist()
            assert torch.equal(read_rows(row_file, ids), expected[ids])
        assert store.nbytes(kind) == sum(f.nbytes for f in store.row_files(kind).values())


def test_convert_writes_the_dense_kinds_by_default(checkpoint: Checkpoint, tmp_path: Path) -> None:
    store = convert(checkpoint.path, tmp_path / "store", progress=False)
    kinds = default_kinds(checkpoint.model_type)
    assert store.kinds == kinds
    assert list(store.manifest["kinds"]) == list(kinds)
    names = sorted(p.name for p in (store.path / "layers").iterdir())
    assert names == sorted(
        f"{layer:03d}.{kind}.safetensors" for layer in range(store.num_layers) for kind in kinds
    )
    assert store.nbytes() == sum(store.nbytes(kind) for kind in kinds)


def test_resident_biases(checkpoint: Checkpoint, tmp_path: Path) -> None:
    store = convert(checkpoint.path, tmp_path / "store", progress=False)
    spec = spec_for(checkpoint.model_type)
    for layer, _, owner in find_mlps(checkpoint.model, spec):
        up_bias = getattr(owner, spec.up).bias
        resident = store.resident(layer)
        if up_bias is None:
            assert resident == {}
            assert not store.has_bias
        else:
            assert store.has_bias
            assert torch.equal(resident["up_bias"], up_bias.detach())
            assert torch.equal(resident["down_bias"], getattr(owner, spec.down).bias.detach())


def test_module_and_checkpoint_give_the_same_store(checkpoint: Checkpoint, tmp_path: Path) -> None:
    from_disk = convert(checkpoint.path, tmp_path / "disk", progress=False)
    from_module = convert(checkpoint.model, tmp_path / "module", progress=False)
    assert from_disk.content_sha256 == from_module.content_sha256
    assert from_disk.content_sha256 == mlp_content_sha256(ModuleSource(checkpoint.model))
    assert from_disk.content_sha256 == mlp_content_sha256(SafetensorsSource(checkpoint.path))
    assert from_disk.fingerprint == SafetensorsSource(checkpoint.path).fingerprint()
    assert from_module.fingerprint is None
    for relative in from_disk.manifest["files"]:
        assert filecmp.cmp(from_disk.path / relative, from_module.path / relative, shallow=False)


def test_other_weights_in_the_same_shapes_get_another_fingerprint(
    checkpoint: Checkpoint, tmp_path: Path
) -> None:
    # A pruned or fused copy has the same file names, sizes and headers: only the weights differ.
    import os
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(checkpoint.path, copy)  # copies modification times: the same checkpoint
    assert SafetensorsSource(copy).fingerprint() == SafetensorsSource(checkpoint.path).fingerprint()
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # another value in the last weight, written later
    weights.write_bytes(bytes(data))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert SafetensorsSource(copy).fingerprint() != SafetensorsSource(checkpoint.path).fingerprint()


def test_sharded_checkpoint_converts_identically(checkpoint: Checkpoint, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    checkpoint.model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    whole = convert(checkpoint.path, tmp_path / "whole.flash", progress=False)
    split = convert(sharded, tmp_path / "split.flash", progress=False)
    assert split.content_sha256 == whole.content_sha256
    assert split.fingerprint != whole.fingerprint
    for relative in whole.manifest["files"]:
        assert filecmp.cmp(whole.path / relative, split.path / relative, shallow=False)


@pytest.mark.parametrize("dtype", [torch.float32, "float16"])
def test_dtype_conversion(llama: Checkpoint, tmp_path: Path, dtype) -> None:
    store = convert(llama.path, tmp_path / "store", dtype=dtype, progress=False)
    target = torch.float32 if dtype == torch.float32 else torch.float16
    assert store.dtype == target
    assert store.manifest["dtype"] == str(target).removeprefix("torch.")
    assert store.content_sha256 == mlp_content_sha256(ModuleSource(llama.model), target)
    assert store.content_sha256 != mlp_content_sha256(ModuleSource(llama.model))
    for kind in store.kinds:
        row_file = store.row_file(1, kind)
        assert row_file.row_bytes == row_file.width * target.itemsize
        with safe_open(row_file.path, framework="pt") as f:
            assert torch.equal(f.get_tensor("rows"), expected_rows(llama.model, 1, kind).to(target))


def test_kind_subset(llama: Checkpoint, tmp_path: Path) -> None:
    store = convert(llama.path, tmp_path / "store", kinds=["dip_down", "dip_in"], progress=False)
    assert store.kinds == ("dip_in", "dip_down")
    with pytest.raises(ValueError, match="dip_in, dip_down") as info:
        store.row_file(0, "bundle")
    assert "flashlm.store.add_kinds(store, ['bundle'])" in str(info.value)
    with pytest.raises(ValueError, match="out of range"):
        store.row_file(2, "dip_in")


def test_dip_kinds_need_a_gated_mlp(tmp_path: Path) -> None:
    model = _build(CONFIGS["opt"](), tmp_path / "opt")
    with pytest.raises(ValueError, match="valid kinds: up, down, bundle"):
        convert(model, tmp_path / "store", kinds=["dip_in"], progress=False)
    assert not (tmp_path / "store").exists()


def test_progress_bar(llama: Checkpoint, tmp_path: Path, capsys) -> None:
    convert(llama.path, tmp_path / "store")
    assert "Converting to flashlm store" in capsys.readouterr().err


class FailingSource(SafetensorsSource):
    """A checkpoint whose reads fail once conversion reaches layer 1."""

    def get(self, name: str) -> torch.Tensor:
        if ".1." in name:
            raise RuntimeError("disk on fire")
        return super().get(name)


def test_failure_leaves_nothing_behind(llama: Checkpoint, tmp_path: Path) -> None:
    parent = tmp_path / "stores"
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert(FailingSource(llama.path), parent / "store", progress=False)
    assert list(parent.iterdir()) == []


def test_failed_overwrite_keeps_the_old_store(llama: Checkpoint, tmp_path: Path) -> None:
    dest = tmp_path / "store"
    old = convert(llama.path, dest, progress=False)
    with pytest.raises(RuntimeError, match="disk on fire"):
        convert(FailingSource(llama.path), dest, overwrite=True, progress=False)
    assert Store.open(dest).manifest == old.manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]


def test_existing_destination(llama: Checkpoint, tmp_path: Path) -> None:
    dest = tmp_path / "store"
    convert(llama.path, dest, kinds=["dip_in"], progress=False)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        convert(llama.path, dest, progress=False)
    assert Store.open(dest).kinds == ("dip_in",)
    assert convert(llama.path, dest, overwrite=True, progress=False).kinds == ("gate", "up", "down")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(FileExistsError, match="not a flashlm store"):
        convert(llama.path, precious, overwrite=True, progress=False)
    assert (precious / "thesis.tex").read_text() == "years of work"


@pytest.fixture
def store_path(llama: Checkpoint, tmp_path: Path) -> Path:
    return convert(llama.path, tmp_path / "store", kinds=KINDS, progress=False).path


def tree(path: Path) -> dict[str, bytes]:
    """Every file under `path` (hidden ones included) by relative path, with its bytes."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "kinds", [("dip_in", "dip_down"), ("up_down", "gate"), ("gate_down", "up"), KINDS], ids=str
)
def test_add_kinds_matches_convert(gated: Checkpoint, tmp_path: Path, kinds: tuple[str, ...]) -> None:
    base = convert(gated.path, tmp_path / "added", progress=False)
    added = add_kinds(base, kinds[::-1], progress=False)
    direct = convert(gated.path, tmp_path / "direct", kinds=("gate", "up", "down", *kinds), progress=False)
    assert added.kinds == direct.kinds == tuple(k for k in KINDS if k in ("gate", "up", "down") or k in kinds)
    assert added.manifest["kinds"] == direct.manifest["kinds"]
    assert added.manifest["files"] == direct.manifest["files"]
    assert list(added.manifest["files"]) == list(direct.manifest["files"])
    assert added.manifest["source"] == direct.manifest["source"] == base.manifest["source"]
    assert tree(added.path) == tree(direct.path)
    assert Store.open(added.path).kinds == added.kinds
    for kind in added.kinds:
        with safe_open(added.row_file(1, kind).path, framework="pt") as f:
            assert torch.equal(f.get_tensor("rows"), expected_rows(gated.model, 1, kind))


def test_add_kinds_one_at_a_time(gated: Checkpoint, tmp_path: Path) -> None:
    store = convert(gated.path, tmp_path / "added", dtype=torch.float32, progress=False)
    for kind in reversed(KINDS):
        store = add_kinds(store, [kind], progress=False)
    direct = convert(gated.path, tmp_path / "direct", dtype=torch.float32, kinds=KINDS, progress=False)
    assert store.kinds == KINDS
    assert store.manifest == direct.manifest
    assert tree(store.path) == tree(direct.path)


def test_add_kinds_is_idempotent(llama: Checkpoint, tmp_path: Path) -> None:
    store = add_kinds(convert(llama.path, tmp_path / "store", progress=False), ["dip_in"], progress=False)
    before = tree(store.path)
    assert add_kinds(store, ["dip_in"], progress=False) is store
    assert add_kinds(store, "gate", progress=False) is store
    assert add_kinds(store, [], progress=False) is store
    # A stale `Store` (another process added the kind meanwhile) also finds it present.
    stale = Store.open(store.path)
    stale.kinds = ("gate", "up", "down")
    assert add_kinds(stale, ["dip_in"], progress=False).kinds == ("gate", "up", "down", "dip_in")
    assert tree(store.path) == before


def test_add_kinds_progress_bar(llama: Checkpoint, tmp_path: Path, capsys) -> None:
    store = convert(llama.path, tmp_path / "store", progress=False)
    add_kinds(store, ["dip_down", "dip_in"])
    assert "Adding dip_in, dip_down to store" in capsys.readouterr().err


def test_add_kinds_needs_a_gated_mlp(tmp_path: Path) -> None:
    model = _build(CONFIGS["opt"](), tmp_path / "opt")
    store = convert(model, tmp_path / "store", progress=False)
    before = tree(store.path)
    for kind in ("dip_in", "up_down", "gate"):
        with pytest.raises(ValueError, match=rf"Cannot write unit kinds \['{kind}'\].*valid kinds: up, down"):
            add_kinds(store, ["bundle", kind], progress=False)
    with pytest.raises(ValueError, match="'nonsense'"):
        add_kinds(store, ["nonsense"], progress=False)
    assert tree(store.path) == before


def test_add_kinds_needs_a_whole_mlp(llama: Checkpoint, tmp_path: Path) -> None:
    store = convert(llama.path, tmp_path / "store", kinds=["dip_in", "gate"], progress=False)
    assert add_kinds(store, ["dip_in"], progress=False) is store
    with pytest.raises(StoreMismatchError, match="flashlm convert --kinds") as info:
        add_kinds(store, ["down"], progress=False)
    assert "do not hold every weight of the MLP" in str(info.value)
    assert "kinds=[...]" in str(info.value)


@pytest.mark.parametrize("source", [("dip_in", "dip_down"), ("bundle",), ("up", "gate_down")], ids=str)
def test_add_kinds_derives_from_any_whole_mlp(llama: Checkpoint, tmp_path: Path, source) -> None:
    store = convert(llama.path, tmp_path / "store", kinds=source, progress=False)
    added = add_kinds(store, ["gate", "up", "down"], progress=False)
    for kind in ("gate", "up", "down"):
        with safe_open(added.row_file(1, kind).path, framework="pt") as f:
            assert torch.equal(f.get_tensor("rows"), expected_rows(llama.model, 1, kind))


@pytest.mark.parametrize("fails", ["write_aligned_safetensors", "fsync_dir"])
def test_failed_add_kinds_leaves_the_store_unchanged(
    llama: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails: str
) -> None:
    """A failure writing the second file, or once every file is renamed into place (before the manifest
    is replaced), leaves the store as it was: same files, same manifest, no strays."""
    store = convert(llama.path, tmp_path / "store", progress=False)
    before = tree(store.path)
    original = getattr(convert_module, fails)
    calls = []

    def flaky(*args, **kwargs):
        calls.append(args)
        if len(calls) == (2 if fails == "write_aligned_safetensors" else 1):
            raise RuntimeError("disk on fire")
        return original(*args, **kwargs)

    monkeypatch.setattr(convert_module, fails, flaky)
    with pytest.raises(RuntimeError, match="disk on fire"):
        add_kinds(store, ["dip_in", "dip_down"], progress=False)
    assert tree(store.path) == before
    assert Store.open(store.path).kinds == ("gate", "up", "down")
    monkeypatch.undo()
    added = add_kinds(store, ["dip_in", "dip_down"], progress=False)
    assert added.kinds == ("gate", "up", "down", "dip_in", "dip_down")


def test_add_kinds_os_error_says_the_store_is_unchanged(
    llama: Checkpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = convert(llama.path, tmp_path / "store", progress=False)
    before = tree(store.path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(convert_module, "write_aligned_safetensors", full)
    with pytest.raises(
        OSError, match=r"Cannot add unit kinds dip_in, up_down to the store .* is unchanged"
    ) as info:
        add_kinds(store, ["up_down", "dip_in"], progress=False)
    assert info.value.errno == errno.ENOSPC
    assert tree(store.path) == before


def test_missing_store(tmp_path: Path) -> None:
    with pytest.raises(StoreNotFoundError, match="flashlm convert"):
        Store.open(tmp_path / "nowhere")


def test_deleted_manifest(store_path: Path) -> None:
    (store_path / "manifest.json").unlink()
    with pytest.raises(StoreNotFoundError, match="flashlm convert"):
        Store.open(store_path)


def test_unreadable_manifest(store_path: Path) -> None:
    (store_path / "manifest.json").write_text('{"format": "flashlm-store", "format_ver')
    with pytest.raises(StoreCorruptError, match="Delete the store"):
        Store.open(store_path)


def _edit_manifest(store_path: Path, **changes) -> None:
    manifest = json.loads((store_path / "manifest.json").read_text())
    manifest.update(changes)
    (store_path / "manifest.json").write_text(json.dumps(manifest))


def test_other_format_version(store_path: Path) -> None:
    _edit_manifest(store_path, format_version=2)
    with pytest.raises(StoreCorruptError, match="format version 2"):
        Store.open(store_path)


def test_truncated_file(store_path: Path) -> None:
    row_file = store_path / "layers" / "001.bundle.safetensors"
    os.truncate(row_file, row_file.stat().st_size - 100)
    with pytest.raises(StoreCorruptError, match="truncated"):
        Store.open(store_path)


def test_missing_file(store_path: Path) -> None:
    (store_path / "layers" / "000.dip_in.safetensors").unlink()
    with pytest.raises(StoreCorruptError, match=r"lacks layers/000\.dip_in"):
        Store.open(store_path)


def test_header_that_does_not_match(store_path: Path) -> None:
    # Same size, but the matrix is declared with another shape.
    row_file = store_path / "layers" / "000.dip_down.safetensors"
    data = bytearray(row_file.read_bytes())
    data[8:ALIGNMENT] = data[8:ALIGNMENT].replace(b'"shape":[96,64]', b'"shape":[64,96]')
    assert data != row_file.read_bytes()
    row_file.write_bytes(bytes(data))
    with pytest.raises(StoreCorruptError, match="does not hold"):
        Store.open(store_path)


def test_check_matches(llama: Checkpoint, store_path: Path) -> None:
    store = Store.open(store_path)
    source = SafetensorsSource(llama.path)
    store.check_matches(
        model_type="llama",
        num_layers=2,
        d_model=64,
        d_ff=96,
        fingerprint=source.fingerprint(),
        content_sha256=mlp_content_sha256(source),
    )
    with pytest.raises(StoreMismatchError) as info:
        store.check_matches(model_type="opt", d_model=64, d_ff=128)
    message = str(info.value)
    assert "model_type: store has 'llama', expected 'opt'" in message
    assert "d_ff: store has 96, expected 128" in message
    assert "d_model" not in message
    assert "store=" in message
    with pytest.raises(StoreMismatchError, match="fingerprint"):
        store.check_matches(fingerprint="0" * 64)
    with pytest.raises(StoreMismatchError, match="content_sha256"):
        store.check_matches(content_sha256="0" * 64)


def test_module_store_skips_fingerprint_check(llama: Checkpoint, tmp_path: Path) -> None:
    store = convert(llama.model, tmp_path / "store", progress=False)
    store.check_matches(fingerprint="0" * 64)


def test_unsupported_architecture(tmp_path: Path) -> None:
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    model = _build(config, tmp_path / "gpt2")
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        convert(tmp_path / "gpt2", tmp_path / "store", progress=False)
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        convert(model, tmp_path / "store", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2"]


def test_multimodal_config_uses_the_text_model_type(tmp_path: Path) -> None:
    config = {"model_type": "llava", "text_config": {"model_type": "llama"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"x": torch.zeros(2)}, tmp_path / "model.safetensors")
    source = SafetensorsSource(tmp_path)
    assert source.model_type == "llama"
    assert source.names() == ["x"]


def test_checkpoint_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match=r"No model\.safetensors"):
        SafetensorsSource(tmp_path)
