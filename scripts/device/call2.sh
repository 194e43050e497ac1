# call 2: reassemble + install TensorRT-RTX; does it run on this GPU? tiny-model engine tests
export PYTHONUNBUFFERED=1
D=$OUT; W=/tmp/stage/tensorrt_rtx_cu13_libs-1.7.1.116-py3-none-manylinux_2_28_x86_64.whl
cat /tmp/stage/libs.aa .dev/c2/libs.ab > $W && cp .dev/c2/model.aa /tmp/stage/
sha256sum $W | head -c 64; echo " got"; grep tensorrt_rtx .dev/c2/sums | head -c 64; echo " want"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $W .dev/c2/tensorrt_rtx_cu13_bindings-*cp312*.whl 2>&1 | tail -3
export PYTHONPATH=/tmp/site:/tmp/shim
python3 -c "from decodert.plugins.trt_compat import load_trt; print('tensorrt:', load_trt()[1].describe())" 2>&1 | tail -5
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_generate.py tests/test_trt_build.py tests/test_kv_blocks_device.py 2>&1 | tee $D/c2_pytest.txt | tail -40
