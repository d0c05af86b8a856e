#!/usr/bin/env bash
# The deployment files against the programs they deploy:
#   - the Kubernetes manifest parses; spd reads its configuration (unknown
#     options would stop it); the daemon's socket, the trainer's SPC_SOCKET and
#     the shared hostPath are one directory; spd gets the host PID namespace
#     and CAP_SYS_PTRACE, which it needs to reach trainers' memory;
#   - the Containerfile's runtime stage installs a package for every shared
#     library the built spd, spctl and libspclient name (DT_NEEDED) and for
#     NCCL, which spd loads, as its '# runtime-libraries:' line maps them (the
#     image is Ubuntu's, its package names are not this host's: a real image
#     build checks the names); its build packages are ones tools/setup
#     installs, or NCCL's from the CUDA repository; every path it copies exists;
#   - `cmake --install` gives programs that run from any prefix and a Python
#     binding that finds the installed libspclient.
# Usage: test_deploy.sh SOURCE_DIR BUILD_DIR SPD SPCTL
set -euo pipefail
src=$1 build=$2 spd=$3 spctl=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

echo "--- deploy/k8s/spd.yaml"
/usr/bin/python3 - "$src/deploy/k8s/spd.yaml" "$tmp/k8s.conf" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
kinds = {d["kind"]: d for d in docs}
for k in ("ConfigMap", "DaemonSet", "Pod"):
    assert k in kinds, f"no {k} in the manifest"
conf = kinds["ConfigMap"]["data"]["spd.conf"]
open(sys.argv[2], "w").write(conf)
opts = dict(l.split(None, 1) for l in conf.splitlines() if l.strip() and not l.lstrip().startswith("#"))
sock = opts["socket"]
ds = kinds["DaemonSet"]["spec"]["template"]["spec"]
assert ds.get("hostPID") is True, "spd needs the host PID namespace (clients are known by pid)"
c = ds["containers"][0]
assert "SYS_PTRACE" in c["securityContext"]["capabilities"]["add"], "spd needs CAP_SYS_PTRACE"
vols = {v["name"]: v for v in ds["volumes"]}
mounts = {m["name"]: m for m in c["volumeMounts"]}
sockdir = sock.rsplit("/", 1)[0]
assert mounts["socket-dir"]["mountPath"] == sockdir, "the socket's directory is not the shared mount"
host = vols["socket-dir"]["hostPath"]["path"]
conf_path = c["args"][c["args"].index("--config") + 1]
assert conf_path == mounts["config"]["mountPath"] + "/spd.conf" and "subPath" not in mounts["config"], \
    "spd reads another config path, or the ConfigMap is mounted by subPath (edits would never reach the pod)"
secret_dir = mounts["secret"]["mountPath"]
assert opts["cluster_secret_file"].startswith(secret_dir + "/"), "the secret file is not in the secret's mount"
pod = kinds["Pod"]["spec"]
tc = pod["containers"][0]
env = {e["name"]: e.get("value") for e in tc.get("env", [])}
assert env["SPC_SOCKET"] == sock, "the trainer's SPC_SOCKET is not spd's socket"
tvols = {v["name"]: v for v in pod["volumes"]}
tmounts = {m["name"]: m for m in tc["volumeMounts"]}
assert tvols["socket-dir"]["hostPath"]["path"] == host, "trainer and spd mount different host directories"
assert tmounts["socket-dir"]["mountPath"] == sockdir, "the trainer mounts the socket directory elsewhere"
print(f"manifest: socket {sock} shared through host {host}; hostPID, SYS_PTRACE")
PY
"$spd" --config "$tmp/k8s.conf" --dump-config > "$tmp/resolved" || fail "spd refuses the manifest's configuration"
grep -q '^peer_listen 0.0.0.0:7341$' "$tmp/resolved" || fail "spd did not take the manifest's peer_listen"
echo "spd reads the manifest's configuration"

echo "--- deploy/Containerfile"
cf=$src/deploy/Containerfile
# The runtime stage: from its FROM to the end.
runtime_stage=$(awk '/^FROM /{n++} n>=2' "$cf")
[ -n "$runtime_stage" ] || fail "the Containerfile has no runtime stage"
installed=" $(sed -n '/install -y/,/rm -rf/p' <<< "$runtime_stage" | tr '\\\n' '  ' | tr -s ' ') "
map=$(sed -n 's/^# runtime-libraries: //p' "$cf")
[ -n "$map" ] || fail "no '# runtime-libraries:' line in the Containerfile"
for pair in $map; do
  [[ $installed == *" ${pair#*=} "* ]] || fail "${pair#*=} (for ${pair%%=*}) is listed but the runtime stage does not install it"
done
# The libraries each program names itself (DT_NEEDED), and NCCL, which spd loads.
needed=$(for b in "$spd" "$spctl" "$build/client/libspclient.so.0"; do
           readelf -d "$b" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'
         done | sort -u)
for n in $needed libnccl.so.2; do
  case "$n" in
    libc.so*|libm.so*|libpthread*|libdl.so*|librt.so*|ld-linux*|libgcc_s*|libstdc++*|libspclient*) continue ;;
    libasan*|libubsan*|libtsan*) continue ;;   # a sanitizer build's runtime: not what the image ships
  esac
  [[ " $map " == *" $n="* ]] || fail "$n, which the programs need, has no package in '# runtime-libraries:'"
  echo "  $n <- $(sed -n "s/.* $n=\([^ ]*\).*/\1/p" <<< " $map ")"
done
setup_pkgs=$(sed -n '/^pkgs=(/,/)/p' "$src/tools/setup" | tr -d '()' | sed 's/pkgs=//')
build_pkgs=$(sed -n '/^FROM .* AS build/,/^FROM /p' "$cf" | sed -n '/install -y/,/rm -rf/p' |
             tr '\\' ' ' | tr -s ' ' '\n' | grep -E '^[a-z0-9][a-z0-9.+-]+$' |
             grep -vE '^(apt-get|install|rm|update|debian_frontend|noninteractive|var|lib|apt|lists)$' || true)
[ -n "$build_pkgs" ] || fail "no packages found in the build stage"
for p in $build_pkgs; do
  case "$p" in
    libc6-dev|ninja-build|pkg-config|gcc|cmake) continue ;;
    libnccl-dev) continue ;;   # NVIDIA's CUDA repository, which the devel image carries
  esac
  echo " $setup_pkgs " | tr -s ' \n' ' ' | grep -q " $p " || fail "the Containerfile builds with $p, which tools/setup does not install"
done
for path in $(sed -n 's/^COPY \([^-][^ ]*\) .*/\1/p' "$cf"); do
  [ -e "$src/$path" ] || fail "the Containerfile copies $path, which does not exist"
done
echo "runtime packages cover every library; build packages and copied paths exist"

echo "--- cmake --install"
cmake --install "$build" --prefix "$tmp/prefix" > /dev/null
# Outputs are taken whole before they are searched: with pipefail, `grep -q`
# leaving a pipe early fails the writer (SIGPIPE) and then the pipeline.
out=$("$tmp/prefix/bin/spd" --version) && [[ $out == "spd "* ]] || fail "the installed spd does not run"
"$tmp/prefix/bin/spctl" --help > /dev/null 2>&1 || [ $? -eq 2 ] || fail "the installed spctl does not run"
out=$(ldd "$tmp/prefix/bin/spctl")
[[ $out == *"$tmp/prefix/bin/../lib/libspclient.so.0"* ]] || fail "the installed spctl does not load the installed libspclient"
# A sanitizer build of the library needs its runtime loaded first (as tests/python/run.sh does).
preload=$(ldd "$tmp/prefix/lib/libspclient.so.0" | awk '/libasan/ {print $3}')
( cd / && env -u SPCLIENT_LIB ${preload:+LD_PRELOAD=$preload ASAN_OPTIONS=detect_leaks=0} /usr/bin/python3 -c "
import sys; sys.path.insert(0, '$tmp/prefix/lib/python3/dist-packages')
import spclient._lib as l
assert l.path.startswith('$tmp/prefix/'), l.path
print('python binding loads', l.path.replace('$tmp', '<prefix>'))" ) || fail "the installed binding does not find the installed library"
[ -f "$tmp/prefix/lib/systemd/system/spd.service" ] && [ -f "$tmp/prefix/share/spd/spd.conf" ] || fail "unit or config not installed"
echo "deploy: ok"
