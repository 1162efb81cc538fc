#!/usr/bin/env bash
# Lint (ruff) and type-check (mypy) the project, as configured in pyproject.toml; exits non-zero
# on any finding. scripts/test.sh runs it first, so CI does too. By hand:
#
#   . scripts/venv.sh && orch_venv "[test]"     # once: the venv with ruff, mypy and the stubs
#   bash scripts/lint.sh
#
# The python that has them: $ORCH_PY (set by orch_venv), else .venv/bin/python.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${ORCH_PY:-.venv/bin/python}
if ! "$py" -c 'import mypy, ruff' >/dev/null 2>&1; then
  echo "lint: no ruff/mypy in $py: run  . scripts/venv.sh && orch_venv \"[test]\"  first" >&2
  exit 2
fi
rc=0
echo "lint: ruff check" >&2
"$py" -m ruff check --no-fix --output-format concise . || rc=1
echo "lint: mypy" >&2
"$py" -m mypy || rc=1
# a deliberate exception says why, on its line: `# noqa: CODE - why`, `# type: ignore[code]  # why`
bare=$(git ls-files '*.py' | xargs -r grep -nE '# noqa(: *[A-Z]+[0-9]+(, *[A-Z]+[0-9]+)*)? *$|# type: ignore(\[[-a-z, ]+\])? *$' || true)
if [ -n "$bare" ]; then
  echo "$bare" >&2
  echo "lint: the noqa/type: ignore above carry no reason" >&2
  rc=1
fi
if [ "$rc" != 0 ]; then
  echo "lint: findings above (fix them; a deliberate exception carries its reason: # noqa: CODE - why, # type: ignore[code]  # why)" >&2
fi
exit "$rc"
