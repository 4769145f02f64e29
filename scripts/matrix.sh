#!/usr/bin/env bash
# The version matrix: each integration's own tests against each release of its tool.
#   scripts/matrix.sh [integration] [version]   run those cells (all by default), record the
#                                               results in docs/matrix.json and render the table
#                                               of docs/compatibility.md
#   scripts/matrix.sh --ci                      only the cells marked "ci" (scripts/test.sh); records nothing
#   scripts/matrix.sh --list [integration]      the cells, run nothing
#   scripts/matrix.sh --render                  render docs/compatibility.md from docs/matrix.json
# The cells are scripts/matrix.cells; each gets its own venv under
# ${KERNELCACHE_MATRIX_DIR:-~/.cache/kernelcache-matrix}/<integration>-<version>/, built on
# first use and kept (the CUDA builds of torch are ~5 GB each). Details: scripts/matrix.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/matrix.py "$@"
