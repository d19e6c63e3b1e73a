#!/usr/bin/env bash
# Builds and runs the specdec demo. Installs missing dependencies on Debian first.
# Arguments are passed to the demo (try --help).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=lib/dependencies.sh
. scripts/lib/dependencies.sh
specdec_install_dependencies demo

build=build/demo
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER=g++ \
  -DSPECDEC_BUILD_TESTS=OFF -DSPECDEC_BUILD_BENCHMARKS=OFF -DSPECDEC_BUILD_EXAMPLES=ON \
  >/dev/null
cmake --build "$build" --target demo -j "$(nproc)" >/dev/null
exec "$build/examples/demo" "$@"
