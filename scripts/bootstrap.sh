#!/usr/bin/env bash
# Sets up the project's environments from nothing; safe to re-run.
#   scripts/bootstrap.sh          -> .venv (Python 3.12, rjax and its test tools)
#   scripts/bootstrap.sh oracle   -> also .oracle-venv (Python 3.11, CPU torch + transformers),
#                                    the independent implementation the tests compare against.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {  # $1 = version, e.g. 3.12
  local v=$1 c
  for c in "python$v" "$(pyenv root 2>/dev/null)/versions/$v"*/bin/"python$v" \
           "$HOME/.pyenv/versions/$v"*/bin/"python$v" "/usr/bin/python$v" "/usr/local/bin/python$v"; do
    if [ -x "$(command -v "$c" 2>/dev/null)" ] && "$c" -c 'import venv' >/dev/null 2>&1; then
      command -v "$c"; return 0
    fi
  done
  echo "bootstrap: no Python $v found (tried python$v on PATH and pyenv's versions)" >&2
  return 1
}

stamp_ok() {  # $1 venv, $2 stamp content: skip reinstall when inputs are unchanged
  [ -f "$1/.rjax-stamp" ] && [ "$(cat "$1/.rjax-stamp")" = "$2" ]
}

main_stamp="$(cat pyproject.toml | sha256sum)"
if ! stamp_ok .venv "$main_stamp"; then
  py=$(find_python 3.12)
  [ -x .venv/bin/python ] || "$py" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[test]'
  echo "$main_stamp" > .venv/.rjax-stamp
fi

if [ "${1:-}" = oracle ]; then
  oracle_stamp="$(cat tests/oracle/requirements.txt | sha256sum)"
  if ! stamp_ok .oracle-venv "$oracle_stamp"; then
    py=$(find_python 3.11)
    [ -x .oracle-venv/bin/python ] || "$py" -m venv .oracle-venv
    .oracle-venv/bin/python -m pip install -q --upgrade pip
    .oracle-venv/bin/python -m pip install -q -r tests/oracle/requirements.txt
    echo "$oracle_stamp" > .oracle-venv/.rjax-stamp
  fi
fi
