#!/usr/bin/env bash
# The GPU check, one script for one lent machine (an H200 here): run from the repository root on a
# machine whose python3 has JAX with CUDA, optax, flax, orbax-checkpoint and rich installed.
#
#   OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh          # SMALL=1: the same on tiny shapes (a CPU dry run)
#   PARTS="forms verify" ...                                  # some parts only
#
# 1. forms: which way of writing an FP8 matmul reaches an FP8 GEMM (benchmarks/fp8_gemm_forms.py);
# 2. FP8 against bf16 step time of the built-in transformer (benchmarks/fp8_step.py), two widths;
# 3. `leanstep verify` on the GPU: the default configuration, then bf16 compute with FP8 delayed scaling
#    (the meshes check runs on simulated CPU devices in a child, as it does anywhere).
# Each part has its own time limit and log under $OUT; a part that fails does not stop the rest.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD" JAX_COMPILATION_CACHE_DIR=/tmp/leanstep-gpu-cache
PARTS=${PARTS:-forms fp8_step_2048 verify verify_fp8 fp8_step_4096}
if [ "${SMALL:-0}" = 1 ]; then
    square=512
    wide=(--d-model 64 --layers 1 --heads 2 --batch-size 4 --seq-len 32 --repeats 3)
    wider=(--d-model 128 --layers 1 --heads 2 --batch-size 4 --seq-len 32 --repeats 3)
else
    square=8192
    wide=(--d-model 2048 --layers 4 --heads 16 --batch-size 16 --seq-len 1024 --repeats 10)
    wider=(--d-model 4096 --layers 2 --heads 32 --batch-size 16 --seq-len 1024 --repeats 10)
fi
part() {  # part NAME LIMIT_S COMMAND...: runs it (if PARTS names it), logs to $OUT/NAME.log, prints rc and seconds
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    case " $PARTS " in *" $name "*) ;; *) return ;; esac
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "$name: rc=$? in $((SECONDS - start)) s"
}
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
    python3 -c "import jax, optax, flax; print('jax', jax.__version__, 'optax', optax.__version__, 'flax', flax.__version__); print(jax.devices())"
} 2>&1 | tee "$OUT/env.txt"
part forms 90 python3 -m benchmarks.fp8_gemm_forms --size $square --json "$OUT/forms.json"
part fp8_step_2048 170 python3 -m benchmarks.fp8_step "${wide[@]}" --json "$OUT/fp8_step_2048.json"
part verify 150 python3 -m leanstep.cli.launch verify --json "$OUT/verify.json"
part verify_fp8 110 python3 -m leanstep.cli.launch verify --precision params=float32,compute=bfloat16,output=float32 \
    --fp8 delayed --no-resume --json "$OUT/verify_fp8.json"
part fp8_step_4096 100 python3 -m benchmarks.fp8_step "${wider[@]}" --json "$OUT/fp8_step_4096.json"
tail -n 40 "$OUT"/*.log
