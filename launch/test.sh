#!/usr/bin/env bash
# Set up (launch/setup.sh), then run the whole test suite, slow multi-process tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
exec .venv/bin/python -m pytest -q "$@"
