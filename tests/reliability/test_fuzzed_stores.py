"""A deterministic corpus of damaged stores (issue 15, item 6): fuzzed safetensors headers of the row
files and of `resident.safetensors`, fuzzed `manifest.json` (text and structure), missing and replaced
files, and files damaged after the store was opened.

The contract each case checks: opening the store, reading every row through a `StoreReader`, reading
the resident biases and running a patched model on it either all succeed with the original data
(same rows, same biases, the same logits as the unpatched model), or raise a `FlashLMError` whose
message names the store. Never a bare `KeyError`, `ValueError`, `TypeError`, `JSONDecodeError`,
`struct.error`, `RecursionError` ... and never wrong data.

The corpus found 135 cases that broke the contract (unbounded header lengths, deeply nested or
over-long JSON, unchecked layouts, file entries and resident biases, a dropped bias file, dimensions
and families contradicting the layouts); `flashlm.store` now refuses each of them.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model
from safetensors import safe_open

import flashlm
from flashlm.errors import FlashLMError, StoreCorruptError
from flashlm.store import ALIGNMENT, Store, StoreReader

SEED = 15_06
"""Seeds every random choice of the corpus (issue 15, item 6); per-category generators derive from it."""
BASES = ("llama", "opt")
"""Tiny models the pristine stores come from: a gated MLP (gate/up/down files) and a plain MLP with
biases (up/down files plus `resident.safetensors`)."""
BUDGET = "16MB"
"""Holds every unit of a tiny model (a budget is not what these tests are about)."""

DESCRIPTION = ("model_type", "family", "num_layers", "d_model", "d_ff", "gated", "has_bias", "dtype", "kinds")
"""What a store says of itself (`Store` attributes): an opened store must say what the original said."""

# --------------------------------------------------------------------------------------------------
# Pristine stores and what reading them must give
# --------------------------------------------------------------------------------------------------


@dataclass
class Base:
    name: str
    path: Path
    rows: dict[tuple[int, str], torch.Tensor]
    resident: dict[int, dict[str, torch.Tensor]]
    ids: torch.Tensor
    logits: torch.Tensor
    description: dict[str, object]


def tiny_model(name: str) -> torch.nn.Module:
    """The tiny float32 model of `name`, with random (not zero) biases so that losing them shows."""
    model = build_tiny_model(name, torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if parameter_name.endswith("bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model


def make_bases(root: Path) -> dict[str, Base]:
    """Convert each base's tiny model into `root/<name>` and record what reading it must give."""
    made = {}
    for name in BASES:
        model = tiny_model(name)
        path = root / name
        flashlm.convert(model, path, progress=False)
        store = Store.open(path)
        rows = {}
        for kind in store.kinds:
            for layer, row_file in store.row_files(kind).items():
                # Read with safetensors itself: the reference does not go through flashlm's reader.
                with safe_open(row_file.path, framework="pt") as f:
                    rows[layer, kind] = f.get_tensor("rows")
        resident = {layer: store.resident(layer) for layer in range(store.num_layers)}
        ids = torch.randint(3, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            logits = model(ids).logits
        description = {attribute: getattr(store, attribute) for attribute in DESCRIPTION}
        made[name] = Base(name, path, rows, resident, ids, logits, description)
    assert all(bias.abs().min() > 0 for bias in made["opt"].resident[0].values()), "nonzero biases expected"
    return made


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Base]:
    return make_bases(tmp_path_factory.mktemp("pristine"))


def exercise(path: Path, base: Base, case: Case) -> None:
    """Open the store, read every row through `StoreReader`s, run a model patched onto it, read the
    resident biases, and assert that each gives the original (rows, logits, biases, then the store's
    description of itself).

    `case.apply` runs at `case.stage`: before opening, after `Store.open`, or after the readers have
    opened their files.
    """
    if case.stage == "before":
        case.apply(path)
    store = Store.open(path)
    if case.stage == "after_open":
        case.apply(path)
    # A store that lists no layers has no files to read (the patched model then refuses it).
    readers = {kind: StoreReader(store.row_files(kind)) for kind in store.kinds if store.num_layers > 0}
    try:
        if case.stage == "after_reader":
            case.apply(path)
        for kind, reader in readers.items():
            for layer, row_file in store.row_files(kind).items():
                expected = base.rows.get((layer, kind))
                assert expected is not None, f"the store serves {kind!r} rows of layer {layer} it never had"
                out = torch.full((row_file.rows, row_file.width), float("nan"), dtype=row_file.dtype)
                reader.read(layer, torch.arange(row_file.rows), out)
                assert torch.equal(out, expected), f"wrong rows served for layer {layer}, {kind!r}"
    finally:
        for reader in readers.values():
            reader.close()

    model = tiny_model(base.name)
    flashlm.patch(model, flashlm.FlashConfig(store=str(path), memory_budget=BUDGET), progress=False)
    with torch.inference_mode():
        logits = model(base.ids).logits
    assert torch.equal(logits, base.logits), "the patched model computes other logits than the original"

    for layer in range(store.num_layers):
        resident = store.resident(layer)
        expected = base.resident[layer]
        assert resident.keys() == expected.keys(), f"layer {layer}: biases {sorted(resident)}"
        assert all(torch.equal(resident[k], expected[k]) for k in expected), f"wrong biases, layer {layer}"

    described = {name: getattr(store, name) for name in DESCRIPTION}
    assert described == base.description, "the store opened, and is used, with another description"


# --------------------------------------------------------------------------------------------------
# The corpus
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    id: str
    base: str
    apply: Callable[[Path], None]
    stage: str = "before"  # "before" opening, "after_open", "after_reader"


def _rng(*parts: object) -> random.Random:
    """A generator for one category of cases: adding a category never shifts another's draws."""
    return random.Random("-".join(map(str, (SEED, *parts))))


def _edit_bytes(relative: str, edit: Callable[[bytearray], bytearray | None]) -> Callable[[Path], None]:
    def apply(store: Path) -> None:
        file = store / relative
        data = bytearray(file.read_bytes())
        result = edit(data)
        file.write_bytes(bytes(data if result is None else result))

    return apply


def _header_bounds(data: bytes) -> tuple[int, int]:
    """(end of the JSON, start of the data) of a pristine flashlm safetensors file."""
    (length,) = struct.unpack("<Q", data[:8])
    return 8 + len(data[8 : 8 + length].rstrip(b" ")), 8 + length


def _flip(positions: Callable[[bytearray], list[tuple[int, int]]]) -> Callable[[bytearray], None]:
    def edit(data: bytearray) -> None:
        for byte, bit in positions(data):
            data[byte] ^= 1 << bit

    return edit


def _replace_header(new: Callable[[dict], bytes]) -> Callable[[bytearray], bytearray]:
    """Put `new(parsed header)` in place of the JSON, padded with spaces to keep the data where it was
    (when it fits; a longer header moves the data, as a rewriting tool would)."""

    def edit(data: bytearray) -> bytearray:
        _, data_start = _header_bounds(data)
        header = json.loads(data[8:data_start])
        raw = new(header)
        if len(raw) < data_start - 8:
            raw += b" " * (data_start - 8 - len(raw))
        return bytearray(struct.pack("<Q", len(raw)) + raw + data[data_start:])

    return edit


def _json(value: object) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def _with(tensor_edit: Callable[[dict], None], name: str | None = None) -> Callable[[dict], bytes]:
    """A header with one tensor entry edited in place (`name`: the first tensor by default)."""

    def new(header: dict) -> bytes:
        entry = header[name or next(k for k in header if k != "__metadata__")]
        tensor_edit(entry)
        return _json(header)

    return new


def _set(key: str, value: object) -> Callable[[dict], None]:
    def edit(entry: dict) -> None:
        entry[key] = value(entry) if callable(value) else value

    return edit


def _delete(key: str) -> Callable[[dict], None]:
    return lambda entry: entry.pop(key)


def _nbytes(entry: dict) -> int:
    return entry["data_offsets"][1] - entry["data_offsets"][0]


DEEP = b"[" * 2000 + b"]" * 2000
"""Nesting deeper than `json`'s recursion limit, short enough for a 4088-byte header."""
LONG_INT = b"9" * 5000
"""An integer literal longer than Python's int-parsing limit (4300 digits)."""


def header_cases(base: str, relative: str) -> list[tuple[str, Callable[[Path], None]]]:
    """Damaged safetensors headers of one file: truncations, length prefixes, bit flips, garbage, and
    well-formed JSON that says the wrong thing."""
    cases: list[tuple[str, Callable[[bytearray], object]]] = []

    def truncate(size: Callable[[bytearray], int]) -> Callable[[bytearray], bytearray]:
        return lambda data: data[: size(data)]

    for label, size in {
        "empty": lambda d: 0,
        "4B": lambda d: 4,
        "7B": lambda d: 7,
        "prefix-only": lambda d: 8,
        "9B": lambda d: 9,
        "mid-json": lambda d: (8 + _header_bounds(d)[0]) // 2,
        "json-end": lambda d: _header_bounds(d)[0],
        "in-padding": lambda d: _header_bounds(d)[1] - 1,
        "header-only": lambda d: _header_bounds(d)[1],
        "one-data-byte": lambda d: _header_bounds(d)[1] + 1,
        "last-byte-lost": lambda d: len(d) - 1,
    }.items():
        cases.append((f"truncate-{label}", truncate(size)))

    def prefix(value: Callable[[bytearray], int]) -> Callable[[bytearray], None]:
        def edit(data: bytearray) -> None:
            data[:8] = struct.pack("<Q", value(data) % 2**64)

        return edit

    for label, value in {
        "0": lambda d: 0,
        "1": lambda d: 1,
        "2": lambda d: 2,
        "json-1": lambda d: _header_bounds(d)[0] - 9,
        "json": lambda d: _header_bounds(d)[0] - 8,
        "header-1": lambda d: _header_bounds(d)[1] - 9,
        "header+1": lambda d: _header_bounds(d)[1] - 7,
        "header+4096": lambda d: _header_bounds(d)[1] - 8 + ALIGNMENT,
        "file-size": lambda d: len(d),
        "file-size-7": lambda d: len(d) - 7,
        "2^62": lambda d: 2**62,
        "2^63": lambda d: 2**63,
        "2^64-1": lambda d: 2**64 - 1,
    }.items():
        cases.append((f"length-{label}", prefix(value)))

    rng = _rng("header", base, relative)
    for i in range(6):
        # Low bytes (a length within the file) or high ones (past any address space): a flip in between
        # asks for gigabytes, which a machine may or may not grant.
        byte, bit = rng.choice((0, 1, 6, 7)), rng.randrange(8)
        cases.append((f"flip-prefix-{i}", _flip(lambda d, byte=byte, bit=bit: [(byte, bit)])))
    for i in range(16):
        at, bit = rng.random(), rng.randrange(8)
        cases.append(
            (
                f"flip-json-{i}",
                _flip(lambda d, at=at, bit=bit: [(8 + int(at * (_header_bounds(d)[0] - 8)), bit)]),
            )
        )
    for i in range(4):
        draws = [(rng.random(), rng.randrange(8)) for _ in range(3)]
        cases.append(
            (
                f"flip3-json-{i}",
                _flip(
                    lambda d, draws=draws: [(8 + int(at * (_header_bounds(d)[0] - 8)), b) for at, b in draws]
                ),
            )
        )
    for i in range(4):
        at, bit = rng.random(), rng.randrange(8)

        def padding(d: bytearray, at: float = at, bit: int = bit) -> list[tuple[int, int]]:
            json_end, data_start = _header_bounds(d)
            return [(json_end + int(at * (data_start - json_end)), bit)]

        cases.append((f"flip-padding-{i}", _flip(padding)))

    def garbage(fill: Callable[[int], bytes], start: int = 8) -> Callable[[bytearray], None]:
        def edit(data: bytearray) -> None:
            json_end, _ = _header_bounds(data)
            data[start:json_end] = fill(json_end - start)

        return edit

    for i in range(2):
        seed = rng.getrandbits(32)
        cases.append((f"garbage-json-{i}", garbage(lambda n, seed=seed: random.Random(seed).randbytes(n))))
        cases.append(
            (f"garbage-whole-header-{i}", garbage(lambda n, seed=seed: random.Random(seed).randbytes(n), 0))
        )
    cases.append(("zeros-json", garbage(lambda n: bytes(n))))
    cases.append(("ff-json", garbage(lambda n: b"\xff" * n)))

    texts: dict[str, Callable[[dict], bytes]] = {
        "list": lambda h: b"[]",
        "string": lambda h: b'"rows"',
        "null": lambda h: b"null",
        "number": lambda h: b"0",
        "empty-object": lambda h: b"{}",
        "deep-nesting": lambda h: DEEP,
        "long-int": lambda h: b'{"x":' + LONG_INT + b"}",
        "nan": lambda h: b"NaN",
        "bom": lambda h: b"\xef\xbb\xbf" + _json(h),
        "utf16": lambda h: _json(h).decode().encode("utf-16"),
        "invalid-utf8-key": lambda h: _json(h).replace(b'"dtype"', b'"dty\xffe"', 1),
        "metadata-junk": lambda h: _json({"__metadata__": 5, **h}),
        "metadata-ok": lambda h: _json({"__metadata__": {"format": "pt"}, **h}),
        "duplicate-key-bad-first": lambda h: b'{"' + next(iter(h)).encode() + b'":5,' + _json(h)[1:],
        "extra-tensor": lambda h: _json(
            {**h, "extra": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}
        ),
        "first-tensor-renamed": lambda h: _json(
            {(k + "_renamed" if i == 0 else k): v for i, (k, v) in enumerate(h.items())}
        ),
        "first-tensor-dropped": lambda h: _json(dict(list(h.items())[1:])),
        "first-entry-null": lambda h: _json(
            {k: (None if i == 0 else v) for i, (k, v) in enumerate(h.items())}
        ),
        "first-entry-list": lambda h: _json({k: ([] if i == 0 else v) for i, (k, v) in enumerate(h.items())}),
        "first-entry-string": lambda h: _json(
            {k: ("x" if i == 0 else v) for i, (k, v) in enumerate(h.items())}
        ),
    }
    entry_edits: dict[str, Callable[[dict], None]] = {
        "dtype-F16": _set("dtype", "F16"),
        "dtype-BF16": _set("dtype", "BF16"),
        "dtype-F64": _set("dtype", "F64"),
        "dtype-I8": _set("dtype", "I8"),
        "dtype-unknown": _set("dtype", "XX"),
        "dtype-number": _set("dtype", 5),
        "dtype-null": _set("dtype", None),
        "dtype-missing": _delete("dtype"),
        "shape-swapped": _set("shape", lambda e: e["shape"][::-1]),
        "shape-1d": _set("shape", lambda e: [e["shape"][0] * (e["shape"][1] if len(e["shape"]) > 1 else 1)]),
        "shape-3d": _set("shape", lambda e: [*e["shape"], 1]),
        "shape-negative": _set("shape", lambda e: [-e["shape"][0], *e["shape"][1:]]),
        "shape-plus-one": _set("shape", lambda e: [e["shape"][0] + 1, *e["shape"][1:]]),
        "shape-string": _set("shape", lambda e: [str(e["shape"][0]), *e["shape"][1:]]),
        "shape-float": _set("shape", lambda e: [float(e["shape"][0]), *e["shape"][1:]]),
        "shape-bool": _set("shape", lambda e: [True, *e["shape"][1:]]),
        "shape-huge": _set("shape", lambda e: [2**64, *e["shape"][1:]]),
        "shape-empty": _set("shape", []),
        "shape-null": _set("shape", None),
        "shape-missing": _delete("shape"),
        "offsets-short": _set("data_offsets", lambda e: [0, _nbytes(e) - 1]),
        "offsets-long": _set("data_offsets", lambda e: [0, _nbytes(e) + 1]),
        "offsets-shifted": _set(
            "data_offsets", lambda e: [e["data_offsets"][0] + 1, e["data_offsets"][1] + 1]
        ),
        "offsets-negative": _set("data_offsets", lambda e: [-1, e["data_offsets"][1] - 1]),
        "offsets-reversed": _set("data_offsets", lambda e: e["data_offsets"][::-1]),
        "offsets-one": _set("data_offsets", lambda e: e["data_offsets"][:1]),
        "offsets-string": _set("data_offsets", lambda e: [e["data_offsets"][0], str(e["data_offsets"][1])]),
        "offsets-huge": _set("data_offsets", lambda e: [e["data_offsets"][0], 2**64]),
        "offsets-null": _set("data_offsets", None),
        "offsets-missing": _delete("data_offsets"),
    }
    for label, new in texts.items():
        cases.append((f"header-{label}", _replace_header(new)))
    for label, entry_edit in entry_edits.items():
        cases.append((f"entry-{label}", _replace_header(_with(entry_edit))))
    if relative == "resident.safetensors":
        # The biases of the last layer are listed last: damage the entry of another tensor than the first.
        for label in ("dtype-F16", "shape-plus-one", "offsets-shifted", "offsets-long"):
            cases.append(
                (
                    f"last-entry-{label}",
                    _replace_header(lambda h, e=entry_edits[label]: _with(e, list(h)[-1])(h)),
                )
            )

    short = relative.removeprefix("layers/").removesuffix(".safetensors")
    damaged = [(f"{base}/{short}/{label}", _edit_bytes(relative, edit)) for label, edit in cases]
    # Longer headers, written as a tool would: the data moved to the next aligned offset and the
    # manifest's entry updated, so the header itself is what gets checked.
    for label, new in {
        "metadata": lambda h: _json({"__metadata__": {"note": "x" * 5000}, **h}),
        "metadata-long-int": lambda h: b'{"__metadata__":{"x":' + LONG_INT + b"}," + _json(h)[1:],
        "metadata-deep-nesting": lambda h: (
            b'{"__metadata__":{"x":' + b"[" * 5000 + b"]" * 5000 + b"}," + _json(h)[1:]
        ),
        "metadata-not-object": lambda h: _json({"__metadata__": ["x"] * 2000, **h}),
    }.items():
        damaged.append((f"{base}/{short}/longer-header-{label}", _rewrite_header(relative, new)))
    return damaged


def _rewrite_header(relative: str, new: Callable[[dict], bytes]) -> Callable[[Path], None]:
    """Give `relative` the header `new(parsed header)` padded to the next aligned data offset, and
    update its manifest entry (size, data_offset) to match."""

    def apply(store: Path) -> None:
        file = store / relative
        data = file.read_bytes()
        _, data_start = _header_bounds(data)
        raw = new(json.loads(data[8:data_start]))
        raw += b" " * (-(8 + len(raw)) % ALIGNMENT)
        file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[data_start:])
        manifest = json.loads((store / "manifest.json").read_text())
        manifest["files"][relative] = {"size": file.stat().st_size, "data_offset": 8 + len(raw)}
        (store / "manifest.json").write_text(json.dumps(manifest, indent=2))

    return apply


# -- manifest ---------------------------------------------------------------------------------------


def _edit_manifest(edit: Callable[[dict], object]) -> Callable[[Path], None]:
    def apply(store: Path) -> None:
        path = store / "manifest.json"
        manifest = json.loads(path.read_text())
        result = edit(manifest)
        path.write_text(json.dumps(manifest if result is None else result, indent=2))

    return apply


def _edit_manifest_text(edit: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def apply(store: Path) -> None:
        path = store / "manifest.json"
        path.write_bytes(edit(path.read_bytes()))

    return apply


def _at(keys: tuple, value: object = None, *, delete: bool = False) -> Callable[[dict], None]:
    """Set (or delete) `manifest[k0][k1]...`; a callable `value` gets the old value."""

    def edit(manifest: dict) -> None:
        node = manifest
        for key in keys[:-1]:
            node = node[key]
        if delete:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value(node[keys[-1]]) if callable(value) else value

    return edit


WRONG_TYPES = {"null": None, "str": "x", "float": 1.5, "neg": -1, "zero": 0, "huge": 2**64, "true": True}
WRONG_TYPES_CONTAINERS = {"list": [], "dict": {}}


def manifest_cases(base: str) -> list[tuple[str, Callable[[Path], None]]]:
    manifest = _pristine_manifests()[base]
    row_file = next(iter(manifest["files"]))
    first_kind = next(iter(manifest["kinds"]))
    cases: list[tuple[str, Callable[[Path], None]]] = []

    def structured(label: str, edit: Callable[[dict], object]) -> None:
        cases.append((f"manifest-{label}", _edit_manifest(edit)))

    def text(label: str, edit: Callable[[bytes], bytes]) -> None:
        cases.append((f"manifest-text-{label}", _edit_manifest_text(edit)))

    # Every top-level key missing, and of every wrong type (the full grid on the gated base).
    for key in manifest:
        structured(f"{key}-missing", _at((key,), delete=True))
        if base == "llama":
            for label, value in (WRONG_TYPES | WRONG_TYPES_CONTAINERS).items():
                if value != manifest[key] or type(value) is not type(manifest[key]):
                    structured(f"{key}-{label}", _at((key,), value))

    plausible = {
        "num_layers": [1, 3, 0, -1, 10**9],
        "d_model": [
            manifest["d_model"] - 1,
            manifest["d_model"] + 1,
            0,
            -manifest["d_model"],
            manifest["d_ff"],
        ],
        "d_ff": [manifest["d_ff"] - 1, manifest["d_ff"] + 1, manifest["d_model"], 0, 10**12],
        "gated": [not manifest["gated"]],
        "has_bias": [not manifest["has_bias"]],
        "model_type": ["mistral" if base == "llama" else "falcon", "gpt2", ""],
        "family": ["opt" if base == "llama" else "llama", "bogus"],
        "dtype": [
            "float16",
            "bfloat16",
            "torch.float32",
            "float64",
            "int64",
            "uint8",
            "Tensor",
            "",
            "float8_e4m3fn",
        ],
        "alignment": [512, 8192],
        "format": ["flashlm-store-v2", ""],
        "format_version": [0, 2, "1", 1.0],
        "flashlm_version": ["99.0", None],
    }
    for key, values in plausible.items():
        for value in values:
            structured(f"{key}={value!r}", _at((key,), value))

    # Unit kinds and their layouts.
    structured("kinds-empty", _at(("kinds",), {}))
    structured("kinds-unknown", _add_kind("bogus"))
    structured("kinds-bundle-without-files", _add_kind("bundle"))
    structured(f"kinds-without-{first_kind}", _at(("kinds", first_kind), delete=True))
    structured("files-reversed", lambda m: m.update(files=dict(reversed(m["files"].items()))))
    for label, value in {"int": 5, "list": [], "null": None, "str": "x", "empty": {}}.items():
        structured(f"layout-{first_kind}-{label}", _at(("kinds", first_kind), value))
    for field in ("rows", "width", "row_bytes"):
        structured(f"layout-{first_kind}-{field}-missing", _at(("kinds", first_kind, field), delete=True))
        for label, value in {
            "neg": -1,
            "zero": 0,
            "plus1": lambda v: v + 1,
            "minus1": lambda v: v - 1,
            "null": None,
            "str": lambda v: str(v),
            "float": lambda v: float(v),
            "true": True,
            "huge": 2**64,
        }.items():
            structured(f"layout-{first_kind}-{field}-{label}", _at(("kinds", first_kind, field), value))
    structured(f"layout-{first_kind}-text", _at(("kinds", first_kind, "layout"), "row j = nothing"))

    # File entries.
    structured(f"files-{row_file}-missing", _at(("files", row_file), delete=True))
    for label, value in {"int": 5, "null": None, "list": [], "empty": {}, "str": "x"}.items():
        structured(f"files-{row_file}-{label}", _at(("files", row_file), value))
    for field, values in {
        "size": {
            "neg": -1,
            "zero": 0,
            "plus1": lambda v: v + 1,
            "minus1": lambda v: v - 1,
            "huge": 2**64,
            "null": None,
            "str": lambda v: str(v),
            "float": lambda v: float(v),
        },
        "data_offset": {
            "zero": 0,
            "8": 8,
            "4095": 4095,
            "8192": 8192,
            "neg": -ALIGNMENT,
            "huge": 2**64,
            "null": None,
            "str": lambda v: str(v),
        },
    }.items():
        structured(f"files-{row_file}-{field}-missing", _at(("files", row_file, field), delete=True))
        for label, value in values.items():
            structured(f"files-{row_file}-{field}-{label}", _at(("files", row_file, field), value))
    structured(
        "files-extra-missing-file", _at(("files", "layers/999.up.safetensors"), {"size": 1, "data_offset": 0})
    )
    structured("files-extra-int", _at(("files", "extra.bin"), 5))
    structured("files-extra-empty-entry", _at(("files", "manifest.json"), {}))
    structured("files-extra-string-size", _at(("files", "manifest.json"), {"size": "big", "data_offset": 0}))
    structured("files-extra-outside", _at(("files", "../outside.bin"), {"size": 1, "data_offset": 0}))
    if "resident.safetensors" in manifest["files"]:
        structured("files-resident-missing", _at(("files", "resident.safetensors"), delete=True))
        for label, value in {"int": 5, "null": None, "list": [], "empty": {}}.items():
            structured(f"files-resident-{label}", _at(("files", "resident.safetensors"), value))
        structured(
            "files-resident-size-plus1", _at(("files", "resident.safetensors", "size"), lambda v: v + 1)
        )
        structured(
            "files-resident-size-str", _at(("files", "resident.safetensors", "size"), lambda v: str(v))
        )

    # Provenance.
    for label, value in {"null": None, "int": 5, "other": "0" * 64}.items():
        structured(f"source-content_sha256-{label}", _at(("source", "content_sha256"), value))
    structured("source-content_sha256-missing", _at(("source", "content_sha256"), delete=True))
    structured("source-fingerprint-int", _at(("source", "fingerprint"), 5))
    structured("source-path-other", _at(("source", "path"), "/nowhere"))

    # Text: truncated, not JSON, not an object, odd JSON.
    for fraction in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9):
        text(f"truncated-{fraction}", lambda raw, f=fraction: raw[: int(f * len(raw))])
    text("truncated-1B", lambda raw: raw[:1])
    text("last-byte-lost", lambda raw: raw[:-1])
    for label, value in {
        "whitespace": b"  \n",
        "hello": b"hello",
        "list": b"[]",
        "string": b'"manifest"',
        "number": b"42",
        "null": b"null",
        "nan": b"NaN",
        "infinity": b"Infinity",
        "deep-nesting": DEEP,
        "nul-bytes": bytes(64),
    }.items():
        text(label, lambda raw, v=value: v)
    text(
        "deep-nesting-in-a-value",
        lambda raw: raw.replace(b'"flashlm_version": ', b'"flashlm_version": ' + DEEP + b', "v": ', 1),
    )
    text("long-int", lambda raw: raw.replace(b'"d_ff": ', b'"d_ff": ' + LONG_INT + b', "x": ', 1))
    text("num_layers-nan", lambda raw: raw.replace(b'"num_layers": ', b'"num_layers": NaN, "x": ', 1))
    text(
        "duplicate-key", lambda raw: raw.replace(b'"num_layers": ', b'"num_layers": "two", "num_layers": ', 1)
    )
    text("bom", lambda raw: b"\xef\xbb\xbf" + raw)
    text("utf16", lambda raw: raw.decode().encode("utf-16"))
    text("invalid-utf8", lambda raw: raw.replace(b'"family": "', b'"family": "\xff', 1))
    text("trailing-garbage", lambda raw: raw + b"}")
    rng = _rng("manifest-text", base)
    for i in range(2):
        seed = rng.getrandbits(32)
        text(f"garbage-{i}", lambda raw, seed=seed: random.Random(seed).randbytes(len(raw)))
    for i in range(20):
        at, bit = rng.random(), rng.randrange(8)
        text(f"flip-{i}", lambda raw, at=at, bit=bit: _flipped(raw, [(int(at * len(raw)), bit)]))
    for i in range(5):
        draws = [(rng.random(), rng.randrange(8)) for _ in range(3)]
        text(
            f"flip3-{i}", lambda raw, draws=draws: _flipped(raw, [(int(at * len(raw)), b) for at, b in draws])
        )

    return [(f"{base}/{label}", apply) for label, apply in cases]


def _add_kind(kind: str) -> Callable[[dict], None]:
    def edit(manifest: dict) -> None:
        layout = dict(next(iter(manifest["kinds"].values())))
        manifest["kinds"][kind] = layout

    return edit


def _flipped(raw: bytes, positions: list[tuple[int, int]]) -> bytes:
    data = bytearray(raw)
    for byte, bit in positions:
        data[byte] ^= 1 << bit
    return bytes(data)


# -- files ------------------------------------------------------------------------------------------


def _remove(relative: str) -> Callable[[Path], None]:
    def apply(store: Path) -> None:
        target = store / relative
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink()

    return apply


def _replace_with_dir(relative: str) -> Callable[[Path], None]:
    def apply(store: Path) -> None:
        _remove(relative)(store)
        (store / relative).mkdir()

    return apply


def _symlink(relative: str, target: str) -> Callable[[Path], None]:
    def apply(store: Path) -> None:
        _remove(relative)(store)
        (store / relative).symlink_to(target)

    return apply


def _truncate(relative: str, size: Callable[[int], int]) -> Callable[[Path], None]:
    def apply(store: Path) -> None:
        file = store / relative
        os.truncate(file, size(file.stat().st_size))

    return apply


def _store_is_a_file(store: Path) -> None:
    shutil.rmtree(store)
    store.write_bytes(b"not a store")


def _empty_dir(store: Path) -> None:
    shutil.rmtree(store)
    store.mkdir()


def file_cases(base: str) -> list[tuple[str, Callable[[Path], None], str]]:
    manifest = _pristine_manifests()[base]
    files = list(manifest["files"])
    row_file = files[-1] if files[-1].startswith("layers/") else files[0]
    cases: list[tuple[str, Callable[[Path], None], str]] = []
    for relative in files:
        cases.append((f"missing-{relative}", _remove(relative), "before"))
    cases += [
        ("missing-layers-dir", _remove("layers"), "before"),
        ("missing-manifest", _remove("manifest.json"), "before"),
        ("manifest-is-a-dir", _replace_with_dir("manifest.json"), "before"),
        ("empty-dir", _empty_dir, "before"),
        ("store-is-a-file", _store_is_a_file, "before"),
        ("missing-store", shutil.rmtree, "before"),
        (f"dir-instead-of-{row_file}", _replace_with_dir(row_file), "before"),
        (f"dangling-symlink-{row_file}", _symlink(row_file, "nowhere.safetensors"), "before"),
        (f"symlink-loop-{row_file}", _symlink(row_file, Path(row_file).name), "before"),
        (f"extended-{row_file}", _edit_bytes(row_file, lambda d: d + b"\0" * ALIGNMENT), "before"),
        (f"last-byte-lost-{row_file}", _truncate(row_file, lambda n: n - 1), "before"),
        # Damage done after the store was opened (validated), then after the readers opened their files.
        (f"truncated-after-open-{row_file}", _truncate(row_file, lambda n: ALIGNMENT), "after_open"),
        (f"emptied-after-open-{row_file}", _truncate(row_file, lambda n: 0), "after_open"),
        (f"removed-after-open-{row_file}", _remove(row_file), "after_open"),
        (f"last-byte-lost-after-open-{row_file}", _truncate(row_file, lambda n: n - 1), "after_open"),
        (f"truncated-after-reader-{row_file}", _truncate(row_file, lambda n: ALIGNMENT), "after_reader"),
        (f"last-byte-lost-after-reader-{row_file}", _truncate(row_file, lambda n: n - 1), "after_reader"),
        (f"removed-after-reader-{row_file}", _remove(row_file), "after_reader"),
    ]
    return [(f"{base}/files/{label}", apply, stage) for label, apply, stage in cases]


# The corpus is built at collection time, before any fixture: the shape of each pristine store (which
# files, which keys) comes from the manifest of a store converted here once, then deleted.
_PRISTINE: dict[str, dict] = {}


def _pristine_manifests() -> dict[str, dict]:
    if not _PRISTINE:
        with tempfile.TemporaryDirectory(prefix="flashlm-fuzz-") as root:
            for name in BASES:
                path = Path(root) / name
                flashlm.convert(tiny_model(name), path, progress=False)
                _PRISTINE[name] = json.loads((path / "manifest.json").read_text())
    return _PRISTINE


def build_corpus() -> list[Case]:
    corpus = [Case(f"{base}/control", base, lambda store: None) for base in BASES]
    targets = {
        "llama": ["layers/000.gate.safetensors"],
        "opt": ["resident.safetensors"],
    }
    for base in BASES:
        for relative in targets[base]:
            corpus += [Case(id, base, apply) for id, apply in header_cases(base, relative)]
        corpus += [Case(id, base, apply) for id, apply in manifest_cases(base)]
        corpus += [Case(id, base, apply, stage) for id, apply, stage in file_cases(base)]
    ids = [case.id for case in corpus]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    return corpus


CORPUS = build_corpus()


def run_case(case: Case, bases: dict[str, Base], tmp_path: Path) -> FlashLMError | None:
    """Damage a copy of the case's pristine store and exercise it; the FlashLMError raised, or None.
    Any other exception (or a failed assertion on the data) propagates."""
    path = tmp_path / "store"
    shutil.copytree(bases[case.base].path, path)
    try:
        exercise(path, bases[case.base], case)
    except FlashLMError as exc:
        return exc
    return None


def check_contract(case: Case, bases: dict[str, Base], tmp_path: Path) -> None:
    error = run_case(case, bases, tmp_path)
    if error is not None:
        message = str(error)
        assert str(tmp_path / "store") in message, f"the message does not name the store: {message!r}"


@pytest.mark.parametrize("case", CORPUS, ids=lambda c: c.id)
def test_damaged_store_fails_cleanly_or_serves_the_original(
    case: Case, bases: dict[str, Base], tmp_path: Path
) -> None:
    check_contract(case, bases, tmp_path)


def test_corpus_exercises_both_outcomes(bases: dict[str, Base], tmp_path_factory) -> None:
    """The corpus is not vacuous: the controls open and serve the original; damage is caught."""
    outcomes = {}
    for case_id in ("llama/control", "llama/000.gate/truncate-mid-json", "llama/manifest-text-hello"):
        case = next(c for c in CORPUS if c.id == case_id)
        outcomes[case_id] = run_case(case, bases, tmp_path_factory.mktemp("corpus"))
    assert outcomes["llama/control"] is None
    assert isinstance(outcomes["llama/000.gate/truncate-mid-json"], StoreCorruptError)
    assert isinstance(outcomes["llama/manifest-text-hello"], StoreCorruptError)
    assert len(CORPUS) >= 300
