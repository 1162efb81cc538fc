#!/usr/bin/env bash
# Installs what the end-to-end training tests (tests/e2e) and the training playbooks
# (playbooks/mindspore-msrun, playbooks/mpi-allreduce) need, on a Debian/Ubuntu machine
# as root, with no stdin. Idempotent: a second run only checks (a few seconds).
#
#   - apt: libopenmpi-dev (mpicc + mpi.h, to build mpi4py against the system Open MPI)
#   - a venv, $ORCH_TRAIN_VENV (default /opt/orch-venvs/train), made from the python3 that
#     runs the tests, holding mindspore==2.10.0 (CPU; ~800 MB wheel, provides `msrun`),
#     torch==2.13.0 (the CPU build, which these machines keep on disk; provides `torchrun`),
#     mpi4py (built from source with mpicc, so it talks to the same Open MPI as `mpirun`)
#     and numpy.
#
# Why a venv under /opt and not this machine's python: lab hosts (`orch lab up`) see this
# machine's root filesystem except /data, /tmp, /root (overlay), /opt/orch-lab and
# /etc/hccn.conf, so /opt/orch-venvs is the same directory on every lab host; and the
# python3 lab hosts find on PATH (this machine's system python3, as on a real host) stays
# free of MindSpore, so `orch check` version tests that expect "not installed" keep meaning
# what they say.
# Playbooks put "$ORCH_TRAIN_VENV/bin" first on PATH through job.env.
#
# The pip cache (~/.cache/pip) is used: a fresh venv from a warm cache takes ~1 min.
set -euo pipefail

VENV=${ORCH_TRAIN_VENV:-/opt/orch-venvs/train}
PY=${PYTHON:-python3}
MS_VERSION=2.10.0
TORCH_VERSION=2.13.0
PIP=(--disable-pip-version-check --no-input -q)

log() { echo "install-e2e-deps: $*" >&2; }

as_root_apt() {
  if [ "$(id -u)" != 0 ]; then
    log "missing apt packages: $* (install them, or run as root)"
    return 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# 1. Open MPI headers + mpicc (openmpi-bin itself comes from scripts/test.sh), a C compiler.
apt_missing=()
if ! { command -v mpicc >/dev/null 2>&1 && [ -n "$(mpicc --showme:incdirs 2>/dev/null)" ] \
       && [ -f "$(mpicc --showme:incdirs 2>/dev/null | awk '{print $1}')/mpi.h" ]; }; then
  apt_missing+=(libopenmpi-dev openmpi-bin)
fi
command -v cc >/dev/null 2>&1 || apt_missing+=(gcc)
if [ ${#apt_missing[@]} -gt 0 ]; then
  as_root_apt "${apt_missing[@]}"
fi

# 2. Already complete? (versions match, mpi4py is linked to Open MPI, msrun is there)
check() {
  [ -x "$VENV/bin/python" ] && [ -x "$VENV/bin/msrun" ] && [ -x "$VENV/bin/torchrun" ] || return 1
  "$VENV/bin/python" - "$MS_VERSION" "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
    "$TORCH_VERSION" <<'EOF' 2>/dev/null
import importlib.metadata as m, sys
want_ms, want_py, want_torch = sys.argv[1], sys.argv[2], sys.argv[3]
assert "%d.%d" % sys.version_info[:2] == want_py, "python changed"
assert m.version("mindspore") == want_ms, "mindspore version"
assert m.version("torch").split("+")[0] == want_torch, "torch version"
import numpy  # noqa: F401
import mpi4py
mpi4py.rc.initialize = False
from mpi4py import MPI
assert "Open MPI" in MPI.Get_library_version(), "mpi4py not linked to Open MPI"
EOF
}
if check; then
  log "ok: $VENV (mindspore $MS_VERSION, torch $TORCH_VERSION, mpi4py, numpy) already installed"
  exit 0
fi

# 3. The venv (recreated if it is broken or made from another python version).
t0=$(date +%s)
if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
  rm -rf "$VENV"
fi
want_py=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
have_py=$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)
if [ "$have_py" != "$want_py" ]; then
  mkdir -p "$(dirname "$VENV")"
  if ! "$PY" -m venv --clear "$VENV" 2>/dev/null; then
    # Debian's own python3 needs python3-venv (ensurepip) for this
    as_root_apt python3-venv
    "$PY" -m venv --clear "$VENV"
  fi
fi

# 4. The packages. mpi4py from source: mpicc links it to the system Open MPI (a binary
# wheel could bring another MPI). pip keeps the wheel it builds in its cache.
if ! "$PY" -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
  as_root_apt python3-dev   # Debian's own python3 ships its headers apart
fi
log "installing mindspore==$MS_VERSION, torch==$TORCH_VERSION, numpy, mpi4py into $VENV (first time: several minutes)"
"$VENV/bin/python" -m pip install "${PIP[@]}" "mindspore==$MS_VERSION" numpy
# torch on its own line: `pip install torch==2.13.0` takes the CPU build these machines keep on disk
"$VENV/bin/python" -m pip install "${PIP[@]}" "torch==$TORCH_VERSION"
MPICC=$(command -v mpicc) "$VENV/bin/python" -m pip install "${PIP[@]}" --no-binary mpi4py mpi4py
if ! check; then  # an mpi4py that is there but talks to another MPI: rebuild it, not from the cache
  MPICC=$(command -v mpicc) "$VENV/bin/python" -m pip install "${PIP[@]}" --no-binary mpi4py \
    --force-reinstall --no-deps --no-cache-dir mpi4py
fi

if ! check; then
  log "FAILED: $VENV is still incomplete after installing"
  exit 1
fi
log "installed into $VENV in $(( $(date +%s) - t0 ))s"
