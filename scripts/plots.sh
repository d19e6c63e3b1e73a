#!/usr/bin/env bash
# Draws the acceptance-rate figures into build/plots/ (not committed):
#   figure2_expected_tokens.png   paper Figure 2 (Eq. 1)
#   figure3_optimal_gamma.png     paper Figure 3 (optimal gamma, Sec. 3.5)
#   figure4_speed_operations.png  paper Figure 4 and Table 1 (Thm 3.8, Thm 3.11)
#   measured_speedup.png          bm_speedup's measured speedups on the Thm 3.8 curves
# plus the CSV files behind them (examples/acceptance_plots.cpp). The PNGs need gnuplot;
# without it only the CSVs are written. scripts/demo.sh calls this script.
#
# Environment:
#   SPECDEC_PLOTS_MEASURE=0         skip the measured points (no benchmark run)
#   SPECDEC_PLOTS_MIN_TIME=1        seconds per bm_speedup case (36 cases); longer runs
#                                   give points closer to the curves
#   SPECDEC_SPEEDUP_CSV=path        use this bm_speedup table instead of measuring
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=lib/dependencies.sh
. scripts/lib/dependencies.sh
if [ "${SPECDEC_DEPENDENCIES_CHECKED:-0}" != 1 ]; then  # scripts/demo.sh has done it
  specdec_install_dependencies demo || specdec_log "continuing: plots need only a compiler"
fi

out=build/plots
build=build/plots-tools
log=build/plots-tools.log
mkdir -p "$out"
rm -f "$out/measured_speedup.csv" "$out/measured_speedup.png"

targets=(acceptance_plots)
benchmarks=OFF
measured_csv=${SPECDEC_SPEEDUP_CSV:-}
if [ -z "$measured_csv" ] && [ "${SPECDEC_PLOTS_MEASURE:-1}" != 0 ]; then
  if specdec_have_header benchmark/benchmark.h && [ -f benchmarks/bm_speedup.cpp ]; then
    benchmarks=ON
    targets+=(bm_speedup)
  else
    specdec_log "Google Benchmark not installed (Debian: libbenchmark-dev): plotting" \
      "without measured points"
  fi
fi

specdec_log "building ${targets[*]} in $build/ (log in $log)"
if ! {
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=g++ \
    -DSPECDEC_BUILD_TESTS=OFF -DSPECDEC_BUILD_BENCHMARKS="$benchmarks" \
    -DSPECDEC_BUILD_EXAMPLES=ON &&
    cmake --build "$build" --target "${targets[@]}" -j "${SPECDEC_JOBS:-$(nproc)}"
} >"$log" 2>&1; then
  tail -n 40 "$log" >&2
  specdec_log "building ${targets[*]} failed; the full log is $root/$log"
  exit 1
fi
if [ "$benchmarks" = ON ]; then
  measured_csv=$out/bm_speedup.csv
  min_time=${SPECDEC_PLOTS_MIN_TIME:-1}
  specdec_log "measuring speedups (36 cases, ${min_time}s each; SPECDEC_PLOTS_MEASURE=0 skips)"
  rm -f "$measured_csv"
  SPECDEC_SPEEDUP_CSV="$measured_csv" "$build/benchmarks/bm_speedup" \
    --benchmark_min_time="$min_time" >"$out/bm_speedup.txt" 2>&1
fi

args=("$out")
[ -n "$measured_csv" ] && args+=(--measured "$measured_csv")
"$build/examples/acceptance_plots" "${args[@]}"

if ! command -v gnuplot >/dev/null 2>&1; then
  specdec_log "gnuplot not found (Debian: gnuplot-nox): CSV files are in $out/, no PNGs drawn"
  exit 0
fi
figures=(figure2 figure3 figure4)
[ -f "$out/measured_speedup.csv" ] && [ -n "$measured_csv" ] && figures+=(measured)
for figure in "${figures[@]}"; do
  gnuplot -e "dir='$out'" "scripts/plots/$figure.gnuplot"
done
specdec_log "plots in $out/: $(cd "$out" && printf '%s ' ./*.png | sed 's|\./||g')"
