#!/usr/bin/env bash
# Installs missing dependencies (Debian), then builds and runs every specdec test:
#   a GCC (Release; tests at -O2) build with all tests, examples, benchmarks and the
#   header-alone checks, a Clang ASan+UBSan build (-O1, assertions on) with all tests but
#   the llama engine example's (SPECDEC_TEST_SKIP; fuzz_gguf runs its GGUF loading under
#   ASan+UBSan with Clang, and the tsan stage builds llama_threads_test with Clang) (only
#   the GCC build builds the examples; sanitizer builds keep line tables only, all their
#   reports need). The Clang build is the sanitizer build: the plain Clang preset (-O1,
#   assertions on, the same tests) compiles the same code with the same compiler and
#   warnings, so CI leaves it out to stay inside its 30 minutes
#   (SPECDEC_CONFIGS="gcc clang asan" runs it too). Then the CMake consumer
#   projects (find_package after install, and add_subdirectory), every benchmark binary
#   run briefly, a ThreadSanitizer build of the thread-safety tests (build/tsan, targets
#   thread_safety_test, llama_threads_test, batch_verification_test, batch_decoder_test,
#   batch_gamma_test), a GCC
#   -march=native build of the kernel-path, sampling and vector-math tests (build/native: every kernel path bitwise equal when the
#   compiler may use FMA), and the libFuzzer harnesses of tests/fuzz (the library's verification and decoder, the llama
#   engine example's GGUF loading) built with -fsanitize=fuzzer,address,undefined
#   (build/fuzz) and run for SPECDEC_FUZZ_SECONDS each from a temporary copy of the
#   committed seed corpus (a crash or invariant violation fails the stage; the input is
#   kept under build/fuzz/artifacts).
# The test, example and benchmark programs of the gcc, asan and tsan builds link
# specdec::kernels (the row kernels compiled once per build, include/specdec/kernel_instances.hpp;
# SPECDEC_LINK_KERNELS); README's usage example, the header checks, the fuzzers and the
# native stage compile them header-only in every unit, and the add_subdirectory consumer
# runs both ways.
# Exits non-zero on any failure; the last lines summarise each stage.
#
# Environment: SPECDEC_JOBS (parallel jobs, default nproc), SPECDEC_CONFIGS (default
# "gcc asan"; presets gcc, clang, asan), SPECDEC_SKIP_CONSUMERS=1, SPECDEC_SKIP_BENCHMARKS=1,
# SPECDEC_SKIP_TSAN=1, SPECDEC_SKIP_NATIVE=1, SPECDEC_SKIP_FUZZ=1, SPECDEC_FUZZ_SECONDS
# (default 20: CI runs inside 30 minutes on 2 cores; run longer campaigns by hand).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=lib/dependencies.sh
. scripts/lib/dependencies.sh
specdec_install_dependencies test || exit 1

jobs=${SPECDEC_JOBS:-$(nproc)}
configs=${SPECDEC_CONFIGS:-gcc asan}
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
    built=", examples built"
    [ "$config" != gcc ] && built=""  # the clang and asan presets build the tests only
    record ok "$config: $count tests passed$built (${elapsed}s)"
  else
    record FAIL "$config: $failed of $count tests failed (${elapsed}s)"
  fi
done

# The consumer linked with specdec::kernels runs, and its unit compiles no row kernel of its
# own (SPECDEC_EXTERN_KERNELS at work) where the header-only consumer's compiles them.
consumer_kernels_check() {  # consumer_kernels_check <build dir>
  local pattern='specdec::detail::[a-z0-9_]+_(avx2|portable)<' own shared
  "$1/consumer_kernels" || return 1
  own=$(nm -C --defined-only "$(find "$1/CMakeFiles/consumer.dir" -name '*.o')" | grep -cE "$pattern")
  shared=$(nm -C --defined-only "$(find "$1/CMakeFiles/consumer_kernels.dir" -name '*.o')" |
    grep -cE "$pattern")
  echo "row kernels compiled in the consumer's unit: $own header-only, $shared with specdec::kernels"
  [ "$own" -gt 0 ] && [ "$shared" -eq 0 ]
}

if [ "${SPECDEC_SKIP_CONSUMERS:-0}" != 1 ]; then
  stage "consumers: find_package after install, and add_subdirectory"
  t0=$(date +%s)
  work=build/consumers
  rm -rf "$work"
  ok=1
  cmake -S . -B "$work/lib" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPECDEC_BUILD_TESTS=OFF \
    -DSPECDEC_BUILD_BENCHMARKS=OFF -DSPECDEC_BUILD_EXAMPLES=OFF >/dev/null &&
    cmake --install "$work/lib" --prefix "$root/$work/prefix" >/dev/null || ok=0
  # The consumers build unoptimised: they check the packaging and the linking, not speed.
  for kind in find_package add_subdirectory; do
    [ "$ok" = 1 ] || break
    if cmake -S "tests/consumer/$kind" -B "$work/$kind" -G Ninja -DCMAKE_BUILD_TYPE=Debug \
      -DCMAKE_PREFIX_PATH="$root/$work/prefix" -DSPECDEC_SOURCE_DIR="$root" &&
      cmake --build "$work/$kind" -j "$jobs" && "$work/$kind/consumer" &&
      { [ "$kind" != add_subdirectory ] || consumer_kernels_check "$work/$kind"; }; then
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
    # A result line: "<name>  <time> <unit>  <cpu> <unit>  <iterations> ..."; a binary that
    # runs no benchmark at all fails the smoke test.
    if SPECDEC_DRAM_SAMPLES=3 "$bm" --benchmark_min_time=0.001 --benchmark_repetitions=1 >"$bm.smoke.log" 2>&1 &&
      n=$(grep -cE ' (ns|us|ms|s) +[0-9.e+]+ (ns|us|ms|s) +[0-9]+' "$bm.smoke.log") &&
      [ "$n" -gt 0 ]; then
      echo "$(basename "$bm"): ok ($n benchmarks)"
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

if [ "${SPECDEC_SKIP_TSAN:-0}" != 1 ]; then
  stage "tsan: ThreadSanitizer build of the thread-safety tests"
  t0=$(date +%s)
  log=build/tsan.log
  if cmake -S . -B build/tsan -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DSPECDEC_WERROR=ON \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -gline-tables-only" \
    -DCMAKE_CXX_FLAGS="-fsanitize=thread" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" \
    -DSPECDEC_BUILD_BENCHMARKS=OFF -DSPECDEC_BUILD_EXAMPLES=OFF >"$log" 2>&1 &&
    cmake --build build/tsan --target thread_safety_test llama_threads_test batch_verification_test \
      batch_decoder_test batch_gamma_test -j "$jobs" >>"$log" 2>&1 &&
    TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
      build/tsan/tests/thread_safety_test >>"$log" 2>&1 &&
    TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
      build/tsan/tests/batch_verification_test >>"$log" 2>&1 &&
    TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
      build/tsan/tests/batch_decoder_test >>"$log" 2>&1 &&
    TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
      build/tsan/tests/batch_gamma_test >>"$log" 2>&1 &&
    TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
      build/tsan/tests/llama_threads_test >>"$log" 2>&1; then
    cases=$(sed -n 's/.*assertions in \([0-9]*\) test cases.*/\1/p' "$log" |
      awk '{ n += $1 } END { print n }')
    cases=${cases:-1}
    total_passed=$((total_passed + cases))
    record ok "tsan: $cases thread-safety test cases, no data race ($(($(date +%s) - t0))s)"
  else
    tail -n 40 "$log"
    total_failed=$((total_failed + 1))
    record FAIL "tsan: thread-safety tests (see $log)"
  fi
fi

if [ "${SPECDEC_SKIP_NATIVE:-0}" != 1 ]; then
  # The kernels must agree bitwise on every path even when the compiler may use FMA
  # everywhere (GCC contracts multiply-adds by default under -march=native): kernel_path_test
  # compares every path this CPU has, sampling_test checks the standardization on the best.
  stage "native: GCC -march=native build of the kernel-path, sampling and vector-math tests"
  t0=$(date +%s)
  log=build/native.log
  fma=without
  grep -qw fma /proc/cpuinfo 2>/dev/null && fma=with
  if cmake -S . -B build/native -G Ninja -DCMAKE_CXX_COMPILER=g++ -DSPECDEC_WERROR=ON \
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS="-march=native" -DSPECDEC_LINK_KERNELS=OFF \
    -DSPECDEC_BUILD_BENCHMARKS=OFF -DSPECDEC_BUILD_EXAMPLES=OFF >"$log" 2>&1 &&
    cmake --build build/native --target kernel_path_test sampling_test vector_math_test \
      -j "$jobs" >>"$log" 2>&1 &&
    build/native/tests/kernel_path_test >>"$log" 2>&1 &&
    build/native/tests/sampling_test >>"$log" 2>&1 &&
    build/native/tests/vector_math_test >>"$log" 2>&1; then
    cases=$(sed -n 's/.*assertions in \([0-9]*\) test cases.*/\1/p' "$log" |
      awk '{ n += $1 } END { print n }')
    cases=${cases:-1}
    total_passed=$((total_passed + cases))
    record ok "native: $cases test cases under -march=native ($fma FMA), every path bitwise ($(($(date +%s) - t0))s)"
  else
    tail -n 40 "$log"
    total_failed=$((total_failed + 1))
    record FAIL "native: -march=native kernel-path tests (see $log)"
  fi
fi

if [ "${SPECDEC_SKIP_FUZZ:-0}" != 1 ]; then
  stage "fuzz: libFuzzer harnesses, ${SPECDEC_FUZZ_SECONDS:-20}s each from the seed corpus"
  t0=$(date +%s)
  fuzz_seconds=${SPECDEC_FUZZ_SECONDS:-20}
  harnesses="fuzz_verification fuzz_decoder fuzz_gguf"
  log=build/fuzz.log
  mkdir -p build/fuzz/artifacts
  if cmake -S . -B build/fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DSPECDEC_WERROR=ON \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -gline-tables-only" \
    -DSPECDEC_BUILD_FUZZERS=ON -DSPECDEC_BUILD_BENCHMARKS=OFF -DSPECDEC_BUILD_EXAMPLES=OFF \
    >"$log" 2>&1 && cmake --build build/fuzz --target $harnesses -j "$jobs" >>"$log" 2>&1; then
    # One harness per core: with 2 or more jobs both run at once.
    work=$(mktemp -d)
    pids=()
    for harness in $harnesses; do
      mkdir -p "$work/$harness"
      cp tests/fuzz/corpus/$harness/* "$work/$harness/"
      max_len=512
      [ "$harness" = fuzz_gguf ] && max_len=4096  # whole (tiny) model files
      build/fuzz/tests/fuzz/$harness -max_total_time="$fuzz_seconds" -max_len=$max_len \
        -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="build/fuzz/artifacts/$harness-" "$work/$harness" \
        >"build/fuzz/$harness.log" 2>&1 &
      pids+=($!)
      [ "$jobs" -ge 2 ] || wait "${pids[-1]}"
    done
    i=0
    for harness in $harnesses; do
      wait "${pids[$i]}"
      status=$?
      i=$((i + 1))
      summary_line=$(grep -aE '^#[0-9]+[[:space:]]+DONE' "build/fuzz/$harness.log" | tail -n1 |
        sed 's/.*DONE[[:space:]]*//')
      execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "build/fuzz/$harness.log")
      if [ "$status" -eq 0 ]; then
        echo "$harness: ok, ${execs:-?} runs, $summary_line"
        total_passed=$((total_passed + 1))
        record ok "fuzz: $harness ${fuzz_seconds}s, ${execs:-?} runs, no finding (${summary_line%% corp:*})"
      else
        grep -E 'invariant violated|assertion failed|ERROR|SUMMARY|Test unit written' \
          "build/fuzz/$harness.log" | head -n 20
        total_failed=$((total_failed + 1))
        record FAIL "fuzz: $harness found a crash (build/fuzz/$harness.log, build/fuzz/artifacts)"
      fi
    done
    rm -rf "$work"
    echo "fuzz stage: $(($(date +%s) - t0))s"
  else
    tail -n 40 "$log"
    total_failed=$((total_failed + 1))
    record FAIL "fuzz: harnesses failed to build (see $log)"
  fi
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
