#!/usr/bin/env bash
# The kernel check for a host of a CPU kind the project has not run on yet (AVX-512, AMX, AVX-VNNI):
# host line, both kernel builds, the kernel tests on each, and the int8-vs-int16 activation timings
# that decide `--gguf-activations auto` there.
#
#   bash benchmarks/isa_check.sh            # from a checkout whose python3 has torch, numpy, pytest
#
# 1. the host: CPU model, cores, the instruction-set flags the kernels branch on, a copy bandwidth;
# 2. the native and avx2 builds (platform/cpu_kernels.py VARIANTS), each timed;
# 3. the kernel tests (K-quant, int8 activations, AMX, attention, norms, MoE blocks) on both builds:
#    the kernel_variant fixture runs the avx2 build beside the native one, so no path is only
#    compile-tested; tests that need the embedded model skip or error where it is not installed;
#    the native build's link is printed too (its NEEDED libraries, link flags, compiler): on one host
#    (torch 2.11+cu130, Ubuntu g++ 13.3) the extension listed no libstdc++, and every error message
#    holding an integer (TORCH_CHECK's "row 16 outside ...") crashed inside std::ostream there;
# 4. gguf_gemm on a 1B Q4_K_M's projection shapes, int16 against int8 activations (and, where AMX-INT8
#    is lent, int8 on AMX tiles), rows 1 / 4 / 16 / 64, at all cores and at 4 threads
#    (benchmarks/kernel_options.py gguf-twins);
# 5. where the embedded model is installed (its tokenizer): a random 1B Q4_K_M (random_gguf.py) decoded
#    at 1 and 16 rows with each --gguf-activations, the default dtype, at all cores and at 4 threads
#    (decode_speed.py).
# Every step runs under `timeout` within BUDGET seconds (default 600). Knobs: BUDGET, PY (python3),
# PYTEST_WORKERS (8, needs pytest-xdist; 0 runs in one process).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
BUDGET=${BUDGET:-600}
PY=${PY:-python3}
WORKERS=${PYTEST_WORKERS:-8}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE

step() {  # step NAME LIMIT CMD...: CMD under min(LIMIT, budget left)
    local name=$1 limit=$2 left=$((BUDGET - SECONDS))
    shift 2
    ((left < limit)) && limit=$left
    if ((limit < 10)); then echo "=== $name: SKIPPED (budget spent)"; return 3; fi
    echo "=== $name (limit ${limit}s, ${SECONDS}s elapsed)"
    local t0=$SECONDS
    timeout --kill-after=5 "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc in $((SECONDS - t0))s"
    return $rc
}

echo "=== host"
grep -m1 "model name" /proc/cpuinfo
echo "cores: $(nproc)"
grep -m1 -o -w -E "avx2|fma|f16c|avx512f|avx512bw|avx512vl|avx512_vnni|avx512_bf16|avx_vnni|amx_tile|amx_int8|amx_bf16" \
    /proc/cpuinfo | sort -u | tr '\n' ' '
echo
"$PY" -c "import torch; print('torch', torch.__version__, 'threads', torch.get_num_threads())"
step "copy bandwidth" 30 "$PY" - <<'EOF'
import time, torch
a = torch.empty(256 * 2**20, dtype=torch.uint8); a.fill_(1); b = torch.empty_like(a)
best = min((lambda t0: (b.copy_(a), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(8))
print(f"copy {2 * a.numel() / best / 1e9:.1f} GB/s (read + write, 256 MiB)")
EOF

step "build native and avx2 kernels" 240 "$PY" - <<'EOF'
import time
from concurrent.futures import ThreadPoolExecutor
from iterserve.platform.cpu_kernels import load_cpu_kernels
def build(v):
    t0 = time.perf_counter(); k = load_cpu_kernels(v)
    return v, k is not None and k.lanes_isa(), time.perf_counter() - t0
with ThreadPoolExecutor(2) as pool:
    for v, isa, s in pool.map(build, ["native", "avx2"]):
        print(f"{v}: lanes {isa}, {s:.0f} s")
EOF

so=$("$PY" -c "from iterserve.platform.cpu_kernels import load_cpu_kernels; print(load_cpu_kernels().__file__)")
echo "native build: $so"
readelf -d "$so" 2>/dev/null | grep NEEDED
grep -m1 "^ldflags" "$(dirname "$so")/build.ninja" 2>/dev/null
c++ --version | head -n 1

XDIST=()
((WORKERS > 0)) && "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "$WORKERS")
step "kernel tests" 200 env OMP_NUM_THREADS=2 "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" \
    tests/test_kquant.py tests/test_cpu_kernels.py tests/test_cpu_amx.py tests/test_cpu_elementwise.py \
    tests/test_cpu_norm.py tests/test_cpu_prefill_attention.py tests/test_moe_blocks.py tests/test_gguf_blocks.py \
    -rfE

for threads in 0 4; do
    label=all; env=()
    ((threads)) && { label=$threads; env=(OMP_NUM_THREADS="$threads"); }
    step "gguf_gemm int16 vs int8 ($label threads)" 90 env "${env[@]}" "$PY" benchmarks/kernel_options.py gguf-twins \
        --rows 1 4 16 64 --shapes 3072x2048 2048x2048 16384x2048 2048x8192 --types Q4_K Q6_K --rounds 5
done
if "$PY" -c "from iterserve.model.loader import resolve_model; resolve_model('smollm2-135m')" 2>/dev/null; then
    gguf=${WORK:-/tmp}/isa-check-1b-q4km.gguf
    [[ -f $gguf ]] || step "write a random 1B Q4_K_M" 120 "$PY" benchmarks/random_gguf.py "$gguf" --preset 1b
    for threads in 0 4; do
        for act in int16 int8-except-down int8; do
            args=()
            ((threads)) && args=(--threads "$threads")
            step "1B decode, --gguf-activations $act ($((threads ? threads : $(nproc))) threads)" 90 \
                "$PY" benchmarks/decode_speed.py --model "$gguf" --batch 1 16 --dtype auto --tokens 32 "${args[@]}" \
                --extra "{\"gguf_activations\": \"$act\", \"kv_cache_memory\": \"1GiB\"}" 2>&1 | grep "batch"
        done
    done
else
    echo "=== 1B decode: SKIPPED (the embedded model, whose tokenizer random_gguf.py reads, is not installed)"
fi
echo "=== done in ${SECONDS}s"
