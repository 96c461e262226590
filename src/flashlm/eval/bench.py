"""`flashlm bench`: every configuration a user would compare, side by side in one run.

Same prompt, same number of new tokens, same memory budget; each configuration in its own process
(`flashlm.eval.decode`, so peak RSS is its own):

- `ram`: plain transformers, everything in memory.
- `accelerate-cold`: Accelerate disk offload of the MLPs (`device_map` + `offload_folder`), the naive
  baseline; the page cache is dropped before every decode step, outside the timed region (root
  only: a small offloaded model otherwise never leaves the page cache and reads 0 bytes per token).
- `accelerate-warm`: the same with the page cache left alone, for reference (it reads from RAM).
- `hybrid-cold`: Accelerate with the first half of the decoder layers in memory and the rest on disk
  (LLM in a flash's "hybrid" baseline), page cache dropped every step.
- `flashlm-dense`: flashlm dense streaming within the budget (O_DIRECT reads).
- each method operating point given as `SPEC@DENSITY[/INPUT_DENSITY]` (`dip@0.9`, `up@0.85`,
  `dip-ca@0.8/0.7`: DIP-CA keeping 70% of the up/gate input columns and every down column), and
  `endor` on a pruned checkpoint (`pruned=`), all within the same budget.

The report gives decode tokens/s and its ratio to the naive baseline, prefill time, bytes read from
the device per token (`/proc/self/io`) and by flashlm's reader, reads per token, hit rate, peak RSS,
the I/O / cache / compute split (LLM in a flash Table 3), and the physical bound: the disk's
measured O_DIRECT random-read throughput (best over chunk sizes x threads) divided by the bytes the
configuration reads per token, with the fraction of that bound it reached.

With `ppl_tokens`, each configuration's perplexity on a corpus's test split is measured too (the DIP
paper's Fig. 10, right: decode throughput against perplexity), and `bench.png` plots one against
the other. Rows that compute the dense model exactly (RAM, Accelerate, hybrid, flashlm dense
streaming, which the tests check token for token) share one dense measurement; Endor, lossless, is
scored as its pruned checkpoint. Sparse methods are scored as configured, memory budget included,
since cache-aware masking depends on what the cache holds.

A bench takes tens of minutes, so nothing it can know in advance is left to fail late: `prepare`
checks every argument before the first run (checkpoints, budget, operating points, page-cache
dropping, the perplexity corpus and token count, the output directories), and `run_bench` writes
`bench.json` / `bench.md` after every configuration, a failing one recorded with its error while
the rest go on.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import Budget, FlashConfig
from ..errors import ConfigError
from .decode import flashlm_spec, run_in_subprocess

if TYPE_CHECKING:
    from transformers import PretrainedConfig

NAIVE = "accelerate-cold"
THROUGHPUT_GRID = ((256 << 10, 4), (1 << 20, 4), (64 << 10, 8), (32 << 10, 4), (4 << 10, 4))
"""(chunk bytes, threads) cells measured for the bound, from the reader's default chunk to small reads
(`throughput_cells` puts the reader's longest requests before them)."""


def mlp_bytes(model_path: Path) -> int:
    """Bytes of the checkpoint's MLP weights (what a percentage budget is a share of), from its config."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..arch import find_mlps, model_type_of, spec_for
    from ..training.checkpoints import buildable_config

    config = buildable_config(model_path)  # a relufied checkpoint's FATReLU cannot be built from its config
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    owners = find_mlps(model, spec_for(model_type_of(config)))
    return sum(p.numel() for _, _, owner in owners for p in owner.parameters()) * dtype.itemsize


def configurations(
    *,
    memory_budget: int,
    methods: list[str],
    num_layers: int,
    pruned: Path | None = None,
    cold: bool = True,
) -> list[dict[str, Any]]:
    """The specs `flashlm.eval.decode` runs, in report order. `methods` are operating points
    (`SPEC@DENSITY[/INPUT_DENSITY]`, `operating_point`);
    `memory_budget` is in bytes, the same for every flashlm configuration (Endor included)."""
    regime = "accelerate-cold" if cold else "accelerate-warm"
    specs: list[dict[str, Any]] = [
        {"name": "ram", "kind": "ram"},
        {"name": regime, "kind": regime},
    ]
    if cold:
        specs.append({"name": "accelerate-warm", "kind": "accelerate-warm"})
    specs.append(
        {
            "name": "hybrid" + regime.removeprefix("accelerate"),
            "kind": regime,
            "memory_layers": num_layers // 2,
        }
    )
    specs.append({"name": "flashlm-dense", "kind": "flashlm", "options": {"memory_budget": memory_budget}})
    for method in methods:
        spec, density, options = operating_point(method)
        specs.append(flashlm_spec(f"flashlm-{method}", spec, density, memory_budget=memory_budget, **options))
    if pruned is not None:
        specs.append(
            {
                "name": "flashlm-endor",
                "kind": "flashlm",
                "model": str(pruned),
                "options": {"method": "endor", "memory_budget": memory_budget},
            }
        )
    for spec in specs:
        if spec["kind"] == "flashlm":
            FlashConfig(**spec["options"])  # a bad operating point fails here, not after the baselines
    return specs


def operating_point(text: str) -> tuple[str, float, dict[str, float]]:
    """`"dip-ca@0.8/0.7"` -> `("dip-ca", 0.8, {"input_density": 0.7})`; `"up@0.85"` -> `("up", 0.85, {})`;
    a bare spec runs at density 1.0. Raises `ConfigError` for numbers that do not parse."""
    spec, _, numbers = text.partition("@")
    density, _, input_density = numbers.partition("/")
    try:
        options = {"input_density": float(input_density)} if input_density else {}
        return spec, float(density) if density else 1.0, options
    except ValueError:
        raise ConfigError(
            f"Operating point {text!r}: expected SPEC@DENSITY or SPEC@DENSITY/INPUT_DENSITY, e.g. "
            "'dip-ca@0.85' or 'dip-ca@0.8/0.7'."
        ) from None


@dataclass(frozen=True)
class Plan:
    """A bench run whose arguments `prepare` checked: the budget in bytes every flashlm configuration
    gets, and the specs to run, in report order."""

    memory_budget: int
    specs: list[dict[str, Any]]


def prepare(
    model_path: Path,
    *,
    memory_budget: str,
    methods: list[str],
    pruned: Path | None = None,
    new_tokens: int,
    cold: bool = True,
    ppl_tokens: int = 0,
    ppl_context: int = 512,
    corpus: str = "shakespeare",
    out: Path,
    work: Path | None = None,
) -> Plan:
    """Check every argument of `flashlm bench` (its options by their flag names) and build the specs.

    No model is loaded and nothing decoded, but everything a later step would trip on is tried
    (configs and tokenizers load, the corpus is tokenized, the output directories take a file): a
    bench takes tens of minutes, and an argument found wrong at the perplexity step or when the
    report is written throws all of it away. Raises `ConfigError` (or another `FlashLMError`, such as
    `CorpusNotFoundError`) saying what is wrong and what to do.
    """
    if new_tokens < 1:
        raise ConfigError(f"--new-tokens must be at least 1, got {new_tokens}.")
    if cold:
        check_page_cache_drop()
    config = checkpoint(model_path, "--model")
    if pruned is not None:
        checkpoint(pruned, "--pruned")
    budget = Budget.parse(memory_budget).resolve(mlp_bytes(model_path))
    specs = configurations(
        memory_budget=budget,
        methods=methods,
        num_layers=config.get_text_config().num_hidden_layers,
        pruned=pruned,
        cold=cold,
    )
    check_unit_profiles(model_path, specs)
    writable_dir(out, "--out")
    if work is not None:
        writable_dir(work, "--work")
    if ppl_tokens:
        checkpoints = dict.fromkeys(perplexity_key(spec, model_path)[0] for spec in specs)
        check_perplexity_tokens(checkpoints, corpus=corpus, num_tokens=ppl_tokens, context_length=ppl_context)
    return Plan(budget, specs)


def check_unit_profiles(model_path: Path, specs: list[dict[str, Any]]) -> None:
    """Every flashlm configuration that places its cache by a unit profile (`hot_share`, or
    `cache_split="profile"`, predictor-gate's default) finds one beside its store: else
    `ProfileMissingError`, naming the `flashlm profile` command, now rather than when its turn comes."""
    from ..cache.profile import ProfileMissingError, UnitProfile
    from ..methods.mlp import checkpoint_store_path, module_class
    from ..store import Store

    for spec in specs:
        if spec["kind"] != "flashlm":
            continue
        config = FlashConfig(**spec["options"])
        cls = module_class(config)
        if not cls.needs_unit_profile(config):
            continue
        needed_by = f"--methods {spec.get('method_spec', config.method)}"
        path = checkpoint_store_path(model_path, config)
        if not path.exists():
            raise ProfileMissingError(
                f"{needed_by} needs a unit profile measured on the model's store, and {model_path} has no "
                f"store yet: run `flashlm profile --model {model_path} --method {config.method} --density "
                f"{config.density:g}` first (it converts the store)."
            )
        UnitProfile.of(Store.open(path), config, cls.FITTED_FILES, needed_by=needed_by)


def check_page_cache_drop() -> None:
    """Drop the page cache once, as the cold baselines do before every decode step: without root, or
    where `/proc/sys` is read-only (a container), they would fail only when their turn comes."""
    from .decode import drop_page_cache

    if os.geteuid() != 0:
        raise ConfigError(
            "flashlm bench drops the page cache before every decode step of the offloaded baselines, "
            "which needs root; run as root, or pass --warm (baselines then read from the page cache, "
            "labelled warm)."
        )
    try:
        drop_page_cache()
    except OSError as exc:
        raise ConfigError(
            f"Cannot drop the page cache ({exc.strerror or exc}; /proc/sys/vm/drop_caches is read-only "
            "in most containers), which the cold baselines do before every decode step. Run where "
            "it is writable, or pass --warm (baselines then read from the page cache, labelled warm)."
        ) from exc


def checkpoint(path: Path, flag: str) -> PretrainedConfig:
    """The `transformers` config of the checkpoint at `path` (given as `flag`), after checking that
    the decode runs can load it: a directory with config.json, weights and a tokenizer (every
    configuration tokenizes the same prompt with it)."""
    from transformers import AutoConfig, AutoTokenizer

    what = "give a Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer files)"
    if not path.is_dir():
        raise ConfigError(f"{flag} {path}: no such directory; {what}.")
    if not (path / "config.json").is_file():
        raise ConfigError(f"{flag} {path} is not a checkpoint (no config.json); {what}.")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ConfigError(f"{flag} {path} holds no weights (*.safetensors or *.bin); {what}.")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{flag} {path}: its config.json does not load ({exc}); {what}.") from exc
    try:
        AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"{flag} {path}: no tokenizer loads from it ({exc}); every configuration tokenizes the "
            "prompt with it. Save the model's tokenizer into the directory (tokenizer.save_pretrained)."
        ) from exc
    return config


def writable_dir(path: Path, flag: str) -> None:
    """Create directory `path` (given as `flag`) and create and remove a file in it, as the report
    writes do: an unwritable output directory is otherwise found after the first configuration."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".flashlm-bench-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{flag} {path} is not a writable directory ({exc.strerror or exc}); give one you can write."
        ) from exc


def check_perplexity_tokens(
    checkpoints: Iterable[str | Path], *, corpus: str, num_tokens: int, context_length: int
) -> None:
    """Check that `num_tokens` of `corpus`'s test split, tokenized by each checkpoint's tokenizer,
    are there and make at least one window of `context_length` (`perplexity.num_windows`, the
    harness's own rule). Perplexity is scored after every decode run, so a count it refuses would
    otherwise end the bench at its last step; tokenizing is cached, so the harness's own tokenizing
    later is a load."""
    from transformers import AutoTokenizer

    from ..data.corpora import corpus_tokens, require
    from .perplexity import num_windows

    require(corpus)
    for path in checkpoints:
        available = corpus_tokens(corpus, AutoTokenizer.from_pretrained(path), split="test").numel()
        try:
            num_windows(available, context_length, num_tokens)
        except ConfigError as exc:
            raise ConfigError(
                f"--ppl-tokens {num_tokens} with --ppl-context {context_length}: {exc}"
            ) from None
        if available < num_tokens:
            raise ConfigError(
                f"--ppl-tokens {num_tokens}: the test split of {corpus!r} holds only {available} tokens "
                f"under the tokenizer of {path}. Ask for at most {available}, or 0 to skip perplexity."
            )


def throughput_cells() -> tuple[tuple[int, int], ...]:
    """(chunk bytes, threads) cells of `disk_throughput`: first the longest request the reader makes
    (`SPREAD_CHUNKS` chunks, what a dense read issues) with the most requests in flight its disk profile
    tries, then `THROUGHPUT_GRID`."""
    from ..store.disk import PROFILE_THREADS
    from ..store.reader import DEFAULT_CHUNK_BYTES, SPREAD_CHUNKS

    return ((DEFAULT_CHUNK_BYTES * SPREAD_CHUNKS, max(PROFILE_THREADS)), *THROUGHPUT_GRID)


def disk_throughput(directory: Path, *, seconds: float = 0.5, size: int = 256 << 20) -> list[dict[str, Any]]:
    """O_DIRECT random-read throughput of the disk under `directory`, per `throughput_cells` cell, into
    huge pages as the reader reads (a test file of `size` random bytes is written there and removed).
    Empty where O_DIRECT is refused. Read into 4 KiB pages in requests of at most 1 MiB, as before, the
    development VM's disk gave half its speed, and Qwen2.5-1.5B's dense streaming at 50% decoded at
    1.7x its "bound"; read as now, at 81% of it."""
    from ..store.disk import random_read_throughput, supports_direct, write_test_file

    if not supports_direct(directory):
        return []
    path = directory / f".flashlm-bench-{os.getpid()}.bin"
    try:
        write_test_file(path, size)
        cells = throughput_cells()
        return [
            random_read_throughput(path, chunk, threads, seconds, huge_pages=True) for chunk, threads in cells
        ]
    finally:
        path.unlink(missing_ok=True)


def perplexity_key(
    spec: dict[str, Any], model_path: Path
) -> tuple[str, str | None, float, float | None, int | None]:
    """What a configuration's perplexity depends on: (checkpoint, method spec, density, input
    density, budget).

    Rows that compute the checkpoint exactly (everything but a sparse method) map to method None,
    the plain transformers model, so they share one measurement; a sparse method keeps its budget
    (cache-aware masks depend on it).
    """
    checkpoint = str(spec.get("model", model_path))
    method = spec.get("method_spec")
    if method is None:
        return checkpoint, None, 1.0, None, None
    options = spec["options"]
    return (
        checkpoint,
        method,
        float(options["density"]),
        options.get("input_density"),
        options.get("memory_budget"),
    )


def perplexities(
    model_path: Path,
    specs: list[dict[str, Any]],
    *,
    num_tokens: int,
    context_length: int = 512,
    corpus: str = "shakespeare",
    progress: bool = True,
) -> dict[str, Any]:
    """Perplexity of each configuration on `num_tokens` of `corpus`'s test split, each distinct
    `perplexity_key` measured once: `{"corpus", "tokens", "context_length", "by_config": {name: ppl}}`."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    from ..data.corpora import corpus_tokens
    from ..training.checkpoints import load_checkpoint
    from .perplexity import evaluate, perplexity

    keys = {spec["name"]: perplexity_key(spec, model_path) for spec in specs}
    measured: dict[tuple[str, str | None, float, float | None, int | None], float] = {}
    for key in tqdm(
        list(dict.fromkeys(keys.values())), desc="perplexity", unit="config", disable=not progress
    ):
        checkpoint, method, density, input_density, budget = key
        window = {"context_length": context_length, "num_tokens": num_tokens, "progress": False}
        if method is None:
            ids = corpus_tokens(corpus, AutoTokenizer.from_pretrained(checkpoint), split="test")
            model = load_checkpoint(checkpoint, dtype=torch.bfloat16)
            measured[key] = perplexity(model, ids, **window).perplexity
        else:
            dip_options = {} if input_density is None else {"input_density": input_density}
            result = evaluate(
                checkpoint,
                corpus,
                method_spec=method,
                density=density,
                memory_budget=budget,
                **dip_options,
                **window,
            )
            measured[key] = result.perplexity
    return {
        "corpus": corpus,
        "tokens": num_tokens,
        "context_length": context_length,
        "by_config": {name: measured[key] for name, key in keys.items()},
    }


def run_bench(
    model_path: Path,
    specs: list[dict[str, Any]],
    *,
    new_tokens: int,
    out: Path,
    work_dir: Path | None = None,
    throughput: list[dict[str, Any]] | None = None,
    teacher_forced: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every spec, each in its own process, and return the report: `{"results": [...], "failed":
    [...], "pending": [...], "naive": ..., "throughput": [...], "best_throughput": ...}`.

    The report is written under `out` (`save`) before the first run and after each one, its ratios
    recomputed from the results so far (`add_ratios`): a bench takes long, and one interrupted or
    partly failing keeps what it measured. A configuration that fails is recorded in `failed` with
    its error and the bench goes on with the next; the caller decides what failures mean.
    `pending` names those not finished yet. Offload folders go under `work_dir`, or a temporary
    directory removed after.

    With `teacher_forced`, the first spec must be `ram`: every later one is fed its greedy tokens
    (`forced_tokens`, see `flashlm.eval.decode`), so that every row decodes the same text; if `ram`
    fails, the others are recorded as failed without running.
    """
    from tqdm.auto import tqdm

    names = [spec["name"] for spec in specs]
    if teacher_forced and (not specs or specs[0]["kind"] != "ram"):
        raise ConfigError(
            f"Teacher forcing feeds every configuration the greedy tokens of `ram`, which must run "
            f"first; the configurations are {names}."
        )
    forced_tokens = None
    report: dict[str, Any] = {
        "results": [],
        "failed": [],
        "pending": list(names),
        # The naive baseline is cold Accelerate where it is run: a cold run that fails leaves its
        # ratios empty rather than measured against the warm reference.
        "naive": NAIVE if NAIVE in names else "accelerate-warm",
        "throughput": throughput or [],
        "best_throughput": max((cell["bytes_per_s"] for cell in throughput or []), default=math.nan),
        "teacher_forced": teacher_forced,
    }
    save(report, out)
    with contextlib.ExitStack() as stack:
        if work_dir is None:
            scratch = "/var/tmp" if os.path.isdir("/var/tmp") else None
            work_dir = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="flashlm-bench-", dir=scratch))
            )
        bar = tqdm(specs, desc="flashlm bench", unit="config", disable=not progress)
        for spec in bar:
            bar.set_postfix_str(spec["name"])
            if forced_tokens is not None:
                spec = {**spec, "forced_tokens": forced_tokens}
            try:
                if teacher_forced and spec["kind"] != "ram" and forced_tokens is None:
                    raise RuntimeError("not run: teacher forcing needs the tokens of `ram`, which failed")
                result = run_in_subprocess(
                    spec, model_path, new_tokens=new_tokens, offload_dir=work_dir / spec["name"]
                )
            except Exception as exc:  # recorded; the next configurations still run
                report["failed"].append(
                    {"config": spec["name"], "kind": spec["kind"], "error": f"{type(exc).__name__}: {exc}"}
                )
            else:
                result.update({key: spec[key] for key in ("memory_layers", "model") if key in spec})
                report["results"].append(result)
                if teacher_forced and spec["kind"] == "ram":
                    forced_tokens = result["tokens"]
            report["pending"].pop(0)
            add_ratios(report)
            save(report, out)
    return report


def add_ratios(report: dict[str, Any]) -> None:
    """Each result's ratio to the naive baseline (`x_naive`) and its disk bound and fraction of it,
    from the results in `report` now: NaN while (or if) the naive baseline has no result."""
    best = report["best_throughput"]
    naive = next((r for r in report["results"] if r["config"] == report["naive"]), None)
    for result in report["results"]:
        result["x_naive"] = result["decode_tok_s"] / naive["decode_tok_s"] if naive else math.nan
        per_token = result.get("reader_bytes_per_token") or result["proc_read_bytes_per_token"]
        # Only rows whose weights really come from the disk have a disk bound (not RAM, not warm).
        streams = result["kind"] in ("accelerate-cold", "flashlm") and per_token > 0
        result["bound_tok_s"] = best / per_token if streams else math.inf
        result["fraction_of_bound"] = result["decode_tok_s"] / result["bound_tok_s"] if streams else math.nan


def add_perplexity(report: dict[str, Any], perplexity: dict[str, Any]) -> None:
    """Put each configuration's perplexity (from `perplexities`) into `report`, with how it was measured."""
    for result in report["results"]:
        result["perplexity"] = perplexity["by_config"][result["config"]]
    report["perplexity"] = {key: value for key, value in perplexity.items() if key != "by_config"}


def markdown(report: dict[str, Any]) -> str:
    """The report as a markdown table, with the disk measurement under it."""
    head = (
        "| configuration | regime | decode tok/s | x naive | prefill s | read/token (/proc) MB "
        "| reader MB/token | reads/token | hit rate | I/O / cache / compute ms | peak RSS MB | bound tok/s "
        "| of bound | tokens = ram | perplexity |"
    )
    lines = [head, "|" + "---|" * 15]
    ram = next((r for r in report["results"] if r["kind"] == "ram"), None)

    def number(value: float | None, fmt: str) -> str:
        return (
            "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)
        )

    for r in report["results"]:
        # compute includes what a method does to its weights before the product (Endor's move and
        # decompression; zero for the others)
        split = (
            f"{r['io_ms']:.1f} / {r['cache_ms']:.1f} / "
            f"{r['move_ms'] + r['decompress_ms'] + r['compute_ms']:.1f}"
            if "io_ms" in r
            else "—"
        )
        reader = r.get("reader_bytes_per_token")
        bound = r["bound_tok_s"]
        lines.append(
            f"| {r['config']} | {r['regime']} | {r['decode_tok_s']:.2f} | {number(r['x_naive'], '.2f')} "
            f"| {r['prefill_s']:.2f} | {r['proc_read_bytes_per_token'] / 1e6:.1f} "
            f"| {number(reader / 1e6 if reader is not None else None, '.1f')} "
            f"| {number(r.get('reads_per_token'), '.0f')} "
            f"| {number(r.get('hit_rate'), '.1%')} | {split} | {r['peak_rss'] / 1e6:.0f} "
            f"| {'∞' if math.isinf(bound) else number(bound, '.1f')} "
            f"| {number(r['fraction_of_bound'], '.1%')} "
            f"| {same_tokens(r, ram)} "
            f"| {number(r.get('perplexity'), '.2f')} |"
        )
    if report.get("teacher_forced"):
        lines.append(
            "\nTeacher-forced: every configuration after ram was fed ram's greedy tokens, so every row "
            "decoded the same text; where a row's own greedy tokens differ from ram's, `tokens = ram` "
            "gives the share of steps where they agreed."
        )
    if report["throughput"]:
        cells = ", ".join(
            f"{c['chunk_bytes'] >> 10} KiB x {c['threads']}: {c['bytes_per_s'] / 1e6:.0f} MB/s"
            for c in report["throughput"]
        )
        lines.append(f"\nDisk (O_DIRECT random reads): {cells}. Bound = best / bytes read per token.")
    for failure in report["failed"]:
        last = next((line for line in reversed(failure["error"].splitlines()) if line.strip()), "")
        lines.append(f"\nFailed: {failure['config']}: {last.strip()} (the whole error is in bench.json)")
    if report["pending"]:
        lines.append(f"\nNot run yet (in progress or interrupted): {', '.join(report['pending'])}.")
    lines.append(
        "\nThe split column's compute includes Endor's move and decompression (its cache column is 0: it "
        "has no cache). Tokens of `endor` (a pruned model) are not compared with the dense model's."
    )
    if "perplexity" in report:
        ppl = report["perplexity"]
        lines.append(
            f"\nPerplexity: {ppl['tokens']} tokens of {ppl['corpus']} (test split), context "
            f"{ppl['context_length']}. Rows that compute the dense model exactly share one dense "
            "measurement; Endor (lossless) is scored as its pruned checkpoint."
        )
    return "\n".join(lines)


def same_tokens(result: dict[str, Any], ram: dict[str, Any] | None) -> str:
    """The `tokens = ram` cell: whether a row's greedy tokens are ram's (teacher-forced: the share of
    steps where they agreed, when not all did); a pruned checkpoint's (`model`) are not compared."""
    if ram is None or "model" in result:
        return "—"
    if result["tokens"] == ram["tokens"]:
        return "yes"
    return f"NO ({result['agreement']:.0%} agree)" if result.get("forced") else "NO"


def plot(report: dict[str, Any], path: Path) -> Path:
    """Decode tokens/s against perplexity, one point per configuration (DIP Fig. 10, right)."""
    from .sweep import plot_throughput_vs_perplexity

    rows = [
        {"method": r["config"], "perplexity": r["perplexity"], "decode_tok_s": r["decode_tok_s"]}
        for r in report["results"]
    ]
    return plot_throughput_vs_perplexity(rows, path)


def save(report: dict[str, Any], out: Path) -> list[Path]:
    """Write `bench.json`, `bench.md` and, when perplexity was measured, `bench.png` under `out`, each
    under a temporary name renamed into place: the report is rewritten while the bench runs, and
    a reader (or a bench killed mid-write) sees the previous file or the new one, never half."""
    out.mkdir(parents=True, exist_ok=True)
    written = [
        _write_atomic(out / "bench.json", json.dumps(report, indent=1, default=str)),
        _write_atomic(out / "bench.md", markdown(report) + "\n"),
    ]
    if "perplexity" in report:
        written.append(plot(report, out / "bench.png"))  # save_figure renames into place too
    return written


def _write_atomic(path: Path, text: str) -> Path:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
