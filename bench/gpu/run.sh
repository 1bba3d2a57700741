#!/usr/bin/env bash
# The GPU check of the CUDA backend, in one go (meant to finish within ~5 min on
# an H200): build libspecfast.so and libspecfast_cuda.so with CMake, run the
# CUDA-vs-CPU tests, run the GPU benchmark. Everything lands in one folder:
# $OUT when set (the device runner's output folder), else bench/gpu/results.
#   bash bench/gpu/run.sh        (SKIP_SANITIZERS=1: no memcheck / racecheck)
set -uo pipefail
cd "$(dirname "$0")/../.."
RES="${OUT:-bench/gpu/results}"
mkdir -p "$RES"
exec > >(tee "$RES/run.log") 2>&1
JOBS="$(nproc 2>/dev/null || echo 4)"
# At most 8 files come back from the device runner: the build log stays in
# build/gpu.log unless the build fails, the sanitizers share one log.
nvidia-smi; nvcc --version
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.is_available())"

T0=$SECONDS
mkdir -p build
# -lineinfo: the profile below maps stall samples to source lines (no change of code).
cmake -S . -B build/gpu -DCMAKE_BUILD_TYPE=Release -DSPECFAST_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90-real -DCMAKE_CUDA_FLAGS=-lineinfo > build/gpu.log 2>&1 \
  && cmake --build build/gpu -j "$JOBS" >> build/gpu.log 2>&1
BUILD=$?
echo "build: rc=$BUILD in $((SECONDS - T0)) s"
if [ "$BUILD" -ne 0 ]; then tail -40 build/gpu.log; exit 1; fi

export SPECFAST_LIBRARY="$PWD/build/gpu/libspecfast.so"
export SPECFAST_CUDA_LIBRARY="$PWD/build/gpu/libspecfast_cuda.so"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"

# Python packages the machine's image may lack (cffi): wheels carried in .whl/.
if ! python3 -c "import cffi" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
XDIST=()
python3 -c "import xdist" 2>/dev/null && XDIST=(-n 8)

T0=$SECONDS
timeout 150 python3 -m pytest -q --no-header -p no:cacheprovider "${XDIST[@]}" tests/test_cuda.py \
  > "$RES/test_cuda.log" 2>&1
TESTS=$?
grep -E "passed|failed|error" "$RES/test_cuda.log" | tail -5
grep -E "^(FAILED|ERROR)" "$RES/test_cuda.log" | head -40
echo "tests: rc=$TESTS in $((SECONDS - T0)) s"

T0=$SECONDS
timeout 90 python3 bench/gpu/bench_gpu.py --sweep --out "$RES"
BENCH=$?
echo "bench: rc=$BENCH in $((SECONDS - T0)) s"
# Out-of-bounds reads and races, on a few small cases (compute-sanitizer works on
# Firecracker machines, not on gVisor ones).
SAN=skipped
if command -v compute-sanitizer >/dev/null && [ -z "${SKIP_SANITIZERS:-}" ]; then
  T0=$SECONDS
  timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -x \
    --no-header -p no:cacheprovider tests/test_cuda.py \
    -k "verify_matches and (V4099 or V17000) and bfloat16 or graph or errors" \
    > "$RES/sanitizers.log" 2>&1
  SAN=$?
  grep -E "ERROR SUMMARY|passed|failed|Invalid" "$RES/sanitizers.log" | head -10
  echo "memcheck: rc=$SAN in $((SECONDS - T0)) s"
  T0=$SECONDS
  timeout 45 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -x \
    --no-header -p no:cacheprovider tests/test_cuda.py \
    -k "verify_matches and V4099 and float32 and rejection and tree" \
    >> "$RES/sanitizers.log" 2>&1
  RACE=$?
  grep -E "ERROR SUMMARY|passed|failed|hazard" "$RES/sanitizers.log" | head -10
  echo "racecheck: rc=$RACE in $((SECONDS - T0)) s"
  SAN="$SAN/$RACE"
fi
# One launch of the bar case under Nsight Compute: where the time goes. The
# report's details page, then its source page (stall samples per SASS
# instruction and per CUDA line) summed up by hotspots.py, all in ncu.txt.
if command -v ncu >/dev/null; then
  T0=$SECONDS
  timeout 120 ncu --clock-control none --kernel-name regex:sf_cu_verify_kernel --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section SchedulerStats --section InstructionStats --section SourceCounters \
    --import-source yes -f -o /tmp/verify_prof \
    python3 bench/gpu/bench_gpu.py --only 1 --iters 1 --out /tmp/ncu_bench > "$RES/ncu.txt" 2>&1
  echo "ncu: rc=$? in $((SECONDS - T0)) s"
  ncu -i /tmp/verify_prof.ncu-rep >> "$RES/ncu.txt" 2>&1
  for view in sass cuda; do
    ncu -i /tmp/verify_prof.ncu-rep --page source --csv --print-source "$view" \
      > "/tmp/verify_$view.csv" 2>> "$RES/ncu.txt"
  done
  python3 bench/gpu/hotspots.py /tmp/verify_sass.csv /tmp/verify_cuda.csv >> "$RES/ncu.txt" 2>&1
fi
# Occupancy against spills: the bar case built for 2 and 4 resident blocks
# per SM (the default asks registers for 3), while the run is young enough.
for mb in 2 4; do
  [ "$SECONDS" -lt 420 ] || break
  cmake -S . -B "build/gpu-mb$mb" -DCMAKE_BUILD_TYPE=Release -DSPECFAST_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90-real "-DCMAKE_CUDA_FLAGS=-DSF_CU_MIN_BLOCKS=$mb" >> build/gpu.log 2>&1 \
    && cmake --build "build/gpu-mb$mb" -j "$JOBS" --target specfast_cuda >> build/gpu.log 2>&1 \
    && SPECFAST_CUDA_LIBRARY="$PWD/build/gpu-mb$mb/libspecfast_cuda.so" timeout 60 \
      python3 bench/gpu/bench_gpu.py --only 1 --out "/tmp/mb$mb" | sed "s/^/min blocks $mb: /" | tail -2
done
echo "summary: build=$BUILD tests=$TESTS bench=$BENCH memcheck=$SAN" | tee "$RES/summary.txt"
[ "$TESTS" -eq 0 ] && [ "$BENCH" -eq 0 ]
