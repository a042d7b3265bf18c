#!/usr/bin/env bash
# Demo, cost-model calibration and step-time comparisons on a machine with one GPU, in about
# six minutes (JAX compilation included). Run from the repository root:
#
#   OUT=/tmp/gpu_out bash benchmarks/gpu_checks.sh
#
# Every step runs in its own process under `timeout`; its output goes to $OUT/<step>.log and
# its figures into $OUT/gpu-h100.json (the ProfileDB into $OUT/gpu-profile.json). A failing
# step does not stop the others. Sizes (seconds per step, repeats, steps) are variables:
#   PY=python3  T_DEMO=120 DEMO_STEPS=5  T_PROFILE=90 REPEATS=7 SIZES=1024,4096,8192
#   T_CAL=150 CAL_MODELS=mlp-small,gpt-tiny,gpt-small,moe-small,wresnet-small
#   T_STEPS=150 STEPS=20 PARITY_B=1
# Local smoke test on the CPU: JAX_PLATFORMS=cpu PY=.venv/bin/python OUT=/tmp/gpu_out ...
set -u
set -o pipefail
cd "$(dirname "$0")/.."

: "${OUT:?set OUT to the output folder}"
PY=${PY:-python3}
T_ENV=${T_ENV:-60}
T_DEMO=${T_DEMO:-120}
DEMO_STEPS=${DEMO_STEPS:-5}
T_PROFILE=${T_PROFILE:-90}
REPEATS=${REPEATS:-7}
SIZES=${SIZES:-1024,4096,8192}
COPY_MIB=${COPY_MIB:-1024}
T_CAL=${T_CAL:-150}
CAL_MODELS=${CAL_MODELS:-mlp-small,gpt-tiny,gpt-small,moe-small,wresnet-small}
T_STEPS=${T_STEPS:-150}
STEPS=${STEPS:-20}
# B = 8 needs lax.scan tracing, which fails on jax 0.11 (KeyError num_consts in
# alpa_mini/graph/tracing.py), so the parity rows default to B = 1.
PARITY_B=${PARITY_B:-1}

export PYTHONUNBUFFERED=1
# The repository for `benchmarks`, after what PYTHONPATH already holds (on the GPU machine:
# /tmp/site with the alpa_mini wheel, whose `alpa_mini.solvers` etc. the bare tree lacks);
# PYTHONSAFEPATH keeps `-m` from putting the working directory first.
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export PYTHONSAFEPATH=1
mkdir -p "$OUT"
JSON="$OUT/gpu-h100.json"
PROFILE="$OUT/gpu-profile.json"
declare -A RC

step() {  # step NAME SECONDS COMMAND...: run it under timeout, log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "===== $name (limit ${limit}s): $*" | tee -a "$OUT/$name.log"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log"
    local rc=$?
    RC[$name]=$rc
    echo "===== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
}

START=$SECONDS
{
    date -u
    nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit \
        --format=csv 2>&1 || true
    "$PY" -c 'import sys, jax; print(sys.version); print("jax", jax.__version__); print(jax.devices())'
} 2>&1 | tee "$OUT/env.log"
step env "$T_ENV" "$PY" -m benchmarks.gpu_checks --json "$JSON" env

step demo "$T_DEMO" "$PY" -m benchmarks.gpu_checks --json "$JSON" demo --steps "$DEMO_STEPS"
if [ "${RC[demo]}" = 1 ]; then  # a mismatch: is it the matmul precision (TF32)?
    JAX_DEFAULT_MATMUL_PRECISION=highest step demo "$T_DEMO" \
        "$PY" -m benchmarks.gpu_checks --json "$JSON" demo --steps "$DEMO_STEPS"
fi

step profile "$T_PROFILE" "$PY" -m benchmarks.gpu_checks --json "$JSON" profile \
    --repeats "$REPEATS" --sizes "$SIZES" --copy-mib "$COPY_MIB" --profile "$PROFILE"

if [ -f "$PROFILE" ]; then
    step calibration "$T_CAL" "$PY" -m benchmarks.gpu_checks --json "$JSON" calibration \
        --profile "$PROFILE" --models "$CAL_MODELS"
else
    echo "calibration: skipped, no profile" | tee "$OUT/calibration.log"
    RC[calibration]=skipped
fi

step steps "$T_STEPS" "$PY" -m benchmarks.gpu_checks --json "$JSON" steps --steps "$STEPS" \
    --micro-batches "$PARITY_B"

echo
echo "===== summary after $((SECONDS - START)) s"
for name in env demo profile calibration steps; do
    echo "$name: exit ${RC[$name]:-not run}"
done
"$PY" - "$JSON" <<'EOF' 2>&1 | tee "$OUT/summary.log"
import json, sys
d = json.load(open(sys.argv[1]))
e = d.get("env", {})
print("device:", e.get("device_kind"), "| jax", e.get("jax"), "| python", e.get("python"))
for key in ("demo", "demo_highest"):
    for m, r in (d.get(key) or {}).items():
        if isinstance(r, dict) and "ok" in r:
            print(f"{key} {m}: ok={r['ok']} step={r['measured_step_time'] * 1e3:.2f} ms "
                  f"predicted={r['predicted_step_time'] * 1e3:.2f} ms diff={r['max_param_diff']:.1e}")
p = d.get("profile") or {}
for c in (p.get("profile_devices") or {}).get("profile", {}).get("compute", []):
    print(f"profile_devices: {c['matmul_flops'] / 1e12:.1f} TFLOP/s f32, "
          f"{c['memory_bandwidth'] / 1e9:.0f} GB/s, launch {c['launch_overhead'] * 1e6:.1f} us")
for r in p.get("matmul") or []:
    print(f"matmul {r['dtype']} n={r['n']}: {r['tflops']:.1f} TFLOP/s")
if p.get("bandwidth"):
    print(f"elementwise {p['bandwidth']['mib']} MiB: {p['bandwidth']['gb_per_s']:.0f} GB/s")
c = d.get("calibration") or {}
for pt in c.get("points", []):
    print(f"cal {pt['model']} {pt['cluster']}: pred {pt['predicted'] * 1e3:.3f} "
          f"meas {pt['measured'] * 1e3:.3f} ms err {pt['error']:.0%}")
print("cal summary:", json.dumps(c.get("summary")))
s = d.get("steps") or {}
for r in (s.get("shard_parallel") or {}).get("rows", []):
    print("shard", r)
for r in s.get("runtime_parity") or []:
    print(f"parity {r['model']} B={r['B']}: pipe {r['pipe_ms']:.2f} jit {r['jit_ms']:.2f} "
          f"ilp {r['ilp_ms']:.2f} ms ratio {r['ratio']:.3f}")
for key in ("demo", "profile", "calibration", "steps"):
    for err in (d.get(key) or {}).get("errors") or []:
        print("ERROR", key, err)
EOF
exit 0
