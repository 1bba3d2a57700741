#!/usr/bin/env bash
# fuzz/run.sh SECONDS: builds the libFuzzer harnesses (clang, ASan + UBSan,
# the library built by CMake from this checkout) and fuzzes the C API for
# SECONDS in total:
#   fuzz_api   sf_verify / sf_sample / sf_probs, 5/6 of the time, split over
#              the SIMD levels this CPU has (native first, then avx2 and
#              scalar through SPECFAST_SIMD);
#   fuzz_tree  sf_tree_mask / sf_kv_compact, 1/6 of the time.
# Each starts from fuzz/corpus/<name> (never modified: new inputs go to a
# scratch corpus). Exits non-zero on any crash, sanitizer report, broken
# invariant, timeout or leak, after printing the input in base64 (decode it
# into a file and pass that file to the harness binary, or to a build of
# fuzz/replay_main.c, to reproduce).
#
# Environment:
#   SPECFAST_FUZZ_BUILD   build folder to use and keep (default: a temp dir)
#   SPECFAST_FUZZ_OUT     where crash inputs and the scratch corpora go
#                         (default: inside the build folder)
#   SPECFAST_FUZZ_CFLAGS  extra flags for the harnesses (e.g. -DSF_FUZZ_SKIP_KNOWN)
#   SPECFAST_FUZZ_FLAGS   extra libFuzzer flags (e.g. -seed=1)
#   CC                    clang (default: clang)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
total=${1:-60}
cc=${CC:-clang}
if ! command -v "$cc" >/dev/null; then
  echo "fuzz/run.sh: $cc not found (apt-get install -y clang)" >&2
  exit 2
fi

build=${SPECFAST_FUZZ_BUILD:-}
if [[ -z $build ]]; then
  build=$(mktemp -d /tmp/specfast-fuzz.XXXXXX)
fi
out=${SPECFAST_FUZZ_OUT:-$build/out}
mkdir -p "$build" "$out"

# The library exactly as CMakeLists.txt builds it, with clang, the sanitizers
# (SPECFAST_SANITIZE) and coverage for libFuzzer; UB stops the run.
san_flags="-fsanitize=fuzzer-no-link -fno-sanitize-recover=all"
echo "== fuzz: building the library in $build/lib"
cmake -S "$root" -B "$build/lib" -DCMAKE_C_COMPILER="$cc" -DSPECFAST_SANITIZE=ON \
  -DSPECFAST_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_FLAGS="$san_flags" >"$build/cmake.log" 2>&1 \
  || { cat "$build/cmake.log"; exit 2; }
cmake --build "$build/lib" -j"$(nproc)" >>"$build/cmake.log" 2>&1 \
  || { cat "$build/cmake.log"; exit 2; }

echo "== fuzz: building the harnesses"
for h in fuzz_api fuzz_tree; do
  # shellcheck disable=SC2086
  "$cc" -g -O1 -std=c11 -Wall -Wextra -fsanitize=fuzzer,address,undefined \
    -fno-sanitize-recover=all ${SPECFAST_FUZZ_CFLAGS:-} -I"$root/csrc/include" \
    "$root/fuzz/$h.c" -L"$build/lib" -lspecfast -Wl,-rpath,"$build/lib" -lm \
    -o "$build/$h"
done

# Runs: harness, SIMD level, seconds. The api harness gets 5/6 of the time,
# half of it at the native level and the rest shared by the lower ones.
levels=(native)
if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then levels+=(avx2); fi
levels+=(scalar)
n=${#levels[@]}
tree_secs=$(( total / 6 ))
api_secs=$(( total - tree_secs ))
runs=()
for i in "${!levels[@]}"; do
  if (( i == 0 )); then secs=$(( (api_secs + 1) / 2 ))
  else secs=$(( (api_secs / 2 + n - 2) / (n - 1) )); fi
  runs+=("fuzz_api ${levels[$i]} $(( secs < 1 ? 1 : secs ))")
done
runs+=("fuzz_tree native $(( tree_secs < 1 ? 1 : tree_secs ))")
mkdir -p "$out/crashes"

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:allocator_may_return_null=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
status=0
for run in "${runs[@]}"; do
  read -r h level secs <<<"$run"
  corpus=$root/fuzz/corpus/${h#fuzz_}
  scratch=$out/corpus-${h#fuzz_}
  mkdir -p "$scratch"
  echo "== fuzz: $h at the $level SIMD level for ${secs}s"
  log="$out/$h-$level.log"
  rc=0
  if [[ $level == native ]]; then unset SPECFAST_SIMD || true; else export SPECFAST_SIMD=$level; fi
  # shellcheck disable=SC2086
  "$build/$h" -max_total_time="$secs" -timeout=20 -rss_limit_mb=4096 -max_len=2048 \
    -print_final_stats=1 -artifact_prefix="$out/crashes/$h-$level-" ${SPECFAST_FUZZ_FLAGS:-} \
    "$scratch" "$corpus" >"$log" 2>&1 || rc=$?
  unset SPECFAST_SIMD || true
  grep -E '^(INFO: seed|stat::number_of_executed_units|stat::average_exec_per_sec|stat::peak_rss_mb|Done )' \
    "$log" || true
  if (( rc != 0 )); then
    status=1
    echo "fuzz/run.sh: FINDING in $h at the $level level (exit $rc); log tail:" >&2
    tail -n 60 "$log" >&2
    break  # later runs would replay the same input first
  fi
done

shopt -s nullglob
crashes=("$out"/crashes/*)
if (( ${#crashes[@]} )); then
  status=1
  for f in "${crashes[@]}"; do
    echo "fuzz/run.sh: input $f (base64):" >&2
    base64 -w0 "$f" >&2
    echo >&2
  done
fi
if (( status == 0 )); then
  echo "fuzz/run.sh: no findings in ${total}s"
fi
exit $status
