# v34 call 1 (branch layer-indexed = v34-candidates + layer_indexed; its library as the default
# .gpu/libhumming_jax_cuda.so.xz; carry .gpu .whl; ~560 s): the sweeps alone on the GPU (L2
# prefetch distance, grid cap, one fp8 call against two, the layer in one call against three),
# then the new tests and both sanitizers with the prefetch and the cap on.
T0=$(date +%s); left() { echo $(( ${1:-570} - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
source scripts/device_env.sh > /dev/null 2>&1 || { echo "device_env failed"; exit 1; }
python3 -c 'import humming_jax as h; print(h._ffi.backend_report())'
S="--timer device --repeats 3"
timeout 100 python3 benchmarks/sweep_env.py --var HUMMING_JAX_FUSED_LAYER --values 0,1 --part layer --shapes qwen3-30b-a3b,deepseek-v3-ep8,mixtral-8x7b --formats w4a16-int4-g128,w4a16-mxfp4,bf16 --tokens 1,16 $S --out $OUT/sweep-fused-layer.json 2>&1 | grep -v "SM clock" | tail -4
timeout 150 python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_L2_AHEAD --values 0,2,4,8 --part gemms --shapes deepseek-v3-ep8,mixtral-8x7b,qwen3-30b-a3b --formats w4a16-int4-g128,w4a16-mxfp4 --tokens 1,16 $S --out $OUT/sweep-l2-ahead.json 2>&1 | grep -v "SM clock" | tail -4
HUMMING_JAX_DECODE_L2_AHEAD=4 timeout 60 python3 benchmarks/sweep_env.py --var HUMMING_JAX_DECODE_GRID_ITEMS --values unset,8,16 --part gemms --shapes deepseek-v3-ep8,mixtral-8x7b --formats w4a16-int4-g128 --tokens 16 $S --out $OUT/sweep-grid-items.json 2>&1 | grep -v "SM clock" | tail -2
timeout 70 python3 benchmarks/sweep_env.py --var HUMMING_JAX_FUSED_EXPERTS --values 0,1 --part gemms --shapes qwen3-30b-a3b,deepseek-v3-ep8,mixtral-8x7b --formats w8a8-fp8-block128 --tokens 1,16 $S --out $OUT/sweep-fused-experts-fp8.json 2>&1 | grep -v "SM clock" | tail -2
echo "sweeps after $(( $(date +%s) - T0 )) s"
B=$(left); K="layer_indexed or experts_indexed or capped_grid or more_items or without_valid_ids or command_buffers"
for i in 0 1 2; do (HUMMING_JAX_TEST_SHARD=$i/3 timeout $B python3 -m pytest -q -p no:cacheprovider -rf tests/test_cuda_fast_paths.py tests/test_layer_indexed.py tests/test_experts_indexed.py tests/test_input_quant.py -k "$K or input_quant or test_layer_indexed or test_experts_indexed" > $OUT/t_$i.log 2>&1; tail -n 2 $OUT/t_$i.log) & done
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for tool in memcheck racecheck; do HUMMING_JAX_DECODE_L2_AHEAD=4 HUMMING_JAX_DECODE_GRID_ITEMS=2 XLA_FLAGS="--xla_gpu_autotune_level=0" timeout $(( B / 2 )) $SAN --tool $tool --error-exitcode 17 --print-limit 30 python3 scripts/sanitize_driver.py > $OUT/$tool.log 2>&1; echo "$tool rc $?"; tail -n 2 $OUT/$tool.log; done
wait; echo "done after $(( $(date +%s) - T0 )) s"
