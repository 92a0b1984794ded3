#!/usr/bin/env bash
# Sweep the whole forward space of the search-quality problems on every GPU of this host
# (docs/search-quality.md). Each GPU runs WORKERS sweep processes: they compile in parallel
# and take turns on the GPU (the tuner's GPU lock), so compiling hides behind timing.
# Every process sweeps one part of every problem; the two lengths of a head dim and mask
# share their kernels (Triton's cache), so the 8k problems pay check and timing only.
#
#   bash scripts/sweep_space.sh OUT [SECONDS]   # resumable: run again until it says done
#
# SECONDS (default 540) stops the processes with SIGINT, which still writes their costs.
# Exit status: 0 when every part has swept every problem, 3 when time ran out first (run
# again), 1 when a worker failed (its log, OUT/logK.txt, says why).
# OUT/pK holds part K's sweep.db and cost files; scripts/merge_db.py joins them for the
# replay (`search_quality.py --phase replay --limit 0`).
set -uo pipefail

out=${1:?usage: sweep_space.sh OUT [SECONDS]}
seconds=${2:-540}
workers=${WORKERS:-2}
shapes=(--shape 8,32,32,2048,64,0 --shape 8,16,16,2048,128,1
        --shape 2,32,32,8192,64,0 --shape 2,16,16,8192,128,1)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if ((gpus < 1 || workers < 1)); then
  echo "error: sweep_space.sh needs a GPU (nvidia-smi -L found $gpus) and WORKERS >= 1" >&2
  exit 2
fi
parts=$((gpus * workers))
threads=$(( $(nproc) / parts )); threads=$(( threads > 0 ? threads : 1 ))
mkdir -p "$out"
echo "sweep: $gpus GPUs x $workers workers, $threads compile threads each, ${seconds}s"
pids=()
for ((k = 0; k < parts; k++)); do
  CUDA_VISIBLE_DEVICES=$((k / workers)) timeout -s INT "$seconds" \
    python3 scripts/search_quality.py --out "$out/p$k" --phase sweep --limit 0 \
      --part "$k/$parts" --compile-workers "$threads" "${shapes[@]}" \
      >>"$out/log$k.txt" 2>&1 &
  pids+=($!)
done
status=0
for k in "${!pids[@]}"; do
  wait "${pids[$k]}"; rc=$?
  if ((rc == 124)); then          # timeout's status: stopped, resumable
    ((status == 0)) && status=3
  elif ((rc != 0)); then
    echo "part $k failed (exit $rc): see $out/log$k.txt" >&2
    status=1
  fi
done
python3 - "$out" "$parts" <<'EOF'
import sqlite3, sys
out, parts = sys.argv[1], int(sys.argv[2])
total = 0
for k in range(parts):
    try:
        con = sqlite3.connect(f"file:{out}/p{k}/sweep.db?mode=ro", uri=True)
        rows = con.execute("select count(*) from trials").fetchone()[0]
    except sqlite3.Error as exc:
        rows = 0
        print(f"p{k}: {exc}")
    total += rows
    print(f"p{k}: {rows} rows")
print(f"sweep: {total} rows in all")
EOF
grep -h "^swept" "$out"/log*.txt || true
case $status in
  0) echo "sweep: done" ;;
  3) echo "sweep: time ran out; run again to resume" ;;
esac
exit "$status"
