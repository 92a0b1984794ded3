#!/usr/bin/env bash
# Backward on the GPU, in parallel batches (each case compiles three kernels, so one serial
# pytest run takes longer than a device call may): the diagnosis cases of scripts/diag_bwd.py,
# then the backward/autograd gpu tests split by dtype. Logs land in $OUT/t.
#   source .device-kit/install.sh && bash scripts/gpu-bwd-check.sh
set -u
out="${OUT:-gpu-out}"; mkdir -p "$out/t"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== diag $(date -u +%H:%M:%S)"
i=0
for cfg in "--d 128 --causal --dtype fp32 --tile 32,64,4,1" "--d 64 --causal --dtype fp32 --tile 32,64,4,1" \
           "--d 128 --dtype fp32 --tile 32,64,4,1" "--d 128 --causal --dtype fp32 --tile 16,32,4,1" \
           "--d 128 --causal --dtype fp16 --tile 32,64,4,1"; do
  i=$((i+1)); (echo "## $cfg"; timeout 120 python3 scripts/diag_bwd.py $cfg 2>&1; echo "rc=$?") >"$out/t/diag$i.log" &
done
wait; cat "$out"/t/diag*.log | grep -v Warning
echo "== tests $(date -u +%H:%M:%S)"
t=tests/test_backward.py
run() { timeout "${LIMIT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider "$@" 2>&1 | tail -4; }
run $t -k "default_variant and dtype0" >"$out/t/p1.log" &
run $t -k "default_variant and dtype1" >"$out/t/p2.log" &
run $t -k "default_variant and dtype2" >"$out/t/p3.log" &
run $t -k "odd_head and dtype0" >"$out/t/p4.log" &
run $t -k "odd_head and dtype1" >"$out/t/p5.log" &
run $t -k "odd_head and dtype2" >"$out/t/p6.log" &
run $t tests/test_autograd.py -k "atomic or search_space or autograd" >"$out/t/p7.log" &
wait
for f in "$out"/t/p*.log; do echo "-- $f"; cat "$f"; done
echo "== done $(date -u +%H:%M:%S)"
