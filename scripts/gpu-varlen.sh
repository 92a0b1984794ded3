#!/usr/bin/env bash
# Issue 31 on the GPU: the gpu-marked tests of packed batches, modifiers and the transformers
# models (in parallel: each case compiles several kernels), then the targets' benchmark
# (benchmarks/varlen_modifiers.py) and `flashgen bench --window / --varlen`. Logs in $OUT.
#   bash scripts/gpu-varlen.sh            # ~10 minutes on an H100 or H200
set -u
out="${OUT:-gpu-out}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
run() { timeout "${LIMIT:-400}" python3 -m pytest -m gpu -q -p no:cacheprovider "$@" 2>&1 | tail -6; }
echo "== tests $(date -u +%H:%M:%S)"
run tests/test_varlen.py -k "packed_bf16 and (none or window)" >"$out/t1.log" &
run tests/test_varlen.py -k "packed_bf16 and (softcap or sinks or all)" >"$out/t2.log" &
run tests/test_varlen.py -k "window_bf16" >"$out/t3.log" &
run tests/test_transformers_models.py >"$out/t4.log" &
wait
for f in "$out"/t*.log; do echo "-- $f"; cat "$f"; done
echo "== targets $(date -u +%H:%M:%S)"
timeout 900 python3 benchmarks/varlen_modifiers.py --out "$out/varlen-targets.txt" 2>&1 | grep -v Warning
# The bench's problems tuned first (their keys hold the window / the length mix), so dispatch
# serves their winners, the one-tile fa3 kernels among the candidates, not the fa2 defaults.
db="${DB:-$out/tuning.db}"
echo "== tune the bench's problems $(date -u +%H:%M:%S)"
timeout -s INT 300 python3 -m flashgen tune --gpu 0 --shape 1,16,16,32768,32768,128 --dtype bf16 \
    --causal yes --window 4096,0 --trials "${TRIALS:-16}" --db "$db" 2>&1 | tail -4
timeout -s INT 300 python3 -m flashgen tune --gpu 0 --shape 16,16,16,1024,1024,128 --dtype bf16 \
    --causal yes --varlen 16 --trials "${TRIALS:-16}" --db "$db" 2>&1 | tail -4
echo "== flashgen bench $(date -u +%H:%M:%S)"
timeout 600 python3 -m flashgen bench --shape 1,16,16,32768,32768,128 --dtype bf16 --causal yes \
    --window 4096 --mode fwd,both --competitors flashgen,flex --no-plot --db "$db" \
    --out "$out/bench-window" 2>&1 | tail -20
timeout 600 python3 -m flashgen bench --shape 16,16,16,1024,1024,128 --dtype bf16 --causal yes \
    --varlen 16 --mode fwd,both --competitors flashgen,flex --no-plot --db "$db" \
    --out "$out/bench-varlen" 2>&1 | tail -20
echo "== done $(date -u +%H:%M:%S)"
