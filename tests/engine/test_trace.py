"""Trace recording, and the trace file's round trip and validation."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import save_file

from flashlm.engine.trace import Trace, TraceError, TraceRecorder
from flashlm.errors import FlashLMError

NUM_UNITS = {"ffn": 40, "attn": 7}
UNIT_BYTES = {"ffn": 96, "attn": 512}


def record_random(recorder: TraceRecorder, seed: int, num_layers: int = 3, steps=range(5, 50, 3)):
    """Record random sets for some (step, layer, kind); returns the expected per-step sets."""
    rng = random.Random(seed)
    expected: dict[tuple[int, str], dict[int, set[int]]] = {}
    for step in steps:
        for layer in range(num_layers):
            for kind, n in NUM_UNITS.items():
                if rng.random() < 0.2:
                    continue  # nothing recorded: an empty request
                used = rng.sample(range(n), rng.randrange(n + 1))
                rng.shuffle(used)
                recorder.record(step, layer, kind, torch.tensor(used, dtype=torch.int64))
                expected.setdefault((layer, kind), {})[step] = set(used)
    return expected


def finish(recorder: TraceRecorder, num_layers: int = 3, **metadata) -> Trace:
    return recorder.finish(
        num_layers=num_layers, num_units=NUM_UNITS, unit_bytes=UNIT_BYTES, metadata=metadata or None
    )


def test_finish_renumbers_steps_and_sorts_ids() -> None:
    recorder = TraceRecorder()
    steps = list(range(5, 50, 3))
    expected = record_random(recorder, seed=0, steps=steps)
    trace = finish(recorder, model="tiny", density=0.25)

    assert trace.kinds == ("ffn", "attn")
    assert (trace.num_layers, trace.num_steps) == (3, len(steps))
    assert trace.num_units == NUM_UNITS and trace.unit_bytes == UNIT_BYTES
    assert trace.metadata == {"model": "tiny", "density": 0.25}
    for layer in range(3):
        for kind in NUM_UNITS:
            requests = trace.requests(layer, kind)
            assert len(requests) == len(steps)
            for i, step in enumerate(steps):
                ids = requests[i]
                assert ids.dtype == torch.int32 and ids.dim() == 1
                assert ids.tolist() == sorted(expected.get((layer, kind), {}).get(step, set()))


def test_record_copies_and_merges_repeated_records() -> None:
    recorder = TraceRecorder()
    ids = torch.tensor([3, 1], dtype=torch.int64)
    recorder.record(7, 0, "ffn", ids)
    ids[0] = 30  # the recorder holds its own copy
    recorder.record(7, 0, "ffn", torch.tensor([1, 2]))
    recorder.record(9, 1, "attn", torch.tensor([6]))
    assert len(recorder) == 3
    trace = recorder.finish(num_layers=2, num_units=NUM_UNITS, unit_bytes=UNIT_BYTES)
    assert [r.tolist() for r in trace.requests(0, "ffn")] == [[1, 2, 3], []]
    assert [r.tolist() for r in trace.requests(1, "attn")] == [[], [6]]
    assert [r.tolist() for r in trace.requests(1, "ffn")] == [[], []]
    assert trace.metadata == {}

    assert finish(recorder, num_layers=2) == trace  # finish does not consume the recording
    recorder.reset()
    empty = finish(recorder, num_layers=2)
    assert empty.num_steps == 0 and empty.requests(0, "ffn") == []


def test_save_load_round_trip(tmp_path) -> None:
    recorder = TraceRecorder()
    record_random(recorder, seed=1)
    trace = finish(recorder, model="m", method="dip", density=0.5, layers=[1, 2])
    path = tmp_path / "trace.safetensors"
    trace.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["trace.safetensors"]  # no temp file left

    loaded = Trace.load(path)
    assert loaded == trace
    assert loaded.kinds == trace.kinds
    assert loaded.metadata == trace.metadata
    for layer, kind in trace.layer_kinds():
        for a, b in zip(loaded.requests(layer, kind), trace.requests(layer, kind), strict=True):
            assert torch.equal(a, b)

    trace.save(path)  # overwriting is atomic too
    assert Trace.load(path) == trace
    other = finish(recorder, model="other")
    assert other != trace


def test_trace_is_read_only_through_its_accessors() -> None:
    recorder = TraceRecorder()
    record_random(recorder, seed=2)
    trace = finish(recorder, tags=["a"])
    trace.metadata["tags"].append("b")
    trace.num_units["ffn"] = 1
    assert trace.metadata == {"tags": ["a"]} and trace.num_units == NUM_UNITS


def test_finish_rejects_inconsistent_records() -> None:
    recorder = TraceRecorder()
    recorder.record(0, 3, "ffn", torch.tensor([1]))
    with pytest.raises(TraceError, match="layer 3"):
        finish(recorder, num_layers=3)
    recorder.reset()
    recorder.record(0, 0, "moe", torch.tensor([1]))
    with pytest.raises(TraceError, match="moe"):
        finish(recorder)
    recorder.reset()
    recorder.record(0, 0, "attn", torch.tensor([7]))
    with pytest.raises(TraceError, match=r"0\.\.6"):
        finish(recorder)
    with pytest.raises(TraceError):
        recorder.finish(num_layers=1, num_units={"attn": 8}, unit_bytes={"ffn": 8})


def test_load_rejects_files_that_are_not_traces(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        Trace.load(tmp_path / "missing.safetensors")

    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(TraceError, match="not a flashlm trace") as info:
        Trace.load(junk)
    assert isinstance(info.value, FlashLMError) and isinstance(info.value, ValueError)

    weights = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(weights), metadata={"format": "pt"})
    with pytest.raises(TraceError, match="not a flashlm trace"):
        Trace.load(weights)

    recorder = TraceRecorder()
    record_random(recorder, seed=3)
    good = tmp_path / "good.safetensors"
    finish(recorder).save(good)
    from safetensors import safe_open

    with safe_open(str(good), framework="pt") as handle:
        meta = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118

    future = tmp_path / "future.safetensors"
    save_file(tensors, str(future), metadata={**meta, "version": "99"})
    with pytest.raises(TraceError, match="version"):
        Trace.load(future)

    broken = dict(tensors)
    broken["offsets/1/ffn"] = broken["offsets/1/ffn"].flip(0).contiguous()
    damaged = tmp_path / "damaged.safetensors"
    save_file(broken, str(damaged), metadata=meta)
    with pytest.raises(TraceError, match="layer 1"):
        Trace.load(damaged)

    missing = {name: t for name, t in tensors.items() if name != "ids/2/attn"}
    save_file(missing, str(damaged), metadata=meta)
    with pytest.raises(TraceError, match="missing"):
        Trace.load(damaged)

    header = json.loads(meta["trace"])
    del header["num_steps"]
    save_file(tensors, str(damaged), metadata={**meta, "trace": json.dumps(header)})
    with pytest.raises(TraceError, match="header"):
        Trace.load(damaged)


@pytest.mark.gpu
def test_record_from_cuda_tensors() -> None:
    recorder = TraceRecorder()
    for step in range(20):
        ids = torch.arange(step % 7, 40, 3, device="cuda")
        recorder.record(step, 0, "ffn", ids)
        ids.add_(1)  # later device work does not change what was recorded
    trace = finish(recorder, num_layers=1)
    for step, ids in enumerate(trace.requests(0, "ffn")):
        assert ids.tolist() == list(range(step % 7, 40, 3))
