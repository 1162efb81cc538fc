#!/usr/bin/env bash
# Installs everything the test suite needs on a fresh Debian/Ubuntu machine (root),
# then runs the whole suite, lab (multi-host) tests included.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v sshd >/dev/null 2>&1 || [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
command -v ssh >/dev/null 2>&1 || missing+=(openssh-client)
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v nsenter >/dev/null 2>&1 || missing+=(util-linux)
command -v ps >/dev/null 2>&1 || missing+=(procps)
# lab hosts run this machine's system python3 (the first on a real host's standard PATH), never
# the venv or pyenv python that runs orch (orchestrator/lab/system.py: host_python)
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin command -v python3 >/dev/null 2>&1 \
  || missing+=(python3)
# the Slurm lab (orch lab up --slurm): slurmctld here, slurmd in every lab host
{ command -v slurmctld >/dev/null 2>&1 || [ -x /usr/sbin/slurmctld ]; } || missing+=(slurm-wlm)
{ command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ]; } || missing+=(munge)
# orch report's page is opened in a real headless browser (tests/integration/test_report.py)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "missing packages: ${missing[*]} (install them, or run as root)" >&2
  fi
fi

# orch and the test tools go into the project's venv (.venv, scripts/venv.sh), never into the
# system's python (Debian and Ubuntu refuse that: PEP 668)
. scripts/venv.sh
orch_venv "[test]"

# lint and type checks first: seconds, and a finding fails the run (scripts/lint.sh)
ORCH_PY="$ORCH_PY" bash scripts/lint.sh

# The end-to-end training tests (tests/e2e) run real MindSpore (msrun) and mpi4py (mpirun)
# jobs on the lab: libopenmpi-dev + a venv at /opt/orch-venvs/train. Quick when installed;
# ~8 min on a fresh machine, ~1.5 min with a warm pip cache.
if [ "$(id -u)" = 0 ]; then
  bash scripts/install-e2e-deps.sh
else
  echo "not root: not installing the e2e training dependencies (the lab tests skip without root)" >&2
fi

exec "$ORCH_PY" -m pytest -q -p no:cacheprovider "$@"
