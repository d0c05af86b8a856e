#!/usr/bin/env bash
# Checks that the seed corpus (CORPUS/*/seed-*) is what fuzz_seeds writes now:
# after a change of spd.proto or of the ring layout, the seeds must follow.
#   check_seeds.sh FUZZ_SEEDS CORPUS
set -euo pipefail
seeds_bin=$1 corpus=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$seeds_bin" "$tmp"
status=0
for f in "$tmp"/*/seed-*; do
  rel=${f#"$tmp"/}
  if ! cmp -s "$f" "$corpus/$rel"; then
    echo "differs or missing: $corpus/$rel" >&2
    status=1
  fi
done
for f in "$corpus"/*/seed-*; do
  rel=${f#"$corpus"/}
  if [ ! -e "$tmp/$rel" ]; then
    echo "no longer written: $corpus/$rel" >&2
    status=1
  fi
done
if [ $status -ne 0 ]; then
  echo "rewrite the seeds: $seeds_bin $corpus" >&2
fi
exit $status
