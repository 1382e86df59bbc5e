#!/usr/bin/env bash
# The GPU checks of issue 5, as one prepared run on one GPU (a lent machine is held by the minute):
#   env       the card, driver, torch/CUDA/NCCL, and two ceilings measured plainly (a large bf16
#             matmul, a large device-to-device copy) to hold the profiler's figures against
#   timing    benchmarks/gpu_timing_check.py: the held CUDA timing against torch.profiler's kernel times
#   quick     `autopar profile --quick` on this GPU under torchrun (NCCL, one rank) -> gpu-quick.json:
#             achieved GEMM TFLOP/s and memory bandwidth against the datasheet (the profile's notes)
#   executor  benchmarks/executor.py (c): a single-GPU plan priced from gpu-quick.json, run by the
#             executor, predicted against measured step time, MFU and peak memory
#   breakdown benchmarks/step_breakdown.py: that step's kernel time by kind (torch.profiler) and host time
#   accuracy  benchmarks/profile_accuracy.py --quick on this GPU: held-out GEMM / attention shapes
#   full      the full (not quick) profile -> gpu-full.json, in whatever time is left, in the training
#             precisions (FULL_PRECISIONS, default bf16,fp8: fp32's large GEMMs alone take about a minute)
#   clock     benchmarks/gemm_clock.py: one of the step's GEMMs in different surroundings, with SM clock and power
#   attention benchmarks/attention_kernels.py: SDPA on grouped vs expanded K/V (time, kernels, memory)
# SKIP="accuracy ..." leaves steps out (a rerun of what failed). Every step has a time cap inside one deadline (GPU_CHECK_SECONDS, default 500) and the next step
# runs whatever the last one did; logs and profiles go to $OUT (a temporary folder if unset).
#
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh            # on the GPU machine, from the repo root
# Where python lacks pydantic, the wheels in .whl/ (pydantic, typer and what they need) go to /tmp/site.
set -u
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
DEADLINE=$(( $(date +%s) + ${GPU_CHECK_SECONDS:-500} ))
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if ! $PY -c "import pydantic" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheels in .whl/ did not install"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

left() { echo $(( DEADLINE - $(date +%s) )); }
step() {  # step NAME CAP_SECONDS COMMAND...: run with the smaller of CAP and the time left, log to $OUT/NAME.log
  local name=$1 cap=$2; shift 2
  case " ${SKIP:-} " in *" $name "*) echo "=== $name: skipped (SKIP)"; return;; esac
  local t; t=$(left); [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 20 ]; then echo "=== $name: skipped, ${t}s left"; return; fi
  echo "=== $(date +%T) $name (at most ${t}s)"
  local t0; t0=$(date +%s)
  timeout -k 10 "$t" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local why=""; { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && why=" (stopped at its time cap)"
  echo "=== $name: exit $rc after $(( $(date +%s) - t0 ))s$why"
  tail -n "${TAIL:-20}" "$OUT/$name.log" | cut -c1-220
}

step env 60 $PY - <<'EOF'
import shutil, subprocess, torch
if shutil.which("nvidia-smi"):
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,"
                          "power.limit", "--format=csv"], capture_output=True, text=True).stdout.strip())
import os, platform
model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?") \
    if os.path.exists("/proc/cpuinfo") else platform.processor()
print(f"host: {model}, {os.cpu_count()} CPUs, {platform.release()}")  # a step with host gaps runs at the host's pace
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
import pydantic; print("pydantic", pydantic.VERSION)
if torch.cuda.is_available():
    dev = torch.device("cuda", 0)
    def best_of(fn, reps):
        fn(); torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); fn(); e.record(); e.synchronize(); times.append(s.elapsed_time(e) / 1e3)
        return sorted(times)[len(times) // 2]
    n = 8192
    a, b = torch.randn(n, n, device=dev, dtype=torch.bfloat16), torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    t = best_of(lambda: a @ b, 20)
    print(f"ceiling: bf16 {n}^3 matmul (random data, median of 20) {2 * n**3 / t / 1e12:.0f} TFLOP/s")
    x = torch.empty(1 << 30, device=dev, dtype=torch.uint8); y = torch.empty_like(x)
    t = best_of(lambda: y.copy_(x), 20)
    print(f"ceiling: 1 GiB device-to-device copy {2 * x.numel() / t / 1e12:.2f} TB/s (bytes read + written)")
EOF

# the held CUDA timing (profiler.timing) against torch.profiler's kernel times: first, since the
# profiles' tables rest on it
step timing 90 $PY benchmarks/gpu_timing_check.py

QUICK=${QUICK_PROFILE:-$OUT/gpu-quick.json}  # QUICK_PROFILE: a quick profile of this GPU from an earlier run
[ -n "${QUICK_PROFILE:-}" ] || step quick 150 $PY -m torch.distributed.run --standalone --nproc-per-node 1 -m profiler \
  --quick --out "$QUICK"
ok=1
if [ -s "$QUICK" ]; then
  TAIL=14 step executor 150 $PY benchmarks/executor.py --skip-cpu --gpu-profile "$QUICK" --steps 12
  [ ! -e "$OUT/executor.log" ] || grep -q "step time   predicted" "$OUT/executor.log" || ok=0
  # where the executor's step goes (torch.profiler kernel times by kind, and host time), micro-batch 2
  TAIL=30 step breakdown 90 $PY -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/step_breakdown.py \
    --profile "$QUICK" --micro 2 --loop-rounds 5
else
  ok=0
fi
TAIL=45 step accuracy 170 $PY benchmarks/profile_accuracy.py --quick --skip-links --precisions bf16,fp32
[ ! -e "$OUT/accuracy.log" ] || grep -q "^summary" "$OUT/accuracy.log" || ok=0
# the full profile only where everything before it ran: else the machine's time is better left for a rerun
if [ "$ok" = 1 ]; then
  step full 400 $PY -m torch.distributed.run --standalone --nproc-per-node 1 -m profiler \
    --precisions "${FULL_PRECISIONS:-bf16,fp8}" --out "$OUT/gpu-full.json"
else
  echo "=== full: not run (a step before it failed)"
fi
# after the full profile (the diagnostics): one GEMM shape of the executor's step back to back, between
# memory-bound kernels and between idle gaps, with SM clock and power (the profile prices the step's
# GEMMs 16-20% above their kernel time); grouped K/V (enable_gqa) against expanded, the kernels that
# take each, time and peak memory (planner.cost.compute.sdpa_takes_grouped_kv, measured 2026-11-26)
step clock 45 $PY benchmarks/gemm_clock.py
TAIL=12 step attention 60 $PY benchmarks/attention_kernels.py --reps 5

for f in "$QUICK" "$OUT/gpu-full.json"; do
  [ -s "$f" ] || continue
  $PY - "$f" <<'EOF'
import sys
from planner.contracts import ClusterProfile
p = ClusterProfile.model_validate_json(open(sys.argv[1]).read())
c = p.compute
print(f"--- {sys.argv[1]}: {p.name}, {p.device.name}, {len(c.gemm)} GEMM / {len(c.attention)} attention / "
      f"{len(c.elementwise)} elementwise points")
print("achieved TFLOP/s:", {k.value: round(v, 1) for k, v in c.achieved_matmul_tflops.items()},
      f"memory {(c.achieved_memory_bandwidth_bytes_per_s or 0) / 1e12:.2f} TB/s")
for d in p.device_checks:
    print(f"device check rank {d.rank}: {d.precision.value} {d.gemm} {d.gemm_tflops:.0f} TFLOP/s, "
          f"add {d.memory_bandwidth_bytes_per_s / 1e12:.2f} TB/s")
for link in p.links:  # a piecewise fit's flat first segment: latency alone (its bandwidth term is nil)
    span = f" [{link.min_bytes or 0} B, {link.max_bytes or 'max'} B)" if link.min_bytes or link.max_bytes else ""
    bw = "flat (latency-bound)" if link.is_flat else f"{link.busbw_bytes_per_s / 1e9:.1f} GB/s"
    print(f"link {link.level.value} {link.collective.value}{span}: alpha {link.alpha_s * 1e6:.1f} us, {bw}, "
          f"R2 {'-' if link.fit_r2 is None else f'{link.fit_r2:.3f}'}")
for s in p.sources:
    if any(w in s for w in ("datasheet", "pageable", "measured in", "QUICK", "GPU clock", "CUDA timing")):
        print("note:", s[:400])
EOF
done
ls -la "$OUT"
