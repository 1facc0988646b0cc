#!/usr/bin/env bash
# Test modules run one at a time, each alone and without xdist: the way a contributor runs one
# file (`pytest -q tests/test_online.py`), torch on every core and each module building its own
# session fixtures. The README's command runs the suite on two xdist workers at one thread each
# (tests/conftest.py), which can hide what a test silently depends on: a thread count, a fixture
# another module built, a timing. CONTRIBUTING.md says when to run this.
#
#   bash tests/run_modules_alone.sh                the modules that start stages or processes
#   bash tests/run_modules_alone.sh --all          every module
#   bash tests/run_modules_alone.sh tests/test_online.py ...   the ones named
#
# One line per module (passed or FAILED, its pytest summary, wall seconds); a failed module's
# output tail follows its line. Exits 1 when any module failed.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--all" ]; then
  modules=(tests/test_*.py)
elif [ $# -gt 0 ]; then
  modules=("$@")
else
  # a stage run in process or as DVC runs it, a server (the replay ones too), torchrun, any other
  # process
  pattern='^(import|from) (subprocess|background|fault_harness|project_copy|stages|test_sglang(_live)?)\b'
  pattern+='|^import stages\.|torch\.distributed\.run|multiprocessing|Popen|HTTPServer'
  mapfile -t modules < <(grep -lE "$pattern" tests/test_*.py)
fi

logs=$(mktemp -d)
failed=()
for module in "${modules[@]}"; do
  name=$(basename "$module" .py)
  start=$SECONDS
  pytest -q -p no:cacheprovider "$module" > "$logs/$name.log" 2>&1
  rc=$?
  summary=$(tail -n 1 "$logs/$name.log")
  # 5: nothing collected (every test deselected or skipped at import) is not a failure
  if [ $rc -eq 0 ] || [ $rc -eq 5 ]; then
    printf '%-32s passed  %5ds  %s\n' "$name" $((SECONDS - start)) "$summary"
  else
    printf '%-32s FAILED  %5ds  %s\n' "$name" $((SECONDS - start)) "$summary"
    tail -n 40 "$logs/$name.log" | sed 's/^/    /'
    failed+=("$name")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed alone: ${failed[*]} (logs: $logs)"
  exit 1
fi
rm -rf "$logs"
