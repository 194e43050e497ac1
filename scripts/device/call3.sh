# call 3: the real model: scripts/gpu_check.sh (export trt fp16, build, verify 64 steps, bench b1/b4 +- CUDA graphs)
export PYTHONUNBUFFERED=1
D=$OUT; G=/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/stage/model.aa .dev/c3/model.ab | python3 -c 'import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' > $G; sha256sum $G | head -c 64; echo; grep Q4_1 .dev/c3/sums | head -c 64; echo
export PYTHONPATH=/tmp/site:/tmp/shim
OUT=/tmp/gc STEP_LIMIT=240 bash scripts/gpu_check.sh $G 2>&1 | tee $D/c3_gpu_check.txt | tail -60
cp /tmp/gc/manifest.json $D/ 2>/dev/null
timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_plugins_trt.py 2>&1 | tee $D/c3_plugins_trt.txt | tail -15
