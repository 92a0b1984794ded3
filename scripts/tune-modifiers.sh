#!/usr/bin/env bash
# Tune issue 31's benchmark problems (benchmarks/varlen_modifiers.py) into --db, forward and
# backward, so dispatch serves their winners: bf16 D128 H16, a causal window at N32k, softcap
# 30 at B4 N8k causal, and 16 packed sequences of 16k tokens (causal and full). Keys record
# which modifiers a problem has, not their values, so these rows serve every window and cap.
#
#   bash scripts/tune-modifiers.sh --db out/tuned.db                 # ~7 minutes on an H100
#   bash scripts/tune-modifiers.sh --db out/tuned.db --only softcap,window --trials 8
set -euo pipefail

usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; cat <<'EOF'
Options:
  --db FILE        tuning database to write (required)
  --only LIST      some of softcap,window,varlen (default all three)
  --trials N       new measurements per problem and mode (default 12)
  --timeout S      seconds per problem and mode (default 50)
  --dry-run        print the commands, run nothing
EOF
}

die() { echo "tune-modifiers.sh: $*" >&2; exit 2; }

db="" only="softcap,window,varlen" trials=12 timeout=50 dry=0
while (($#)); do
  case "$1" in
    --db) db=${2:?--db needs a file}; shift 2 ;;
    --only) only=${2:?}; shift 2 ;;
    --trials) trials=${2:?}; shift 2 ;;
    --timeout) timeout=${2:?}; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
[[ -n $db ]] || die "--db is required"
for part in ${only//,/ }; do
  case "$part" in softcap|window|varlen) ;; *) die "--only takes softcap, window, varlen" ;; esac
done

tune() {  # one problem, both modes; SIGINT past the budget keeps every finished trial
  local cmd=(python3 -m flashgen tune --dtype bf16 --mode both --trials "$trials"
             --timeout "$timeout" --compile-workers 15 --db "$db" "$@")
  echo "== $(date -u +%H:%M:%S) ${cmd[*]}"
  ((dry)) && return 0
  timeout -s INT $((4 * timeout + 120)) "${cmd[@]}" 2>&1 | tail -8 || echo "(exit $?)"
}

[[ ,$only, == *,softcap,* ]] && tune --shape 4,16,16,8192,8192,128 --causal yes --softcap 30
[[ ,$only, == *,window,* ]] && tune --shape 1,16,16,32768,32768,128 --causal yes --window 4096,0
[[ ,$only, == *,varlen,* ]] && tune --shape 16,16,16,1024,1024,128 --causal both --varlen 16
echo "== $(date -u +%H:%M:%S) done"
