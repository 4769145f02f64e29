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
    .venv/bin/python -m pip install -q -e ".[all]"
    touch "$stamp"
fi
