#!/usr/bin/env bash
# Installs missing dependencies (Debian), then builds and runs every specdec test:
#   GCC (Release) and Clang (assertions on) builds with all tests and examples,
#   an ASan+UBSan build with all tests, the CMake consumer projects (find_package after
#   install, and add_subdirectory), and every benchmark binary run briefly.
# Exits non-zero on any failure; the last lines summarise each stage.
#
# Environment: SPECDEC_JOBS (parallel jobs, default nproc), SPECDEC_CONFIGS (default
# "gcc clang asan"), SPECDEC_SKIP_CONSUMERS=1, SPECDEC_SKIP_BENCHMARKS=1.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=lib/dependencies.sh
. scripts/lib/dependencies.sh
specdec_install_dependencies test || exit 1

jobs=${SPECDEC_JOBS:-$(nproc)}
configs=${SPECDEC_CONFIGS:-gcc clang asan}
start=$(date +%s)
summary=()
failures=0
total_passed=0
total_failed=0

stage() { printf '\n=== %s ===\n' "$*"; }
record() {  # record <ok|FAIL> <text>
  summary+=("$1  $2")
  [ "$1" = ok ] || failures=$((failures + 1))
}

for config in $configs; do
  stage "$config: configure and build"
  t0=$(date +%s)
  if ! cmake --preset "$config" >"build-$config.log" 2>&1; then
    cat "build-$config.log"
    record FAIL "$config: configure failed"
    continue
  fi
  rm -f "build-$config.log"
  if ! cmake --build --preset "$config" -j "$jobs"; then
    record FAIL "$config: build failed"
    continue
  fi
  stage "$config: tests"
  log="build/$config/ctest.log"
  ctest --preset "$config" -j "$jobs" --timeout 900 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  line=$(grep -E 'tests passed, [0-9]+ tests failed out of [0-9]+' "$log" | tail -n1)
  count=$(echo "$line" | sed -n 's/.*out of \([0-9]*\).*/\1/p')
  failed=$(echo "$line" | sed -n 's/.*passed, \([0-9]*\) tests failed.*/\1/p')
  count=${count:-0}
  failed=${failed:-0}
  total_passed=$((total_passed + count - failed))
  total_failed=$((total_failed + failed))
  elapsed=$(($(date +%s) - t0))
  if [ "$status" -eq 0 ] && [ "$count" -gt 0 ]; then
    record ok "$config: $count tests passed, examples built (${elapsed}s)"
  else
    record FAIL "$config: $failed of $count tests failed (${elapsed}s)"
  fi
done

if [ "${SPECDEC_SKIP_CONSUMERS:-0}" != 1 ]; then
  stage "consumers: find_package after install, and add_subdirectory"
  t0=$(date +%s)
  work=build/consumers
  rm -rf "$work"
  ok=1
  cmake -S . -B "$work/lib" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPECDEC_BUILD_TESTS=OFF \
    -DSPECDEC_BUILD_BENCHMARKS=OFF -DSPECDEC_BUILD_EXAMPLES=OFF >/dev/null &&
    cmake --install "$work/lib" --prefix "$root/$work/prefix" >/dev/null || ok=0
  for kind in find_package add_subdirectory; do
    [ "$ok" = 1 ] || break
    if cmake -S "tests/consumer/$kind" -B "$work/$kind" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$root/$work/prefix" -DSPECDEC_SOURCE_DIR="$root" &&
      cmake --build "$work/$kind" -j "$jobs" && "$work/$kind/consumer"; then
      echo "consumer via $kind: ok"
    else
      ok=0
    fi
  done
  if [ "$ok" = 1 ]; then
    record ok "consumers: find_package and add_subdirectory ($(($(date +%s) - t0))s)"
    total_passed=$((total_passed + 2))
  else
    record FAIL "consumers"
    total_failed=$((total_failed + 1))
  fi
fi

if [ "${SPECDEC_SKIP_BENCHMARKS:-0}" != 1 ] && [ -d build/gcc/benchmarks ]; then
  stage "benchmarks: smoke run (gcc build)"
  t0=$(date +%s)
  ran=0
  bad=0
  for bm in build/gcc/benchmarks/bm_*; do
    [ -x "$bm" ] || continue
    ran=$((ran + 1))
    if "$bm" --benchmark_min_time=0.001 --benchmark_repetitions=1 >"$bm.smoke.log" 2>&1; then
      echo "$(basename "$bm"): ok ($(grep -c '^BM_' "$bm.smoke.log") benchmarks)"
    else
      echo "$(basename "$bm"): FAILED"
      tail -n 20 "$bm.smoke.log"
      bad=$((bad + 1))
    fi
  done
  if [ "$bad" -eq 0 ]; then
    record ok "benchmarks: $ran binaries smoke-ran ($(($(date +%s) - t0))s)"
  else
    record FAIL "benchmarks: $bad of $ran binaries failed"
  fi
  total_passed=$((total_passed + ran - bad))
  total_failed=$((total_failed + bad))
fi

stage "summary ($(($(date +%s) - start))s)"
printf '%s\n' "${summary[@]}"
if [ "$failures" -eq 0 ]; then
  echo "specdec: all stages passed"
else
  echo "specdec: $failures stage(s) FAILED"
fi
echo "total: $total_passed passed, $total_failed failed"
[ "$failures" -eq 0 ]
