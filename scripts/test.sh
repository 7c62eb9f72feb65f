#!/usr/bin/env bash
# Installs what the test suite needs, then runs it. The README's test command and .ci/run both call this.
#
#   Debian packages (when apt-get is there and they are missing): chromium (the dashboard is checked in
#   headless Chromium), prometheus (promtool checks the /metrics format) and postgresql-15 (initdb and pg_ctl
#   run a throwaway cluster for the PostgresStore tests).
#   Python: torch 2.13.0 (CPU build), then this project in editable mode with its [server] and [test] extras
#   (the service; the reference libraries that serve as oracles: optax, jax-privacy, declearn, opacus; the
#   DP-SGD examples' scikit-learn and matplotlib; NVFlare 2.9.0 (tests/test_nvflare.py runs its simulator); pytest, hypothesis, import-linter, ruff, mypy, mkdocs), then the import
#   contracts (lint-imports), the lint rules (ruff), the type checker (mypy over clipd/), the documentation site
#   (mkdocs build --strict)
#   and the suite.
#
#   Then the Flower tests (tests/flower), in environments of their own under .cache/ (git-ignored, kept
#   between runs, rebuilt when pyproject.toml changes):
#     .cache/flower-venv        flwr 1.41.0 (+ dp-accounting, for its RdpAccountant) + clipd from this tree
#                               WITHOUT the server extra (protobuf 6.x:
#                               flwr wants < 7), which proves the client side installs beside Flower;
#     .cache/client-floor-venv  clipd's client side at its lowest versions (protobuf 5.28.0, grpcio 1.67.1,
#                               numpy 1.26.4).
#   They start a clipd server as a subprocess with this environment's Python (CLIPD_SERVER_PYTHON).
#
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/test_store.py -x`; the Flower tests then
# run only with CLIPD_FLOWER_TESTS=1. `bash scripts/test.sh --flower [ARGS]` runs only the Flower tests.
# CLIPD_FLOWER_TESTS=0 skips them.
set -euo pipefail
cd "$(dirname "$0")/.."

flower_only=0
if [ "${1:-}" = "--flower" ]; then
  flower_only=1
  shift
fi

missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
command -v initdb >/dev/null 2>&1 || [ -x /usr/lib/postgresql/15/bin/initdb ] || missing+=(postgresql-15)
if [ "$flower_only" -eq 0 ] && [ ${#missing[@]} -gt 0 ]; then
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
# tests/test_postgres_store.py runs a throwaway cluster with Debian's initdb and pg_ctl (not on PATH by default).
[ -d /usr/lib/postgresql/15/bin ] && export PATH="$PATH:/usr/lib/postgresql/15/bin"

# torch first, pinned (as in the [test] extra): its CPU build here; opacus, installed after it, then takes it.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[server,test]"

if [ "$flower_only" -eq 0 ]; then
  # The import contracts (.importlinter): the engine imports nothing of the service or the client, the client
  # nothing of the server or the engine, and no folder's modules or packages import each other in a circle.
  lint-imports
  # The lint rules of [tool.ruff.lint] in pyproject.toml (pyflakes, pycodestyle, isort, bugbear, pyupgrade).
  ruff check --quiet clipd/ tests/ benchmarks/ examples/
  # The type checker over clipd/ ([tool.mypy] in pyproject.toml; the generated clipd/v1 code is left out).
  mypy --no-error-summary
  # The docs site (mkdocs.yml, docs/) in strict mode: a broken link or anchor, or a page not in nav, fails.
  python -m mkdocs build --strict --quiet --site-dir "$(mktemp -d)"
  python -m pytest "$@"
  flower="${CLIPD_FLOWER_TESTS:-auto}"
  if [ "$flower" = 0 ] || { [ "$flower" = auto ] && [ $# -gt 0 ]; }; then
    exit 0
  fi
  set --
fi

# A venv under .cache/, rebuilt when its recipe (pyproject.toml, the pins, the Python) changes.
make_venv() {  # make_venv DIR PIP_ARGS...
  local dir="$1"
  shift
  local stamp
  stamp="$( { cat pyproject.toml; echo "$*"; python -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)"
  if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.clipd-stamp" 2>/dev/null)" = "$stamp" ]; then
    return
  fi
  echo "scripts/test.sh: building $dir"
  rm -rf "$dir"
  python -m venv "$dir"
  "$dir/bin/python" -m pip install -q --disable-pip-version-check "$@"
  "$dir/bin/python" -m pip check >/dev/null
  echo "$stamp" >"$dir/.clipd-stamp"
}
make_venv .cache/flower-venv -e ".[flower]" "pytest>=8" "dp-accounting==0.6.0"  # dp-accounting: Flower's RdpAccountant needs it
make_venv .cache/client-floor-venv -e . "protobuf==5.28.0" "grpcio==1.67.1" "numpy==1.26.4"

CLIPD_SERVER_PYTHON="$(python -c 'import sys; print(sys.executable)')" \
CLIPD_FLOOR_PYTHON="$PWD/.cache/client-floor-venv/bin/python" \
  exec .cache/flower-venv/bin/python -m pytest -p no:cacheprovider --confcutdir tests/flower tests/flower "$@"
