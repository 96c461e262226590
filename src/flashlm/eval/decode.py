"""Decode throughput of one configuration, measured alone in a subprocess (so peak RSS is its own).

A configuration is a dict: `{"name": ..., "kind": "ram" | "accelerate-cold" | "accelerate-warm" |
"flashlm", "options": {FlashConfig options}}`. Every configuration runs the same prompt through the
same greedy loop: one prefill forward, then one forward per new token, each timed alone.

- `ram`: plain transformers, everything in memory.
- `accelerate-cold`: the MLPs offloaded to disk with Accelerate (`device_map` + `offload_folder`);
  the page cache is dropped before every decode step, outside the timed region, so the weights
  really come from the disk (needs root). Without it a small model never leaves the page cache.
  With `"memory_layers": k` in the dict, whole decoder layers are offloaded instead, as Accelerate
  maps a model under a memory budget: layers `0..k-1` in memory, the rest on disk (the Endor
  paper's baseline).
- `accelerate-warm`: the same, page cache left alone (reference only: it reads from RAM).
- `flashlm`: `from_pretrained(..., quantization_config=FlashConfig(**options))`, O_DIRECT reads
  (`"device": "cuda"` in the dict loads it with that `device_map`);
  with `"trace_path"` in the dict (and `record_trace` in the options) the units each layer used
  are saved there (`flashlm.trace`).

With `"forced_tokens": [...]` in the dict (teacher forcing), decode step i is fed `forced_tokens[i]`
instead of the configuration's own greedy token: configurations fed the same tokens (another run's
`tokens`) decode the same text, so their bytes and speed compare on equal work. `tokens` still
holds each step's own greedy choice, and `agreement` the fraction of steps where it was the forced
token (1.0 for a configuration that computes the forcing run's model exactly).

A relufied checkpoint (`flashlm train relufy`: FATReLU, which transformers cannot build from its
config) loads with its thresholds in every kind (`flashlm.training.checkpoints.load_checkpoint`; the
`flashlm` kind through `load_streaming`, which never reads its MLP weights either).

Bytes read per token come from `/proc/self/io` read_bytes (what the process really fetched from
storage) and, for flashlm, from the reader's own counter. `"model"` in the dict overrides the model
path (e.g. a pruned checkpoint). Every configuration also reports each decoder layer's mean decode
time (forward hooks), and an Endor one the timeline of its last decode step's phases.

    python -m flashlm.eval.decode --spec '{"name": "ram", "kind": "ram"}' --model DIR --new-tokens 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Explain why this mattered."
)
REGIMES = {
    "ram": "in RAM",
    "accelerate-cold": "cold (page cache dropped every step)",
    "accelerate-warm": "warm (page cache kept; reference)",
}


def flashlm_spec(name: str, method_spec: str, density: float = 1.0, **options: Any) -> dict[str, Any]:
    """A flashlm configuration decoding with method spec `method_spec` (`parse_method_spec`) at
    `density`; `options` are further `FlashConfig` options (memory_budget, store, record_trace...)."""
    from ..methods.specs import parse_method_spec

    method = parse_method_spec(method_spec)
    method.pop("sequential_prefill", None)  # decoding is token by token anyway
    return {
        "name": name,
        "kind": "flashlm",
        "method_spec": method_spec,
        "options": {**method, "density": density, **options},
    }


def proc_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


def drop_page_cache() -> None:
    """Write back and drop the page cache (root only): the next reads come from the disk."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def mlp_disk_device_map(model_path: Path) -> dict[str, str]:
    """Every MLP on 'disk', everything else on 'cpu', keyed by the modules that hold parameters."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..arch import find_mlps, model_type_of, spec_for
    from ..training.checkpoints import buildable_config

    config = buildable_config(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    mlp_names = [name for _, name, _ in find_mlps(model, spec_for(model_type_of(config)))]
    device_map = {name: "disk" for name in mlp_names}
    for name, _ in model.named_parameters(remove_duplicate=False):
        module = name.rsplit(".", 1)[0]
        if not any(module == m or module.startswith(m + ".") for m in mlp_names):
            device_map[module] = "cpu"
    return device_map


def layer_disk_device_map(model_path: Path, memory_layers: int) -> dict[str, str]:
    """Decoder layers `0..memory_layers-1` and everything outside the decoder layers on 'cpu', the
    other decoder layers on 'disk' (how Accelerate maps a model whose layers outgrow the memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..arch import decoder_layers
    from ..training.checkpoints import buildable_config

    config = buildable_config(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    on_disk = [name for index, name, _ in decoder_layers(model) if index >= memory_layers]
    device_map = {name: "disk" for name in on_disk}
    for name, _ in model.named_parameters(remove_duplicate=False):
        module = name.rsplit(".", 1)[0]
        if not any(module == m or module.startswith(m + ".") for m in on_disk):
            device_map[module] = "cpu"
    return device_map


def _load(spec: dict[str, Any], model_path: Path, offload_dir: Path):
    """The configuration's model; a relufied checkpoint (which `from_pretrained` cannot build) loads
    with its FATReLU thresholds in every kind (`load_checkpoint`, `load_streaming`)."""
    from ..config import FlashConfig
    from ..training.checkpoints import load_checkpoint
    from .perplexity import load_streaming

    kind = spec["kind"]
    if kind == "ram":
        return load_checkpoint(model_path)
    if kind.startswith("accelerate"):
        device_map = (
            layer_disk_device_map(model_path, spec["memory_layers"])
            if "memory_layers" in spec
            else mlp_disk_device_map(model_path)
        )
        return load_checkpoint(model_path, device_map=device_map, offload_folder=str(offload_dir))
    placement = {"device_map": spec["device"]} if "device" in spec else {}
    return load_streaming(model_path, FlashConfig(**spec["options"]), **placement)


def measure_decode(spec: dict[str, Any], model_path: Path, *, new_tokens: int, offload_dir: Path) -> dict:
    """Load `spec`, prefill the prompt, decode `new_tokens` greedily; the measurements as a dict."""
    import torch
    from transformers import AutoTokenizer

    from .._utils import peak_rss_bytes
    from ..patching import flashlm_modules, stats, trace

    forced = spec.get("forced_tokens")
    if forced is not None and len(forced) < new_tokens:
        raise ConfigError(
            f"Configuration {spec['name']!r} is forced with {len(forced)} tokens but decodes "
            f"{new_tokens}: give at least as many forced tokens as new tokens."
        )
    torch.manual_seed(0)
    model_path = Path(spec.get("model", model_path))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    started = time.perf_counter()
    model = _load(spec, model_path, offload_dir)
    load_s = time.perf_counter() - started
    cold = spec["kind"] == "accelerate-cold"
    patched = bool(flashlm_modules(model))
    layer_times = LayerTimer(model)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids.to(model.device)

    tokens, step_s, step_bytes = [], [], []
    with torch.inference_mode():
        if cold:
            drop_page_cache()
        started = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        prefill_s = time.perf_counter() - started
        if patched:
            stats(model, reset=True)
        layer_times.reset()
        for step in range(new_tokens):
            next_token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(next_token))
            if forced is not None:
                next_token = torch.full_like(next_token, forced[step])
            if cold:
                drop_page_cache()
            read_before = proc_read_bytes()
            started = time.perf_counter()
            layer_times.begin_step(started)
            out = model(input_ids=next_token, past_key_values=out.past_key_values, use_cache=True)
            step_s.append(time.perf_counter() - started)
            step_bytes.append(proc_read_bytes() - read_before)
    result = {
        "config": spec["name"],
        "kind": spec["kind"],
        "options": spec.get("options", {}),
        "regime": REGIMES.get(spec["kind"], ""),
        "load_s": load_s,
        "prompt_tokens": int(ids.shape[1]),
        "prefill_s": prefill_s,
        "decode_tok_s": len(step_s) / sum(step_s),
        "proc_read_bytes_per_token": sum(step_bytes) / len(step_bytes),
        "peak_rss": peak_rss_bytes(),
        "tokens": tokens,
        "forced": forced is not None,
        "layer_ms": layer_times.mean_ms(),
        "last_step_layers": layer_times.last_step,
    }
    if forced is not None:
        result["agreement"] = sum(
            own == fed for own, fed in zip(tokens, forced[:new_tokens], strict=True)
        ) / len(tokens)
    if patched:
        result.update(_flashlm_result(model, stats(model), step_starts=layer_times.step_starts))
        if spec.get("trace_path"):
            trace(model).save(spec["trace_path"])
            result["trace_path"] = spec["trace_path"]
    return result


def _decoder_layers(model) -> list[tuple[int, Any]]:
    """`(index, module)` of each decoder layer, also where flashlm's MLP modules replaced the MLPs (the
    architecture table finds layers through their MLP projections): then each is their parent."""
    from ..arch import decoder_layers
    from ..patching import streaming_mlps

    if not (modules := streaming_mlps(model)):
        return [(index, layer) for index, _, layer in decoder_layers(model)]
    names = {id(module): name for name, module in model.named_modules()}
    return [(module.layer, model.get_submodule(names[id(module)].rsplit(".", 1)[0])) for module in modules]


class LayerTimer:
    """Forward hooks on the decoder layers: each layer's time per decode step, and the last step's spans
    (ms from the step's start)."""

    def __init__(self, model) -> None:
        self.layers = _decoder_layers(model)
        self.durations: dict[int, list[float]] = {index: [] for index, _ in self.layers}
        self.last_step: list[tuple[int, float, float]] = []
        self.step_starts: list[float] = []
        self._started: dict[int, float] = {}
        for index, layer in self.layers:
            layer.register_forward_pre_hook(self._pre(index))
            layer.register_forward_hook(self._post(index))

    def _pre(self, index: int):
        def hook(module, args):
            self._started[index] = time.perf_counter()

        return hook

    def _post(self, index: int):
        def hook(module, args, output):
            ended = time.perf_counter()
            if not self.step_starts:  # the prefill, before `reset`
                return
            self.durations[index].append(ended - self._started[index])
            start = self.step_starts[-1]  # spans in ms from the step's start, as Endor's events
            self.last_step.append((index, 1e3 * (self._started[index] - start), 1e3 * (ended - start)))

        return hook

    def reset(self) -> None:
        for durations in self.durations.values():
            durations.clear()
        self.step_starts.clear()

    def begin_step(self, started: float) -> None:
        self.step_starts.append(started)
        self.last_step = []

    def mean_ms(self) -> list[float]:
        return [1e3 * sum(d) / len(d) if d else float("nan") for d in self.durations.values()]


def _flashlm_result(model, snapshot, *, step_starts: list[float]) -> dict:
    """Per-token figures of a flashlm run (its decode steps: the counters were reset after the prefill);
    where the method records a timeline (Endor), the phases of the last decode step, in ms from its
    start; where it has caches, their capacities (for the simulator)."""
    from ..patching import runtime_of

    totals = snapshot.totals()
    result = {
        "regime": snapshot.io_mode,
        "reader_bytes_per_token": totals["bytes_read_per_step"],
        "reads_per_token": totals["reads_per_step"],
        "moved_bytes_per_token": totals["moved_bytes_per_step"],
        "misses_per_token": totals["misses"] / totals["steps"],
        "hit_rate": totals["hit_rate"],
        "mlp_density": totals["density"],
        **{
            f"{name}_ms": 1e3 * totals[f"{name}_s_per_step"]
            for name in ("select", "io", "io_busy", "cache", "compute")
        },
        **{f"{phase}_ms": 1e3 * totals[f"{phase}_s_per_step"] for phase in ("move", "decompress")},
        "resident_bytes": snapshot.resident_bytes,
        "budget_bytes": snapshot.budget_bytes,
        "hot_set": snapshot.hot_set,
    }
    if snapshot.placement:
        last = step_starts[-1]
        result.update(
            decompression=snapshot.decompression,
            placement=list(snapshot.placement),
            per_layer=snapshot.per_layer(),
            last_step_events=[
                (phase, layer, linear, 1e3 * (start - last), 1e3 * (end - last))
                for phase, layer, linear, start, end in snapshot.events
                if start >= last
            ],
        )
    if caches := getattr(runtime_of(model), "caches", None):
        result["capacities"] = {f"{layer}/{kind}": cache.capacity for (layer, kind), cache in caches.items()}
    return result


def run_in_subprocess(spec: dict[str, Any], model_path: Path, *, new_tokens: int, offload_dir: Path) -> dict:
    """`measure_decode` in a fresh Python process; raises RuntimeError with its output if it fails."""
    cmd = [
        sys.executable,
        "-m",
        "flashlm.eval.decode",
        "--spec",
        json.dumps(spec),
        "--model",
        str(model_path),
        "--new-tokens",
        str(new_tokens),
        "--offload-dir",
        str(offload_dir),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(
            f"configuration {spec['name']} failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--spec", required=True, help="the configuration, as JSON")
    parser.add_argument("--model", required=True)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--offload-dir", required=True)
    args = parser.parse_args()
    result = measure_decode(
        json.loads(args.spec),
        Path(args.model),
        new_tokens=args.new_tokens,
        offload_dir=Path(args.offload_dir),
    )
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
