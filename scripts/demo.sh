#!/usr/bin/env bash
# The main job on a fresh machine: make .venv (scripts/venv.sh), install orch into it, then
# run the 4-rank data-parallel demo on this machine (playbooks/local-demo.yaml). Needs
# nothing but Python >= 3.10 (and, on Debian/Ubuntu, its venv module: installed as root).
# Arguments go to `orch up` (e.g. -q, --detach).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
orch_venv ""
"$ORCH_VENV/bin/orch" up playbooks/local-demo.yaml "$@"
echo
echo "orch is installed in $ORCH_VENV: run \`. $ORCH_VENV/bin/activate\`, then, from $PWD (where the run is" \
     "recorded), e.g. \`orch logs --rank 3\` or \`orch status\`"
