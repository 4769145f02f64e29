#!/usr/bin/env bash
# The test command: installs what it needs, then lint, types and the test suite under coverage.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
if ! command -v redis-server >/dev/null 2>&1; then
    # The tests start their own redis-server on a free loopback port; only the binary is needed.
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
fi
if ! command -v radosgw >/dev/null 2>&1 || ! command -v nginx >/dev/null 2>&1; then
    # The S3 and HTTP tiers' tests start their own radosgw (a one-OSD Ceph cluster) and
    # nginx WebDAV server on free loopback ports, inside the test's directory.
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq radosgw ceph-mon ceph-osd ceph-common nginx >/dev/null
fi
if [ -e /dev/fuse ] && { ! command -v fusermount3 >/dev/null 2>&1 || [ ! -e /usr/include/fuse3/fuse_lowlevel.h ]; }; then
    # The shared-filesystem tests mount a fault-injecting FUSE filesystem (tests/netfs/netfs.c),
    # compiled by the tests with cc against libfuse3.
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq fuse3 libfuse3-dev >/dev/null
fi
.venv/bin/ruff check src tests benchmarks scripts
.venv/bin/ruff format --check src tests benchmarks scripts
.venv/bin/mypy
# The documentation site: a broken link, a missing page or anchor fails the build (issue 39).
# Its snippets run in tests/test_docs.py; this line says how many.
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
.venv/bin/python scripts/docs_gen.py count
# Coverage follows every Python process the tests start (pyproject: [tool.coverage]),
# pytest-xdist's two workers included; the report fails below its floor (fail_under).
# Two workers: most tests wait on one compiler process at a time (nvcc, g++, torch);
# on a 2-core machine the suite took 13 min this way (one process: 23.5 min, before
# the slowest tests were trimmed).
# KERNELCACHE_TEST_WORKERS=0 runs it in one process. The 25 slowest tests are listed at the end.
rm -f .coverage .coverage.*
# Byte-compile what the tests import, where the environment says not to: hundreds of test
# subprocesses (the CLI, launcher servers, workers) import kernelcache from src/, and
# without .pyc files each one compiles those modules again (~90 ms for the CLI's).
unset PYTHONDONTWRITEBYTECODE
.venv/bin/python -m coverage run -m pytest -n "${KERNELCACHE_TEST_WORKERS:-2}" --durations=25 "$@"
.venv/bin/python -m coverage combine -q
.venv/bin/python -m coverage report
# The version matrix's CI cells (scripts/matrix.cells, "ci"): the oldest and newest tested
# release of each tool, each in its own venv under ~/.cache/kernelcache-matrix (built on
# first use, ~5 GB and a few minutes per torch release; then reused). A failing cell fails here.
# KERNELCACHE_MATRIX=0 skips them (a run of a few test files, say).
if [ "${KERNELCACHE_MATRIX:-1}" != 0 ]; then
    bash scripts/matrix.sh --ci
fi
