#!/usr/bin/env bash
# deploy/spd.service against systemd and the built spd:
#   - systemd-analyze verify is clean, with the unit's spd pointed at the build;
#   - systemd-analyze security --offline=yes rates its exposure at most 3.0;
#   - the hardening an operator counts on is there: its own user (the one
#     deploy/spd.sysusers creates), ProtectSystem=strict, a system call filter,
#     the address families, a closed device policy with the GPUs and RDMA
#     devices allowed, the runtime directory kept across restarts;
#   - RestartPreventExitStatus holds the status spd exits with on a bad
#     configuration, so that systemd does not restart it in a loop.
# Where systemd-analyze is missing, or older than 252 (no --offline): skipped
# (77), saying so; the checks before the score have run by then.
# Usage: test_systemd_unit.sh SOURCE_DIR SPD
set -euo pipefail
src=$1 spd=$2
command -v systemd-analyze > /dev/null || { echo "skipped: systemd-analyze is not installed (Debian: systemd)"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
unit=$tmp/spd.service
sed "s#/usr/local/bin/spd #$spd #" "$src/deploy/spd.service" > "$unit"
grep -q "^ExecStart=$spd " "$unit" || fail "the unit's ExecStart is not /usr/local/bin/spd ..."
out=$(systemd-analyze verify "$unit" 2>&1) || fail "systemd-analyze verify: $out"
[ -z "$out" ] || fail "systemd-analyze verify warns: $out"
echo "systemd-analyze verify: clean"

# The value of the last assignment of a directive, and every assignment.
value() { sed -n "s/^$1=//p" "$unit" | tail -1; }
all() { sed -n "s/^$1=//p" "$unit"; }

[ "$(value Type)" = notify ] || fail "spd speaks sd_notify; the unit must be Type=notify"
user=$(value User)
[ -n "$user" ] && [ "$user" != root ] && [ "$user" != 0 ] || fail "the unit runs spd as root (User=$user)"
[ "$(value ProtectSystem)" = strict ] || fail "ProtectSystem is not strict"
[ "$(value NoNewPrivileges)" = yes ] || fail "NoNewPrivileges is not yes"
[ -n "$(all SystemCallFilter)" ] || fail "no SystemCallFilter"
[ -n "$(value RestrictAddressFamilies)" ] || fail "no RestrictAddressFamilies"
[ "$(value DevicePolicy)" = closed ] || fail "DevicePolicy is not closed"
devices=$(all DeviceAllow | tr '\n' ' ')
for d in char-nvidia-frontend char-nvidia-uvm char-infiniband_verbs; do
  [[ " $devices" == *" $d rw"* ]] || fail "DeviceAllow lacks $d (GPUs and RDMA devices): $devices"
done
[ "$(value RuntimeDirectory)" = spd ] || fail "RuntimeDirectory is not spd"
[ "$(value RuntimeDirectoryPreserve)" = yes ] ||
  fail "RuntimeDirectoryPreserve is not yes: a restart would take /run/spd from the containers that mounted it"
sock=$(all Environment | sed -n 's/^SPD_SOCKET=//p')
[ "$sock" = "/run/spd/spd.sock" ] || fail "the socket ($sock) is not in the runtime directory"
echo "User=$user; strict, filtered, closed device policy with GPUs and RDMA; /run/spd kept across restarts"

# The status of a bad configuration, from spd itself, stops the restarts.
rc=0
"$spd" --check-config --set peers=127.0.0.1:9 > /dev/null 2>&1 || rc=$?
[ "$rc" -ne 0 ] || fail "spd accepted peers without cluster_secret_file"
[[ " $(value RestartPreventExitStatus) " == *" $rc "* ]] ||
  fail "spd exits $rc on a bad configuration, which RestartPreventExitStatus ($(value RestartPreventExitStatus)) lacks"
echo "a bad configuration exits $rc, which the unit does not restart"

# The user the unit names is the one deploy/spd.sysusers creates.
if command -v systemd-sysusers > /dev/null; then
  out=$(systemd-sysusers --dry-run --root="$tmp" "$src/deploy/spd.sysusers" 2>&1) || fail "systemd-sysusers: $out"
  [[ $out == *"Creating user '$user'"* ]] || fail "deploy/spd.sysusers does not create $user: $out"
  echo "deploy/spd.sysusers creates $user"
fi

sec=$(systemd-analyze security --offline=yes "$unit" 2>&1) || true
if [[ $sec == *"unrecognized option"* ]]; then
  echo "skipped: systemd-analyze $(systemd-analyze --version | head -1 | cut -d' ' -f2) has no security --offline (systemd 252 or later)"
  exit 77
fi
score=$(sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p' <<< "$sec")
[ -n "$score" ] || fail "systemd-analyze security printed no exposure level: $sec"
awk -v s="$score" 'BEGIN { exit !(s <= 3.0) }' || fail "systemd-analyze security rates the unit $score, above 3.0"
echo "systemd-analyze security --offline=yes: $score (at most 3.0)"
