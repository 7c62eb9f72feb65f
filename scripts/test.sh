#!/usr/bin/env bash
# Installs what the test suite needs, then runs it. The README's test command and .ci/run both call this.
#
#   Debian packages (when apt-get is there and they are missing): chromium (the dashboard is checked in
#   headless Chromium) and prometheus (promtool checks the /metrics format).
#   Python: this project in editable mode with its [server] and [test] extras (the service; the reference
#   libraries that serve as oracles: optax, jax-privacy, declearn; pytest, hypothesis).
#
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/test_store.py -x`.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "scripts/test.sh: missing ${missing[*]} and there is no apt-get to install them" >&2
    exit 1
  fi
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "scripts/test.sh: installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

python -m pip install -q -e ".[server,test]"
exec python -m pytest "$@"
