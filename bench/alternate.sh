#!/usr/bin/env bash
# Runs benchmark binaries of several builds in turn, one run each, round after round,
# until SECONDS have passed (a round is not started past them), so that every build
# sees the same card, clocks and neighbours; for judging a kernel change on a GPU
# machine without cargo. Each run writes OUTDIR/LABEL-N.json (and its table to
# OUTDIR/LABEL-N.txt); a run that fails is reported and the rounds go on.
#
#   bench/alternate.sh SECONDS OUTDIR LABEL=BINARY... [-- ARGS...]
#
# A LABEL=BINARY may carry the binary's own arguments after it, split at spaces (say
# 'bands=./gpu --nvfp4-launch bands'), to compare settings of one build. ARGS go to
# every binary (say `--shape 16384x8192 --iters 10`). Then, where cargo is:
#   cargo xtask bench-merge --out base.json --label base OUTDIR/base-*.json
#   cargo xtask bench-merge --out new.json --label new OUTDIR/new-*.json
#   cargo xtask bench-compare --base base.json --new new.json
set -u
if [ $# -lt 3 ]; then
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
seconds=$1 out=$2
shift 2
labels=() bins=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    case $1 in
    *=*) labels+=("${1%%=*}") bins+=("${1#*=}") ;;
    *)
        echo "alternate.sh: expected LABEL=BINARY, got '$1'" >&2
        exit 2
        ;;
    esac
    shift
done
[ $# -gt 0 ] && shift  # the --
if [ ${#bins[@]} -eq 0 ]; then
    echo "alternate.sh: no LABEL=BINARY given" >&2
    exit 2
fi
for b in "${bins[@]}"; do
    read -ra cmd <<<"$b"
    if [ ! -x "${cmd[0]:-}" ]; then
        echo "alternate.sh: '${cmd[0]:-}' is not an executable file" >&2
        exit 2
    fi
done
mkdir -p "$out"
start=$SECONDS round=0 failed=0
while [ $((SECONDS - start)) -lt "$seconds" ]; do
    for i in "${!bins[@]}"; do
        f="$out/${labels[$i]}-$round"
        read -ra cmd <<<"${bins[$i]}"
        if ! "${cmd[@]}" "$@" --json "$f.json" >"$f.txt" 2>&1; then
            echo "alternate.sh: ${labels[$i]} failed in round $round (see $f.txt)" >&2
            failed=$((failed + 1))
        fi
    done
    round=$((round + 1))
done
echo "alternate.sh: $round rounds of ${labels[*]} in $((SECONDS - start)) s, $failed failed runs"
[ "$failed" -eq 0 ]
