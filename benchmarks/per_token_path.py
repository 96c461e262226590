"""The per-token path against plain transformers: compute, cache bookkeeping, I/O and operator counts.

For each model and each CPU capability (`default`, and `avx2`: torch's AVX2 kernels with oneDNN and
MKL held to AVX2, what a CPU without AVX-512 runs), every configuration runs in its own process with
the same prompt: a prefill, then greedy decoding, each step timed alone.

- `ram`: plain transformers in memory. Forward hooks time its MLP modules: the in-RAM MLP time per
  token that flashlm's compute is held against.
- `dense@resident`: flashlm dense streaming with a budget that holds every unit (after the first step
  nothing is read), against `ram`'s tokens/s.
- `dip-ca@D-resident`: DIP-CA with a budget that holds every unit: a sparse method's own per-token
  cost (selection, cache bookkeeping, compute) once nothing is read.
- `dense@50%`, `dip@D`, `dip-ca@D`: dense streaming, DIP and DIP-CA with half the MLP bytes;
  `dense@50%-no-read-ahead` reads each layer when it runs, so its compute runs with no reads
  beside it: what overlapped I/O costs the compute on this machine.
- `ram+idle` (run when `dense@50%` is): plain transformers in memory, sleeping before each MLP as long
  as `dense@50%` waited per layer for its reads. dense@50%'s compute also starts after such a wait, and
  a core that slept runs the next products slower (the README's benchmark section has the figures),
  so the line under the table holds that compute against both MLP times.

Per configuration: decode tokens/s (and its ratio to `ram`), prefill seconds (and the ratio to
`dense@50%`'s), MB read per token, the split of a token's MLP time (selection, cache bookkeeping =
lookup + read submission + admission/eviction, I/O wait, compute: `flashlm.stats`), compute over the
in-RAM MLP time, bookkeeping over compute, whether greedy tokens equal `ram`'s (exact configurations
only), and the torch operators run inside the MLP modules per layer per token (torch.profiler over
decode steps, attributed to the MLP by a `record_function` range around each MLP module's forward)
with the bytes they allocated.

With `--device cuda` the model runs on the GPU (`device_map="cuda"`, flashlm's caches there too) and
the CPU capabilities do not apply; step and MLP times wait for the GPU (`torch.cuda.synchronize`),
so the MLP hooks' time includes that wait. flashlm's own split of a step is host time and does not
wait for the GPU: on CUDA read it as launch cost, not as GPU time. `--random-weights` runs each
model's shapes with seeded random weights (built once under `--out`), for a machine that the real
weights cannot reach: its tokens mean nothing, and DIP's masks on random weights change from token
to token more than on the real model's (lower hit rates).

The child reads only flashlm's public surface (`FlashConfig`, `flashlm.stats`), so the same script
measures an older flashlm too (`PYTHONPATH=old/src`, a `--flashlm-cache` of its own, `--label before`);
a `--flashlm-cache` without a disk profile gets the default cache's, so both read with one setting.

    python benchmarks/per_token_path.py --models smollm2-135m,qwen2.5-1.5b --out bench-results/per-token
    python benchmarks/per_token_path.py --repeats 3 --out bench-results/per-token   # a noisy machine

`--repeats N` runs the configurations N times in rotation (each run its own process, as above) and
shows for each configuration its run of median tokens/s, with the range over the runs beside it: on a
shared machine the same process can run a third slower than the one before it. A run times one prefill,
so the prefill column is the median over the runs (with their range) instead.
    python benchmarks/per_token_path.py --device cuda --random-weights --models DIR,DIR --out OUT
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CAPABILITIES = {
    "default": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Explain why this mattered."
)
MLP_RANGE = "flashlm_bench::mlp"
IDLE_RAM = "ram+idle"
EXACT = ("ram", IDLE_RAM, "dense@resident", "dense@50%", "dense@50%-no-read-ahead")


def configurations(density: float) -> list[dict[str, Any]]:
    return [
        {"name": "ram"},
        {"name": "dense@resident", "options": {"memory_budget": "115%"}},
        {"name": "dense@50%", "options": {"memory_budget": "50%"}},
        {"name": "dense@50%-no-read-ahead", "options": {"memory_budget": "50%", "read_ahead": False}},
        {"name": f"dip@{density}", "options": {"memory_budget": "50%", "method": "dip", "density": density}},
        {
            "name": f"dip-ca@{density}",
            "options": {"memory_budget": "50%", "method": "dip", "density": density, "cache_aware": 0.2},
        },
        {
            "name": f"dip-ca@{density}-resident",
            "options": {"memory_budget": "115%", "method": "dip", "density": density, "cache_aware": 0.2},
        },
        # in RAM, but idle before each MLP as long as dense@50% waited for its reads: the MLP time that
        # dense@50%'s compute, which also starts after a wait, is compared with in `idle_comparison`
        {"name": IDLE_RAM, "idle_like": "dense@50%"},
    ]


# ---- child: one configuration ------------------------------------------------------------------


def mlp_modules(model) -> list:
    """The modules that compute each layer's MLP (flashlm's, or transformers' own)."""
    found = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind.endswith("MLP") and not any(name.startswith(f + ".") for f, _ in found):
            found.append((name, module))
    return [module for _, module in found]


def wait_for(device: str) -> None:
    """Let the device finish its queued work, so that a clock read after it counts that work."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


class MLPTimer:
    """Forward hooks: seconds spent inside MLP modules, and a profiler range around each call."""

    def __init__(self, model, device: str, idle_ms_per_token: float = 0.0) -> None:
        import torch

        self.seconds = 0.0
        self._ranges: list = []
        self.modules = mlp_modules(model)
        for module in self.modules:
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._exit)
        self._torch = torch
        self._device = device
        self._idle_s = idle_ms_per_token / 1e3 / len(self.modules)

    def _enter(self, module, args) -> None:
        if self._idle_s:
            time.sleep(self._idle_s)  # untimed: the MLP's clock starts after it
        span = self._torch.profiler.record_function(MLP_RANGE)
        span.__enter__()
        wait_for(self._device)
        self._ranges.append((span, time.perf_counter()))

    def _exit(self, module, args, output) -> None:
        wait_for(self._device)
        span, started = self._ranges.pop()
        self.seconds += time.perf_counter() - started
        span.__exit__(None, None, None)


def mlp_operator_counts(prof) -> tuple[dict[str, int], int]:
    """aten operators run inside the MLP ranges (outermost aten calls only), by name, and the bytes
    the operators inside those ranges allocated (any depth)."""
    counts: dict[str, int] = {}
    allocated = 0
    for event in prof.profiler.function_events:
        if not event.name.startswith("aten::"):
            continue
        parent, inside, nested = event.cpu_parent, False, False
        while parent is not None:
            nested = nested or parent.name.startswith("aten::")
            inside = inside or parent.name == MLP_RANGE
            parent = parent.cpu_parent
        if inside:
            allocated += max(event.self_cpu_memory_usage, 0)
        if inside and not nested:
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts, allocated


def run_child(
    spec: dict[str, Any],
    model_dir: str,
    device: str,
    warmup_tokens: int,
    new_tokens: int,
    profile_tokens: int,
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import flashlm

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    placement = {"device_map": device} if device != "cpu" else {}
    if "options" in spec:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, quantization_config=flashlm.FlashConfig(**spec["options"]), **placement
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, **placement)
    timer = MLPTimer(model, device, spec.get("idle_ms_per_token", 0.0))
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids.to(device)
    flashlm_model = "options" in spec
    tokens, steps = [], []
    with torch.inference_mode():
        started = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        wait_for(device)
        prefill_s = time.perf_counter() - started
        for _ in range(warmup_tokens):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
        if flashlm_model:
            flashlm.stats(model, reset=True)
        timer.seconds = 0.0
        for _ in range(new_tokens):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(token))
            started = time.perf_counter()
            out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
            wait_for(device)
            steps.append(time.perf_counter() - started)
        mlp_s = timer.seconds
        snapshot = flashlm.stats(model) if flashlm_model else None
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        ) as prof:
            for _ in range(profile_tokens):
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                out = model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
    layers = len(timer.modules)
    ops, allocated = mlp_operator_counts(prof)
    result = {
        "config": spec["name"],
        "flashlm": str(Path(flashlm.__file__).parent),
        "prompt_tokens": int(ids.shape[1]),
        "prefill_s": prefill_s,
        "decode_tok_s": len(steps) / sum(steps),
        "step_ms": [1e3 * step for step in steps],
        "mlp_ms_per_token": 1e3 * mlp_s / len(steps),
        "idle_ms_per_token": spec.get("idle_ms_per_token", 0.0),
        "tokens": tokens,
        "ops_per_layer_token": sum(ops.values()) / (layers * profile_tokens),
        "alloc_kb_per_layer_token": allocated / 1e3 / (layers * profile_tokens),
        "ops": {name: count / (layers * profile_tokens) for name, count in sorted(ops.items())},
    }
    if snapshot is not None:
        totals = snapshot.totals(decode_only=True)
        per_step = {
            name[: -len("_per_step")]: value for name, value in totals.items() if name.endswith("_per_step")
        }
        result["read_mb_per_token"] = per_step["bytes_read"] / 1e6
        result["hit_rate"] = totals["hit_rate"]
        result["ms"] = {
            # flashlm before the per-token-path work had no selection/lookup/submit/update columns
            name: 1e3 * per_step.get(f"{name}_s", float("nan"))
            for name in ("select", "lookup", "submit", "update", "cache", "io", "compute")
        }
    return result


# ---- parent: every configuration, side by side --------------------------------------------------


def share_disk_profile(flashlm_cache: Path) -> None:
    """Copy the default flashlm cache's disk profile into `flashlm_cache` where it has none. The reader's
    concurrency and merge gap follow the profile, so two flashlm versions compared with caches of their
    own must share it: profiled apart, the same disk measured 0.84 and 1.57 GB/s, and Qwen2.5-1.5B's
    DIP-CA at 50% read 828 against 994 MB per token with one code."""
    from flashlm._utils import cache_dir  # in older flashlm versions too, unlike the profile's own helpers

    source, target = (root / "measurements" / "disk_profiles.json" for root in (cache_dir(), flashlm_cache))
    if source.is_file() and not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        print(f"{target}: the disk profile of {source}")


def run(spec, model_dir: Path, capability: str, args) -> dict[str, Any]:
    env = {**os.environ, **CAPABILITIES.get(capability, {}), "HF_HUB_OFFLINE": "1"}
    if args.flashlm_cache:
        env["FLASHLM_CACHE"] = str(args.flashlm_cache)
    command = [
        sys.executable,
        __file__,
        "--child",
        json.dumps(spec),
        "--model-dir",
        str(model_dir),
        "--device",
        args.device,
        "--warmup-tokens",
        str(args.warmup_tokens),
        "--new-tokens",
        str(args.new_tokens),
        "--profile-tokens",
        str(args.profile_tokens),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        return {"config": spec["name"], "error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(line.removeprefix("RESULT "))


def run_round(
    model_dir: Path, capability: str, args, wanted: set[str] | None, label: str, results: list, save
) -> None:
    """Every configuration (of `wanted`) once, each appended to `results` as it finishes, then `save()`."""
    for spec in configurations(args.density):
        if wanted and spec["name"] not in wanted:
            continue
        if "idle_like" in spec:
            like = next((r for r in results if r["config"] == spec["idle_like"] and "ms" in r), None)
            if like is None:
                print(f"{spec['name']}: skipped, needs {spec['idle_like']} measured first", file=sys.stderr)
                continue
            spec = {**spec, "idle_ms_per_token": like["ms"]["io"]}
        print(f"{label}: {spec['name']} ...", file=sys.stderr, flush=True)
        results.append(run(spec, model_dir, capability, args))
        save()


def save_report(stem: Path, report: dict[str, Any], sections: list[str], heading: str, entry: dict) -> None:
    """`entry`'s (the report's last run's) median runs over its rounds, its section's table, and the
    report, written to `stem`.json / .md (after each configuration, so that an interrupted run keeps
    what it measured)."""
    entry["results"] = results = median_runs(entry["rounds"])
    sections[-1] = f"## {heading}\n\n{table(results)}\n\n{idle_comparison(results)}"
    stem.parent.joinpath(f"{stem.name}.json").write_text(json.dumps(report, indent=1))
    stem.parent.joinpath(f"{stem.name}.md").write_text("\n".join(sections))


def median_runs(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per configuration, in the order first run, its run of median decode tokens/s over the rounds
    (the lower middle of an even count; a failed run only where every run failed), with every run's
    tokens/s under `round_tok_s`. One run per row keeps its figures consistent with each other, but for
    the prefill: one forward per run, so the row's `prefill_s` is the median over the runs (each run's
    under `round_prefill_s`), not the median-decode run's own."""
    by_config: dict[str, list[dict[str, Any]]] = {}
    for results in rounds:
        for result in results:
            by_config.setdefault(result["config"], []).append(result)
    rows = []
    for runs in by_config.values():
        measured = [r for r in runs if "error" not in r]
        if not measured:
            rows.append(runs[0])
            continue
        by_speed = sorted(measured, key=lambda r: r["decode_tok_s"])
        prefills = [r["prefill_s"] for r in measured]
        rows.append(
            {
                **by_speed[(len(by_speed) - 1) // 2],
                "round_tok_s": [r["decode_tok_s"] for r in measured],
                "prefill_s": statistics.median(prefills),
                "round_prefill_s": prefills,
            }
        )
    return rows


def with_range(value: float, spread: list[float]) -> str:
    """`value`, and where there were several runs the range of theirs."""
    return f"{value:.2f}" + (f" ({min(spread):.2f}-{max(spread):.2f})" if len(spread) > 1 else "")


def number(value, fmt: str) -> str:
    return "—" if value is None or value != value else format(value, fmt)


def table(results: list[dict[str, Any]]) -> str:
    ram = next((r for r in results if r["config"] == "ram" and "error" not in r), None)
    dense = next((r for r in results if r["config"] == "dense@50%" and "error" not in r), None)
    lines = [
        "| configuration | decode tok/s | x ram | prefill s | x dense prefill | MB read/token | hit rate "
        "| select / cache / I/O wait / compute ms | cache: lookup / submit / update ms | MLP ms (hooks) "
        "| compute / ram MLP | cache / compute | MLP ops per layer per token "
        "| MLP KB allocated per layer per token | tokens = ram |",
        "|" + "---|" * 15,
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | failed: {r['error'].strip().splitlines()[-1]} |" + " |" * 13)
            continue
        ms = r.get("ms")
        split = (
            f"{number(ms['select'], '.1f')} / {number(ms['cache'], '.1f')} / {number(ms['io'], '.1f')} / "
            f"{number(ms['compute'], '.1f')}"
            if ms
            else "—"
        )
        cache = " / ".join(number(ms[part], ".1f") for part in ("lookup", "submit", "update")) if ms else "—"
        exact = ("yes" if r["tokens"] == ram["tokens"] else "NO") if ram and r["config"] in EXACT else "—"
        lines.append(
            f"| {r['config']} | {with_range(r['decode_tok_s'], r.get('round_tok_s', []))} "
            f"| {number(ram and r['decode_tok_s'] / ram['decode_tok_s'], '.2f')} "
            f"| {with_range(r['prefill_s'], r.get('round_prefill_s', []))} "
            f"| {number(dense and r['prefill_s'] / dense['prefill_s'], '.2f')} "
            f"| {number(r.get('read_mb_per_token'), '.1f')} | {number(r.get('hit_rate'), '.1%')} | {split} "
            f"| {cache} "
            f"| {r['mlp_ms_per_token']:.1f} "
            f"| {number(ms and ram and ms['compute'] / ram['mlp_ms_per_token'], '.2f')} "
            f"| {number(ms and ms['cache'] / ms['compute'], '.1%')} | {r['ops_per_layer_token']:.1f} "
            f"| {number(r.get('alloc_kb_per_layer_token'), '.1f')} | {exact} |"
        )
    return "\n".join(lines)


def idle_comparison(results: list[dict[str, Any]]) -> str:
    """dense@50%'s compute over the in-RAM MLP time, plain and after the same idle before each MLP."""
    found = {r["config"]: r for r in results if "error" not in r}
    if not {"ram", "dense@50%", IDLE_RAM} <= found.keys():
        return ""
    compute, idle = found["dense@50%"]["ms"]["compute"], found[IDLE_RAM]
    return (
        f"dense@50% compute {compute:.1f} ms per token: {compute / found['ram']['mlp_ms_per_token']:.2f}x "
        f"in-RAM transformers' MLP time, {compute / idle['mlp_ms_per_token']:.2f}x its MLP time when idle "
        f"{idle['idle_ms_per_token']:.1f} ms per token before the MLPs (dense@50%'s I/O wait)\n"
    )


def bundled_model(name: str) -> Path:
    from flashlm.data.models import model_path

    return model_path(name)


def random_checkpoint(source: Path, out: Path, device: str) -> Path:
    """`source`'s config and tokenizer with seeded random weights, saved once under `out`: the
    model's shapes and costs where its weights cannot travel (`source` needs no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").is_file():
        return out
    config = AutoConfig.from_pretrained(source)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=config.dtype or torch.bfloat16)
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(source).save_pretrained(partial)
    partial.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-1.5b", help="bundled names or directories")
    parser.add_argument("--capabilities", default="default,avx2", help="CPU kernels (with --device cpu)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model runs")
    parser.add_argument(
        "--random-weights", action="store_true", help="each model's shapes with seeded random weights"
    )
    parser.add_argument("--configs", default=None, help="comma-separated subset of the configuration names")
    parser.add_argument("--density", type=float, default=0.6, help="MLP density of the DIP / DIP-CA rows")
    parser.add_argument(
        "--warmup-tokens", type=int, default=0, help="untimed decode steps first (CUDA loads kernels lazily)"
    )
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--profile-tokens", type=int, default=2)
    parser.add_argument(
        "--repeats", type=int, default=1, help="rounds over the configurations; each row is its median run"
    )
    parser.add_argument("--label", default="after", help="names the output files (e.g. before / after)")
    parser.add_argument("--flashlm-cache", type=Path, default=None, help="FLASHLM_CACHE for the children")
    parser.add_argument("--out", type=Path, default=Path("bench-results/per-token"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = run_child(
            json.loads(args.child),
            args.model_dir,
            args.device,
            args.warmup_tokens,
            args.new_tokens,
            args.profile_tokens,
        )
        print("RESULT " + json.dumps(result), flush=True)
        return

    args.out.mkdir(parents=True, exist_ok=True)
    if args.flashlm_cache:
        share_disk_profile(args.flashlm_cache)
    report: dict[str, Any] = {"label": args.label, "runs": []}
    wanted = set(args.configs.split(",")) if args.configs else None
    sections = []
    capabilities = args.capabilities.split(",") if args.device == "cpu" else [args.device]
    for name in args.models.split(","):
        model_dir = Path(name) if Path(name).is_dir() else bundled_model(name)
        if args.random_weights:
            model_dir = random_checkpoint(model_dir, args.out / f"random-{model_dir.name}", args.device)
        for capability in capabilities:
            entry: dict[str, Any] = {"model": name, "capability": capability, "results": [], "rounds": []}
            report["runs"].append(entry)
            sections.append("")
            heading = f"{name}, capability {capability}"
            save = functools.partial(save_report, args.out / args.label, report, sections, heading, entry)
            for round_index in range(args.repeats):
                entry["rounds"].append([])
                label = f"{heading}, round {round_index + 1} of {args.repeats}"
                run_round(model_dir, capability, args, wanted, label, entry["rounds"][-1], save)
            print(sections[-1], flush=True)


if __name__ == "__main__":
    main()
