"""`FlashConfig`: validation, byte sizes, what is persisted and what stays on the machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import flashlm
from flashlm._utils import format_bytes, parse_bytes, peak_rss_bytes
from flashlm.cache.policies import POLICIES
from flashlm.config import Budget, FlashConfig
from flashlm.errors import ConfigError
from flashlm.methods import METHODS


@pytest.mark.parametrize(
    ("text", "expected"),
    [(1024, 1024), ("512MB", 512 * 10**6), ("1.5GiB", int(1.5 * 2**30)), ("10 kb", 10_000), ("7", 7)],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["lots", "5 parsecs", "-3MB", -1, True, "1e3MB"])
def test_parse_bytes_rejects_what_it_cannot_read(bad):
    with pytest.raises(ConfigError):
        parse_bytes(bad)


def test_format_bytes():
    assert format_bytes(999) == "999 B"
    assert format_bytes(1_536_000) == "1.54 MB"


def test_budget_forms():
    assert Budget.parse("25%").resolve(1000) == 250
    assert Budget.parse("2MB").resolve(1000) == 2_000_000
    assert Budget.parse(4096).resolve(10) == 4096
    with pytest.raises(ConfigError, match="ambiguous"):
        Budget.parse(0.5)
    with pytest.raises(ConfigError, match="positive"):
        Budget.parse("0%")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"method": "magic"}, "Available methods: cats, dense, dip, endor"),
        ({"density": 0.0}, r"\(0, 1\]"),
        ({"density": 1.5}, r"\(0, 1\]"),
        ({"density": "half"}, "number"),
        ({"method": "dense", "density": 0.5}, "density must be 1.0"),
        ({"policy": "random"}, "lfu, lru, window, none"),
        ({"window": 0}, "window"),
        ({"io_threads": 0}, "io_threads"),
        ({"io_chunk_bytes": 1000}, "multiple of 4096"),
        ({"direct_io": "yes"}, "direct_io"),
        ({"memory_budget": "a lot"}, "byte size"),
        ({"colour": "blue"}, "Unknown FlashConfig option"),
    ],
)
def test_bad_options_raise_config_error(options, message):
    with pytest.raises(ConfigError, match=message):
        FlashConfig(**options)


def test_only_persisted_options_are_saved():
    config = FlashConfig(
        method="dip",
        density=0.5,
        cache_aware=0.2,
        policy="window",
        window=3,
        store="/somewhere",
        memory_budget="1GB",
        io_threads=2,
        sequential_prefill=True,
        record_trace=True,
    )
    saved = config.to_dict()
    assert saved == {
        "quant_method": "flashlm",
        "method": "dip",
        "density": 0.5,
        "input_density": None,
        "cache_aware": 0.2,
        "threshold": "token",
        "policy": "window",
        "window": 3,
        "flashlm_version": flashlm.__version__,
    }
    restored = FlashConfig.from_dict(saved)
    assert (restored.method, restored.cache_aware, restored.policy, restored.window) == (
        "dip",
        0.2,
        "window",
        3,
    )
    assert restored.store is None
    assert (restored.sequential_prefill, restored.record_trace) == (False, False)


def test_runtime_defaults_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("FLASHLM_STORE", "/stores/x.flash")
    monkeypatch.setenv("FLASHLM_MEMORY_BUDGET", "3GB")
    config = FlashConfig()
    assert config.store == "/stores/x.flash"
    assert config.budget.resolve(0) == 3 * 10**9
    assert FlashConfig(memory_budget="10%").budget.fraction == pytest.approx(0.1)


def test_an_offline_policy_is_refused_with_where_it_runs():
    with pytest.raises(ConfigError, match="offline replay"):
        FlashConfig(policy="belady")


README = Path(__file__).resolve().parents[1] / "README.md"


def _option_row(option: str) -> str:
    rows = [line for line in README.read_text().splitlines() if line.startswith(f"| `{option}` |")]
    assert len(rows) == 1, f"README's options table has {len(rows)} rows for {option!r}"
    return rows[0]


@pytest.mark.parametrize(
    ("option", "registry"), [("method", METHODS), ("policy", POLICIES)], ids=["method", "policy"]
)
def test_the_readme_names_every_registered_choice(option, registry):
    """The docs read the same registries as the config and the CLI: a new method or policy that the
    README's options table does not name fails here."""
    row = _option_row(option)
    assert [name for name in registry if f'`"{name}"`' not in row] == []


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs Linux's /proc/self/status")
def test_a_childs_peak_memory_is_its_own_not_its_parents():
    """`ru_maxrss` of a process started by a large parent counts the parent's pages at the fork, so the
    decode rows, each measured in a child of the benchmark, would report the benchmark's size."""
    ballast = b"\x01" * (768 << 20)  # written, hence resident
    script = (
        "import resource; from flashlm._utils import peak_rss_bytes; "
        "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    own, inherited = map(int, out.split())
    assert inherited >= len(ballast) > own > 0
    assert peak_rss_bytes() >= len(ballast)
    del ballast
