#!/usr/bin/env bash
# The main job: compile examples/ through NVRTC and the nvcc launcher, cold then warm.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/kernelcache demo "$@"
