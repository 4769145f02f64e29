#!/usr/bin/env bash
# Create .venv and install kernelcache with every extra; re-runs only when pyproject.toml or the
# version (src/kernelcache/__init__.py) changes.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
stamp=.venv/.kernelcache-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ src/kernelcache/__init__.py -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # The DSL extras (tilelang, ninetoothed) depend on torch. The CPU build
    # (a wheel this machine keeps locally) goes in FIRST: left to their
    # requirements, pip would pull the CUDA build and several GB of nvidia-* wheels.
    if ! .venv/bin/python -c "import torch" 2>/dev/null; then
        .venv/bin/python -m pip install -q "torch==2.13.0"
    fi
    .venv/bin/python -m pip install -q -e ".[all,tilelang,ninetoothed]"
    touch "$stamp"
fi
