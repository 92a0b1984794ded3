#!/usr/bin/env bash
# GPU validation on the device machine, from the repo root, with the device kit copied to
# .device-kit/ (git-ignored). Each stage has its own time limit so one slow stage cannot eat
# the lease; logs and the tuning database land in $OUT (or ./gpu-out).
#   source .device-kit/install.sh && bash scripts/gpu-validate.sh [tests|tune|bench]...
set -u
out="${OUT:-gpu-out}"
mkdir -p "$out/t"
export PYTHONUNBUFFERED=1
stage() { echo "== $1 ($(date -u +%H:%M:%S))"; }
for what in "${@:-tests}"; do
  case "$what" in
    tests)
      stage "backward gpu tests"
      timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_backward.py \
        -k "not search_space_sample" >"$out/t/bwd.log" 2>&1; tail -3 "$out/t/bwd.log"
      stage "export gpu tests"
      timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_export.py \
        >"$out/t/export.log" 2>&1; tail -3 "$out/t/export.log"
      stage "TMA forward gpu tests"
      timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_forward.py -k tma \
        >"$out/t/tma.log" 2>&1; tail -3 "$out/t/tma.log"
      ;;
    tune)
      stage "tune fa-bench fp16, causal and not"
      timeout 270 python3 -m flashgen tune --gpu 0 --preset fa-bench --dtype fp16 --causal both \
        --trials 16 --timeout 10 --compile-workers 12 --db "$out/tuning.db" \
        >"$out/t/tune.log" 2>&1; tail -32 "$out/t/tune.log"
      ;;
    bench)
      stage "bench fa-bench fp16 fwd and fwd+bwd"
      timeout -s INT 330 python3 -m flashgen bench --preset fa-bench --dtype fp16 --causal both \
        --mode fwd,both --competitors flashgen,sdpa-flash,sdpa-cudnn --rep-ms 40 --gpu 0 \
        --no-plot --out "$out/bench" >"$out/t/bench.log" 2>&1; tail -c 7000 "$out/t/bench.log"
      ;;
  esac
done
