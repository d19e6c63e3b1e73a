#!/usr/bin/env bash
# Builds and runs the specdec demo, then renders the acceptance-rate plots.
# Installs missing dependencies on Debian first. Arguments are passed to the demo
# (try --help); with --help or after a failed demo no plots are drawn.
#
# Environment: SPECDEC_SKIP_PLOTS=1 skips the plots; scripts/plots.sh documents its own
# settings (SPECDEC_PLOTS_MEASURE, SPECDEC_PLOTS_MIN_TIME).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=lib/dependencies.sh
. scripts/lib/dependencies.sh
specdec_install_dependencies demo

build=build/demo
specdec_log "building the demo in $build/"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=g++ \
  -DSPECDEC_BUILD_TESTS=OFF -DSPECDEC_BUILD_BENCHMARKS=OFF -DSPECDEC_BUILD_EXAMPLES=ON \
  >/dev/null
cmake --build "$build" --target demo -j "$(nproc)" >/dev/null

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
specdec_log "rendering the acceptance-rate plots (scripts/plots.sh; log in build/plots.log)"
mkdir -p build
if ! bash scripts/plots.sh >build/plots.log 2>&1; then
  tail -n 20 build/plots.log >&2
  specdec_log "scripts/plots.sh failed; see build/plots.log"
  exit 1
fi
plots=$(cd build/plots && ls ./*.png ./*.csv 2>/dev/null | sed 's|^\./||' | tr '\n' ' ')
echo "Plots written to $root/build/plots/:"
echo "  $plots"
