#!/usr/bin/env bash
# Re-tune the shipped database's problem set on the GPU this runs on: the fa-bench,
# llama3-8b and gemma2-9b presets, fp16 and bf16, causal and not, forward then backward,
# into --db.
#
#   bash scripts/retune.sh --db tuning_db/flashgen.db            # both modes, every preset
#   bash scripts/retune.sh --db my.db --mode bwd --preset fa-bench --dry-run
#   bash scripts/retune.sh --db my.db -- --remeasure             # after --: passed to tune
#
# The defaults are the parameters of the last full re-tunes of the shipped database
# (docs/tuning.md): forward --trials 4 --timeout 15, backward --trials 6 --timeout 25, 15
# compile workers. They suit a database that already holds the earlier runs: --trials counts
# new measurements only, so a resumed key spends them on the portfolio points it lacks and
# then on the sampler. From an empty database each key's first trials go to the default and
# the portfolio (up to 20 forward points at head dim 64): raise --fwd-trials and
# --fwd-timeout so every key gets through them. One database can be carried from GPU to GPU;
# rows are keyed by GPU, so each GPU's winners stay apart. scripts/slim_db.py then cuts it to
# the file that ships (winners, their trials, provenance).
set -euo pipefail

usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; cat <<'EOF'
Options:
  --db FILE             tuning database to write (required)
  --gpu N               CUDA GPU index (default 0)
  --mode fwd|bwd|both   what to tune (default both: forward, then backward)
  --preset NAME         fa-bench, llama3-8b or gemma2-9b; repeatable (default all three)
  --fwd-trials N        new forward measurements per problem (default 4)
  --fwd-timeout S       seconds of forward tuning per problem (default 15)
  --bwd-trials N        new backward measurements per problem (default 6)
  --bwd-timeout S       seconds of backward tuning per problem (default 25)
  --compile-workers N   compile threads (default 15)
  --fp8                 forward also in fp8 (e4m3, forward only; needs sm89 or newer)
  --dry-run             print the commands, run nothing
  -- ARGS...            passed to every `flashgen tune` call
EOF
}

die() { echo "retune.sh: $*" >&2; exit 2; }

db="" gpu=0 modes="fwd bwd" presets=() dry=0 workers=15 fp8=0
fwd_trials=4 fwd_timeout=15 bwd_trials=6 bwd_timeout=25
extra=()
while (($#)); do
  case "$1" in
    --db) db=${2:?--db needs a file}; shift 2 ;;
    --gpu) gpu=${2:?}; shift 2 ;;
    --mode)
      case "${2:-}" in
        fwd|bwd) modes=$2 ;;
        both) modes="fwd bwd" ;;
        *) die "--mode is fwd, bwd or both" ;;
      esac
      shift 2 ;;
    --preset)
      case "${2:-}" in
        fa-bench|llama3-8b|gemma2-9b) presets+=("$2") ;;
        *) die "--preset is fa-bench, llama3-8b or gemma2-9b (the shipped problem set)" ;;
      esac
      shift 2 ;;
    --fwd-trials) fwd_trials=${2:?}; shift 2 ;;
    --fwd-timeout) fwd_timeout=${2:?}; shift 2 ;;
    --bwd-trials) bwd_trials=${2:?}; shift 2 ;;
    --bwd-timeout) bwd_timeout=${2:?}; shift 2 ;;
    --compile-workers) workers=${2:?}; shift 2 ;;
    --fp8) fp8=1; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[[ -n "$db" ]] || die "--db FILE is required"
((${#presets[@]})) || presets=(fa-bench llama3-8b gemma2-9b)

preset_args=()
for p in "${presets[@]}"; do preset_args+=(--preset "$p"); done

run() {
  echo "+ $*"
  ((dry)) && return 0
  echo "  started $(date -u '+%Y-%m-%d %H:%M:%S') UTC"
  "$@"
  echo "  ended $(date -u '+%Y-%m-%d %H:%M:%S') UTC"
}

if ((!dry)) && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader -i "$gpu"
fi
for mode in $modes; do
  dtypes=fp16,bf16
  if [[ $mode == fwd ]]; then
    trials=$fwd_trials timeout=$fwd_timeout
    ((fp8)) && dtypes+=,fp8
  else trials=$bwd_trials timeout=$bwd_timeout; fi
  run "${PYTHON:-python3}" -m flashgen tune --gpu "$gpu" --mode "$mode" "${preset_args[@]}" \
    --dtype "$dtypes" --causal both --trials "$trials" --timeout "$timeout" \
    --compile-workers "$workers" --db "$db" ${extra[@]+"${extra[@]}"}
done
