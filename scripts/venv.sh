# Sourced by scripts/demo.sh and scripts/test.sh: make (once) the project's virtual
# environment and install orch into it, so that nothing is installed into the system's
# python (Debian and Ubuntu refuse that: PEP 668, "externally-managed-environment").
#
#   ORCH_VENV   where the venv goes (default: .venv in the checkout)
#   PYTHON      the python3 that makes it (default: python3; orch needs >= 3.10)
#
# Debian/Ubuntu ship python3 without `venv`'s pip (package python3-venv); as root it is
# installed with apt, otherwise the message says the one command to run.

orch_venv() {  # orch_venv EXTRAS: "" or "[test]"; sets ORCH_PY to the venv's python
  local extras=$1 py=${PYTHON:-python3}
  ORCH_VENV=${ORCH_VENV:-$PWD/.venv}
  if ! command -v "$py" >/dev/null 2>&1; then
    echo "no $py on PATH: install Python >= 3.10 (Debian/Ubuntu: apt-get install python3 python3-venv)" >&2
    return 1
  fi
  if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "$py is $("$py" -V 2>&1); orch needs Python >= 3.10 (set PYTHON=/path/to/python3.X)" >&2
    return 1
  fi
  if [ -x "$ORCH_VENV/bin/python" ] && ! "$ORCH_VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    # a venv without pip (uv venv, --without-pip): give it pip rather than remove it
    "$ORCH_VENV/bin/python" -m ensurepip -q >/dev/null 2>&1 || {
      echo "$ORCH_VENV has no pip and ensurepip cannot add one: remove it or set ORCH_VENV to another directory" >&2
      return 1
    }
  fi
  if [ ! -x "$ORCH_VENV/bin/python" ]; then
    if ! "$py" -c 'import ensurepip' >/dev/null 2>&1; then  # Debian/Ubuntu: venv's pip is a package of its own
      local pkg
      pkg="$("$py" -c 'import sys; print("python%d.%d-venv" % sys.version_info[:2])')"
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing $pkg (python3 -m venv needs it) ..." >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "$pkg" >/dev/null 2>&1 \
          || apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
      else
        echo "$py cannot make a venv with pip: install the venv module first (Debian/Ubuntu: sudo apt-get install $pkg)" >&2
        return 1
      fi
    fi
    "$py" -m venv "$ORCH_VENV" || { echo "$py -m venv $ORCH_VENV failed (above: why)" >&2; return 1; }
  fi
  ORCH_PY=$ORCH_VENV/bin/python
  "$ORCH_PY" -m pip install -q --disable-pip-version-check --no-input -e ".$extras"
}
