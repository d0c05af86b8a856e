#!/usr/bin/env bash
# deploy/spd.service checked by systemd-analyze verify, with ExecStart pointed
# at the built spd. Where systemd-analyze is missing: skipped (77), saying so.
# Usage: test_systemd_unit.sh SOURCE_DIR SPD
set -euo pipefail
src=$1 spd=$2
command -v systemd-analyze > /dev/null || { echo "skipped: systemd-analyze is not installed"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sed "s#^ExecStart=/usr/local/bin/spd#ExecStart=$spd#" "$src/deploy/spd.service" > "$tmp/spd.service"
grep -q "^ExecStart=$spd " "$tmp/spd.service" || { echo "FAIL: the unit's ExecStart is not /usr/local/bin/spd ..."; exit 1; }
out=$(systemd-analyze verify "$tmp/spd.service" 2>&1) || { echo "FAIL: systemd-analyze verify: $out"; exit 1; }
[ -z "$out" ] || { echo "FAIL: systemd-analyze verify warns: $out"; exit 1; }
grep -q '^Type=notify$' "$tmp/spd.service" || { echo "FAIL: spd speaks sd_notify; the unit must be Type=notify"; exit 1; }
echo "systemd-analyze verify: clean"
