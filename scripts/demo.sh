#!/usr/bin/env bash
# Builds and runs the specdec demo (by default: speculative decoding of the shipped llama
# model pair in the example engine, examples/llama; --kneser-ney: the byte-level n-gram
# mode), then renders the acceptance-rate plots.
# Installs missing dependencies on Debian first: a C++20 compiler, CMake, Ninja and Eigen
# are required; gnuplot (the PNGs) and Google Benchmark (measured points on the plots)
# are optional: without them the demo still runs and says what was skipped. Arguments
# are passed to the demo (try --help); with --help or after a failed demo no plots are
# drawn.
#
# Environment: SPECDEC_SKIP_PLOTS=1 skips the plots; SPECDEC_JOBS (build jobs, default
# nproc); scripts/plots.sh documents its own settings (SPECDEC_PLOTS_MEASURE,
# SPECDEC_PLOTS_MIN_TIME).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=lib/dependencies.sh
. scripts/lib/dependencies.sh
specdec_install_dependencies demo || exit 1
export SPECDEC_DEPENDENCIES_CHECKED=1  # scripts/plots.sh need not try again

build=build/demo
log=build/demo-build.log
mkdir -p build
specdec_log "building the demo in $build/ (log in $log)"
started=$SECONDS
if ! {
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=g++ \
    -DSPECDEC_BUILD_TESTS=OFF -DSPECDEC_BUILD_BENCHMARKS=OFF -DSPECDEC_BUILD_EXAMPLES=ON &&
    cmake --build "$build" --target demo -j "${SPECDEC_JOBS:-$(nproc)}"
} >"$log" 2>&1; then
  tail -n 40 "$log" >&2
  specdec_log "building the demo failed; the full log is $root/$log"
  exit 1
fi
specdec_log "demo built in $((SECONDS - started)) s"

status=0
"$build/examples/demo" "$@" || status=$?
[ "$status" -eq 0 ] || exit "$status"
for argument in "$@"; do
  case $argument in -h | --help) exit 0 ;; esac
done

if [ "${SPECDEC_SKIP_PLOTS:-0}" = 1 ] || [ ! -f scripts/plots.sh ]; then
  exit 0
fi
echo
missing=$(specdec_missing_plot_packages)
if ! command -v gnuplot >/dev/null 2>&1; then
  specdec_log "plots skipped: gnuplot is not installed. To draw them, install" \
    "${missing//$'\n'/ } (Debian package names) and run scripts/plots.sh"
  exit 0
fi
specdec_log "rendering the acceptance-rate plots (scripts/plots.sh; log in build/plots.log)"
if [[ $missing == *libbenchmark-dev* ]]; then
  specdec_log "measured speedup points skipped: Google Benchmark is not installed" \
    "(Debian: apt-get install libbenchmark-dev)"
fi
started=$SECONDS
if ! bash scripts/plots.sh >build/plots.log 2>&1; then
  tail -n 20 build/plots.log >&2
  specdec_log "scripts/plots.sh failed; see $root/build/plots.log"
  exit 1
fi
shopt -s nullglob
pngs=(build/plots/*.png)
csvs=(build/plots/*.csv)
shopt -u nullglob
if [ "${#pngs[@]}" -eq 0 ]; then
  specdec_log "no plots were drawn; see $root/build/plots.log"
  exit 1
fi
echo "Plots written to $root/build/plots/ (in $((SECONDS - started)) s):"
for file in "${pngs[@]}"; do echo "  ${file#build/plots/}"; done
echo "and the data behind them: ${csvs[*]#build/plots/}"
