#!/usr/bin/env bash
# Line coverage of sparktrain/ in the quick tier and in the full suite, counting every Python
# process the tests start (Spark's Python workers, rank processes, decode workers, jobs):
#
#   ./scripts/coverage.sh           # the quick tier (`pytest tests`), then its report
#   ./scripts/coverage.sh --full    # ... and the tests only the full suite runs (`--full -m full`),
#                                   # then both figures and how much of the full suite's lines
#                                   # the quick tier covers
#   ./scripts/coverage.sh --full --reuse-quick  # only the full-only tests, with the quick
#                                   # tier's data of the last run (same code)
#   ./scripts/coverage.sh --report  # the figures again from the data of the last runs
#
# Extra arguments go to pytest. Needs ./scripts/setup.sh --tests (--full-tests with --full).
# The data stays in .coverage-data/ (quick/, full-only/; HTML reports in quick-html/, full-html/).
#
# How: COVERAGE_PROCESS_START names pyproject.toml ([tool.coverage.*]); coverage's .pth file,
# installed with it, then starts measuring in every new Python of the venv, the way Spark's own
# python/run-tests-with-coverage does with a sitecustomize. `patch = _exit, fork` saves what
# Spark's forked workers measured before they end with os._exit.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-$root/.venv/bin/python}"
data="$root/.coverage-data"
full="" report_only="" reuse_quick=""
args=()
for arg in "$@"; do
  case "$arg" in
    --full) full=1 ;;
    --report) report_only=1 ;;
    --reuse-quick) reuse_quick=1 ;;
    *) args+=("$arg") ;;
  esac
done
"$python" -c "import coverage, sys; sys.exit(coverage.version_info < (7, 10))" 2>/dev/null \
  || { echo "coverage >= 7.10 is missing: run ./scripts/setup.sh --tests" >&2; exit 1; }

measure() {  # measure NAME PYTEST-ARGS...: the tests under coverage, data in $data/NAME
  local name="$1"; shift
  rm -rf "${data:?}/$name" && mkdir -p "$data/$name"
  echo "[coverage] $name: pytest $*" >&2
  local rc=0
  COVERAGE_PROCESS_START="$root/pyproject.toml" COVERAGE_FILE="$data/$name/.coverage" \
    "$python" -m pytest tests -p no:cacheprovider "$@" || rc=$?
  "$python" -m coverage combine -q --data-file="$data/$name/.coverage" "$data/$name" \
    || { echo "[coverage] $name: no data was written" >&2; exit 1; }
  return $rc
}

rc=0
if [ -z "$report_only" ]; then
  [ -n "$reuse_quick" ] && [ -f "$data/quick/.coverage" ] || measure quick ${args[@]+"${args[@]}"} || rc=$?
  if [ -n "$full" ]; then
    measure full-only --full -m full ${args[@]+"${args[@]}"} || rc=$?
  fi
fi
"$python" "$root/scripts/coverage_tiers.py" "$data"
[ "$rc" = 0 ] || echo "[coverage] some tests failed (pytest exit $rc): the figures count what ran" >&2
exit "$rc"
