#!/usr/bin/env bash
# Set up (launch/setup.sh --runtime: without the test extras), then train the embedded default cluster:
# 2 virtual workers x 2 emulated GPUs of different speeds, MNIST CNN, PS + WSP, all on this machine.
# Extra arguments go to `hetpipe train`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh --runtime
exec .venv/bin/hetpipe train "$@"
