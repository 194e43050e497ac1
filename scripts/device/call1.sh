# call 1: stage part of the TRT-RTX libs wheel; Triton kernels vs numpy; attention bandwidth
export PYTHONUNBUFFERED=1
D=$OUT; mkdir -p /tmp/stage /tmp/shim /tmp/site
cp .dev/c1/libs.aa /tmp/stage/ &
ln -sfn "$PWD" /tmp/shim/decodert
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .dev/c1/gguf-*.whl
export PYTHONPATH=/tmp/site:/tmp/shim
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader
python3 -c "import torch,triton,onnxruntime;print('torch',torch.__version__,'triton',triton.__version__,'ort',onnxruntime.__version__,torch.cuda.get_device_name())"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_plugins.py 2>&1 | tee $D/c1_pytest.txt | tail -25
timeout 120 python3 bench/attention_kernel.py --contexts 1024 4096 8192 16384 --batches 1 8 --json $D/attn.json 2>&1 | tee $D/c1_attn.txt | tail -20
wait; ls -la /tmp/stage
