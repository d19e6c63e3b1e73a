# shellcheck shell=bash
# Shared by scripts/demo.sh, scripts/plots.sh and scripts/test.sh: installs what specdec
# needs on Debian (12 "bookworm" or newer) and, elsewhere, prints exactly what to install.
#
#   specdec_install_dependencies demo   # required: compiler, cmake, ninja, Eigen;
#                                       # optional (plots): gnuplot, Google Benchmark
#   specdec_install_dependencies test   # all of the above required, + clang, the
#                                       # sanitizer runtime, Catch2 v3
#
# Returns non-zero only if a required package is still missing. For `demo`, missing
# optional packages are tried on Debian and otherwise only reported; the caller asks
# specdec_missing_plot_packages what is still absent.

specdec_log() { printf '[specdec] %s\n' "$*" >&2; }

specdec_have_header() {
  local header=$1 dir
  for dir in /usr/include /usr/local/include; do
    [ -f "$dir/$header" ] && return 0
  done
  return 1
}

specdec_cmake_is_recent() {
  command -v cmake >/dev/null 2>&1 || return 1
  local version major minor
  version=$(cmake --version | head -n1 | awk '{print $3}')
  major=${version%%.*}
  minor=${version#*.}
  minor=${minor%%.*}
  [ "$major" -gt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -ge 25 ]; }
}

# Prints the Debian packages the plots need that are missing, one per line: gnuplot draws
# the PNGs, Google Benchmark (bm_speedup) measures the speedups plotted on the curves.
specdec_missing_plot_packages() {
  command -v gnuplot >/dev/null 2>&1 || echo gnuplot-nox
  specdec_have_header benchmark/benchmark.h || echo libbenchmark-dev
  return 0
}

# Prints the Debian packages still missing for the given purpose, one per line. For
# `demo` only the required ones (see specdec_missing_plot_packages for the optional).
specdec_missing_packages() {
  local purpose=$1
  specdec_cmake_is_recent || echo cmake
  command -v ninja >/dev/null 2>&1 || echo ninja-build
  command -v g++ >/dev/null 2>&1 || echo g++
  specdec_have_header eigen3/Eigen/Core || echo libeigen3-dev
  if [ "$purpose" = test ]; then
    command -v clang++ >/dev/null 2>&1 || echo clang
    specdec_have_header benchmark/benchmark.h || echo libbenchmark-dev
    specdec_have_header catch2/catch_test_macros.hpp || echo 'catch2 (version 3)'
    command -v gnuplot >/dev/null 2>&1 || echo gnuplot-nox
  fi
  return 0
}

specdec_as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  elif command -v sudo >/dev/null 2>&1; then
    sudo "$@"
  else
    specdec_log "need root or sudo to run: $*"
    return 1
  fi
}

specdec_is_debian() {
  command -v apt-get >/dev/null 2>&1 && [ -r /etc/debian_version ]
}

# Clang's sanitizer runtime ships separately on Debian (libclang-rt-<major>-dev).
specdec_sanitizer_runtime_ok() {
  local probe
  probe=$(mktemp -d)
  printf 'int main() { return 0; }\n' >"$probe/probe.cpp"
  if clang++ -fsanitize=address,undefined "$probe/probe.cpp" -o "$probe/probe" >/dev/null 2>&1 &&
    "$probe/probe"; then
    rm -rf "$probe"
    return 0
  fi
  rm -rf "$probe"
  return 1
}

# Tries to install the missing plot packages on Debian, one at a time (refreshing the
# package lists once if an installation fails); never fails.
specdec_try_plot_packages() {
  local missing package updated=0
  missing=$(specdec_missing_plot_packages)
  [ -n "$missing" ] || return 0
  if ! specdec_is_debian; then
    specdec_log "optional, for the plots: gnuplot and Google Benchmark (missing here:" \
      "${missing//$'\n'/ })"
    return 0
  fi
  specdec_log "installing optional packages for the plots: ${missing//$'\n'/ }"
  export DEBIAN_FRONTEND=noninteractive
  for package in $missing; do
    specdec_as_root apt-get install -y -qq --no-install-recommends "$package" >/dev/null 2>&1 &&
      continue
    if [ "$updated" = 0 ]; then
      updated=1
      specdec_as_root apt-get update -qq >/dev/null 2>&1 &&
        specdec_as_root apt-get install -y -qq --no-install-recommends "$package" \
          >/dev/null 2>&1 && continue
    fi
    specdec_log "could not install $package (optional: the demo runs without it)"
  done
  return 0
}

specdec_install_dependencies() {
  local purpose=$1 missing
  missing=$(specdec_missing_packages "$purpose")
  if [ -z "$missing" ]; then
    if [ "$purpose" = demo ]; then
      specdec_log "dependencies present"
      specdec_try_plot_packages
      return 0
    fi
    if [ "$purpose" != test ] || specdec_sanitizer_runtime_ok; then
      specdec_log "dependencies present"
      return 0
    fi
  fi
  if ! specdec_is_debian; then
    specdec_log "this is not a Debian system; install these yourself and run again:"
    specdec_log "  a C++20 compiler (GCC >= 12 or Clang >= 14), CMake >= 3.25, Ninja, Eigen 3.4"
    if [ "$purpose" = test ]; then
      specdec_log "  Clang with its ASan/UBSan runtime, Catch2 v3, Google Benchmark, gnuplot"
    else
      specdec_log "  optional, for the plots: gnuplot and Google Benchmark"
    fi
    specdec_log "still missing here: $(echo "$missing" | tr '\n' ' ')"
    return 1
  fi

  local codename=""
  [ -r /etc/os-release ] && codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  specdec_log "installing missing packages: $(echo "$missing" | tr '\n' ' ')"
  local packages=(cmake ninja-build g++ libeigen3-dev)
  if [ "$purpose" = test ]; then
    packages+=(gnuplot-nox libbenchmark-dev clang)
  fi
  if [ "$purpose" = test ] && [ "$codename" = bookworm ]; then
    # Debian 12 ships Catch2 v2; v3 comes from bookworm-backports.
    if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
      specdec_log "enabling bookworm-backports for Catch2 v3"
      echo 'deb http://deb.debian.org/debian bookworm-backports main' |
        specdec_as_root tee /etc/apt/sources.list.d/specdec-bookworm-backports.list >/dev/null
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  specdec_as_root apt-get update -qq
  specdec_as_root apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
  if [ "$purpose" = test ]; then
    if [ "$codename" = bookworm ]; then
      specdec_as_root apt-get install -y -qq --no-install-recommends -t bookworm-backports \
        catch2 >/dev/null
    else
      specdec_as_root apt-get install -y -qq --no-install-recommends catch2 >/dev/null
    fi
    if ! specdec_sanitizer_runtime_ok; then
      local clang_major
      clang_major=$(clang++ --version | sed -n 's/.*clang version \([0-9]*\).*/\1/p' | head -n1)
      specdec_log "installing the sanitizer runtime libclang-rt-${clang_major}-dev"
      specdec_as_root apt-get install -y -qq --no-install-recommends \
        "libclang-rt-${clang_major}-dev" >/dev/null
    fi
  fi
  missing=$(specdec_missing_packages "$purpose")
  if [ -n "$missing" ]; then
    specdec_log "still missing after installation: $(echo "$missing" | tr '\n' ' ')"
    return 1
  fi
  if [ "$purpose" = test ] && ! specdec_sanitizer_runtime_ok; then
    specdec_log "clang++ cannot link -fsanitize=address,undefined programs"
    return 1
  fi
  [ "$purpose" = demo ] && specdec_try_plot_packages
  specdec_log "dependencies installed"
}
