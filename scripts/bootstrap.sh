#!/usr/bin/env bash
# Create .venv and install kernelcache with every extra; re-runs when pyproject.toml or the
# version (src/kernelcache/__init__.py) changes, or a DSL package (torch, tilelang,
# ninetoothed, jax) is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
stamp=.venv/.kernelcache-installed
missing() {
    # find_spec, not import: importing tilelang alone takes seconds.
    ! .venv/bin/python -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" "$@"
}
# bin/kernelcache is installed as a copy (setuptools script-files): an edit needs a reinstall.
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ src/kernelcache/__init__.py -nt "$stamp" ] \
    || [ bin/kernelcache -nt "$stamp" ] || missing torch tilelang ninetoothed jax mkdocs material; then
    .venv/bin/python -m pip install -q --upgrade pip
    # The DSL extras (tilelang, ninetoothed) depend on torch. The CPU build
    # (a wheel this machine keeps locally) goes in FIRST: left to their
    # requirements, pip would pull the CUDA build and several GB of nvidia-* wheels.
    # A torch already in .venv stays as it is (the inductor extra asks torch>=2.10).
    if missing torch; then
        .venv/bin/python -m pip install -q "torch==2.13.0"
    fi
    .venv/bin/python -m pip install -q -e ".[all,tilelang,ninetoothed,inductor,jax,docs]"
    touch "$stamp"
fi
# The quick start leaves a usable command: say which, unless PATH already finds it (issue 20).
here=$(pwd -P)
if [ "$(command -v kernelcache 2>/dev/null)" != "$here/.venv/bin/kernelcache" ]; then
    echo "kernelcache: the command is $here/.venv/bin/kernelcache (not on PATH; to add it: export PATH=\"$here/.venv/bin:\$PATH\")" >&2
fi
