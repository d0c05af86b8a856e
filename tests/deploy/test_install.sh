#!/usr/bin/env bash
# What `cmake --install` and `cpack -G DEB` give, used as a user would use
# them, with nothing of the source or build trees:
#   - `cmake --install --prefix` into a scratch directory, and (where dpkg-deb
#     is) the Debian packages cpack makes, unpacked with dpkg -x into a scratch
#     root: the files where they belong, the packages' dependencies and
#     maintainer scripts;
#   - in each, installed_allreduce.c built through pkg-config (with the shared
#     library, and with the static one) and through find_package(spclient),
#     each run against the installed spd: 2 ranks all-reduce and check the sums; the Python binding loads the installed
#     library and talks to that spd.
# Usage: test_install.sh SOURCE_DIR BUILD_DIR INSTALL_PREFIX LIBDIR HELP2MAN
set -euo pipefail
src=$1 build=$2 prefix=$3 libdir=$4 help2man=$5
tmp=$(mktemp -d)
spd_pid=
cleanup() {
  [ -z "$spd_pid" ] || kill -9 "$spd_pid" 2> /dev/null || true
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

# A sanitizer build's library needs its runtime loaded first in programs that
# are not themselves built with it.
runtime=$(ldd "$build/client/libspclient.so.0" | awk '/lib(a|t)san/ {print $3}')
sanitized() { env ${runtime:+LD_PRELOAD=$runtime ASAN_OPTIONS=detect_leaks=0} "$@"; }

# check_tree ROOT: the installed tree at ROOT (a prefix) holds every part.
check_tree() {
  local root=$1
  for f in bin/spd bin/spctl "$libdir/libspclient.so.0" "$libdir/libspclient.so" "$libdir/libspclient.a" \
           include/spclient/spclient.h include/spclient/status.h "$libdir/pkgconfig/spclient.pc" \
           "$libdir/cmake/spclient/spclientConfig.cmake" "$libdir/cmake/spclient/spclientConfigVersion.cmake" \
           "$libdir/cmake/spclient/spclientTargets.cmake" lib/systemd/system/spd.service share/spd/spd.conf \
           lib/python3/dist-packages/spclient/__init__.py; do
    [ -e "$root/$f" ] || fail "$f is not installed"
  done
  if [ "$help2man" != "${help2man%NOTFOUND}" ]; then
    echo "  (no man pages: help2man was not found when the build was configured)"
  else
    for m in spd spctl; do
      [ -s "$root/share/man/man8/$m.8" ] || fail "$m(8) is not installed"
      grep -q "^\.TH ${m^^} \"8\"" "$root/share/man/man8/$m.8" || fail "$m.8 is not a section 8 page"
    done
    grep -q '^\\fBop_timeout_ms\\fR 60000$' "$root/share/man/man8/spd.8" || fail "spd(8) lacks the option table"
    grep -q '^\\fBtop\\fR\|^  top\|top \[JOB_ID\]' "$root/share/man/man8/spctl.8" || fail "spctl(8) lacks top"
  fi
}

# start_spd ROOT: the installed spd, on a socket of its own.
start_spd() {
  local root=$1
  mkdir -p "$tmp/run"
  export SPC_SOCKET=$tmp/run/spd.sock
  NOTIFY_SOCKET= "$root/bin/spd" --set "socket=$SPC_SOCKET" --set "log_file=$tmp/spd.log" &
  spd_pid=$!
  for _ in $(seq 200); do
    "$root/bin/spctl" status > /dev/null 2>&1 && return 0
    kill -0 "$spd_pid" 2> /dev/null || break
    sleep 0.05
  done
  cat "$tmp/spd.log" >&2 || true
  fail "the installed spd did not start"
}

stop_spd() {
  kill -TERM "$spd_pid"
  wait "$spd_pid" || fail "spd did not exit 0 on SIGTERM"
  spd_pid=
}

# build_and_run ROOT LABEL: installed_allreduce.c built against ROOT, both ways, and run.
build_and_run() {
  local root=$1 label=$2 out flags
  local b=$tmp/$label
  mkdir -p "$b/cmake"
  cp "$src/tests/deploy/installed_allreduce.c" "$b/"

  flags=$(PKG_CONFIG_PATH= PKG_CONFIG_LIBDIR="$root/$libdir/pkgconfig" pkg-config --cflags --libs spclient)
  [[ $flags != *"$src"* && $flags != *"$build"* ]] || fail "spclient.pc points into the source or build tree: $flags"
  [[ $flags == *"-I$root/"* || $flags == *"-I$(realpath "$root")/"* ]] || fail "spclient.pc's flags are not under $root: $flags"
  # shellcheck disable=SC2086
  cc -o "$b/allreduce-pc" "$b/installed_allreduce.c" $flags || fail "cc with pkg-config's flags failed"
  # Static: libspclient.a with what pkg-config --static adds, and nothing of spd's tree
  # (not in a sanitizer build, whose archive needs the sanitizers' runtimes linked too).
  if [ -z "$runtime" ]; then
    flags=$(PKG_CONFIG_PATH= PKG_CONFIG_LIBDIR="$root/$libdir/pkgconfig" pkg-config --static --cflags --libs spclient)
    # shellcheck disable=SC2086
    cc -o "$b/allreduce-static" "$b/installed_allreduce.c" ${flags/-lspclient /-l:libspclient.a } ||
      fail "cc with pkg-config --static's flags failed"
    out=$(ldd "$b/allreduce-static")
    [[ $out != *libspclient* ]] || fail "the static program loads libspclient: $out"
  fi

  cat > "$b/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.20)
project(installed_allreduce C)
find_package(spclient 0.1 REQUIRED)
add_executable(allreduce-cmake installed_allreduce.c)
target_link_libraries(allreduce-cmake PRIVATE spclient::spclient)
CMAKE
  cmake -S "$b" -B "$b/cmake" -G Ninja -DCMAKE_PREFIX_PATH="$root" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF \
        -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF > "$b/cmake.log" 2>&1 || { cat "$b/cmake.log"; fail "find_package(spclient) failed"; }
  dir=$(sed -n 's/^spclient_DIR:PATH=//p' "$b/cmake/CMakeCache.txt")
  [[ $(realpath "$dir") == $(realpath "$root")/* ]] || fail "find_package found spclient in $dir, not under $root"
  cmake --build "$b/cmake" > "$b/build.log" 2>&1 || { cat "$b/build.log"; fail "building against spclient::spclient failed"; }

  start_spd "$root"
  out=$(sanitized env LD_LIBRARY_PATH="$root/$libdir" ldd "$b/allreduce-pc")
  [[ $out == *"$root/$libdir/libspclient.so.0"* ]] || fail "the pkg-config program does not load the installed library: $out"
  out=$(sanitized env LD_LIBRARY_PATH="$root/$libdir" "$b/allreduce-pc") || fail "the pkg-config program failed: $out"
  echo "  pkg-config:   $out"
  if [ -z "$runtime" ]; then
    out=$("$b/allreduce-static") || fail "the program linked with libspclient.a failed: $out"
    echo "  static:       $out"
  fi
  out=$(sanitized "$b/cmake/allreduce-cmake") || fail "the find_package program failed: $out"
  echo "  find_package: $out"
  # The binding finds the library beside it and talks to spd: a job it creates is listed.
  out=$(cd / && sanitized env -u SPCLIENT_LIB PYTHONPATH="$root/lib/python3/dist-packages" \
        LD_LIBRARY_PATH="$root/$libdir" /usr/bin/python3 -c "
import spclient
# The library mapped, however the binding named it (a path beside it, or the soname).
lib = {l.split()[-1] for l in open('/proc/self/maps') if 'libspclient' in l}
assert len(lib) == 1 and lib.pop().startswith('$(realpath "$root")/'), open('/proc/self/maps').read()
h = spclient.attach()
job = h.job_create()
assert [j['id'] for j in h.query('jobs')] == [job], h.query('jobs')
h.close()
print('python binding: loads the installed library and lists its job')") ||
    fail "the installed Python binding failed: $out"
  echo "  $out"
  stop_spd
}

echo "--- cmake --install --prefix"
cmake --install "$build" --prefix "$tmp/prefix" > /dev/null
check_tree "$tmp/prefix"
build_and_run "$tmp/prefix" prefix

echo "--- cpack -G DEB, dpkg -x"
if ! command -v dpkg-deb > /dev/null; then
  echo "  (no dpkg-deb: the Debian packages are not made)"
  exit 0
fi
cpack -G DEB --config "$build/CPackConfig.cmake" -B "$tmp/debs" > "$tmp/cpack.log" 2>&1 || { cat "$tmp/cpack.log"; fail "cpack -G DEB failed"; }
ver=$(sed -n 's/^set(CPACK_PACKAGE_VERSION "\(.*\)")$/\1/p' "$build/CPackConfig.cmake")
for p in spd libspclient0 libspclient-dev python3-spclient; do
  deb=$(ls "$tmp/debs/${p}_${ver}-1_"*.deb 2> /dev/null) || fail "no package $p"
  dpkg -x "$deb" "$tmp/root"
  dpkg-deb -e "$deb" "$tmp/control-$p"
done
deps() { dpkg-deb -f "$tmp/debs/$1_${ver}-1_"*.deb Depends; }
[[ $(deps spd) == *"libspclient0 (= $ver-1)"* && $(deps spd) == *adduser* && $(deps spd) == *libuv1* ]] ||
  fail "spd's dependencies: $(deps spd)"
[[ $(deps libspclient-dev) == *"libspclient0 (= $ver-1)"* ]] || fail "libspclient-dev's dependencies: $(deps libspclient-dev)"
[[ $(deps python3-spclient) == *"libspclient0 (= $ver-1)"* && $(deps python3-spclient) == *python3-numpy* ]] ||
  fail "python3-spclient's dependencies: $(deps python3-spclient)"
[ "$(dpkg-deb -f "$tmp/debs/python3-spclient_${ver}-1_all.deb" Architecture)" = all ] || fail "the binding is not Architecture: all"
# Each package holds its own part only.
[ -z "$(dpkg-deb -c "$tmp/debs/libspclient0_${ver}-1_"*.deb | grep -E 'include/|\.pc$|\.a$|bin/')" ] ||
  fail "libspclient0 holds development files or programs"
post=$tmp/control-spd/postinst
[ -x "$post" ] && sh -n "$post" && grep -q '^ *adduser --system --group .*spd$' "$post" ||
  fail "spd's postinst does not create the system user and group"
for s in prerm postrm; do [ -x "$tmp/control-spd/$s" ] && sh -n "$tmp/control-spd/$s" || fail "spd's $s"; done
# The maintainer scripts, run as dpkg runs them, in a mount namespace of their own
# where /etc is a copy (the machine's stays as it was) and the systemd helpers
# only say what they were asked. Only the path of the packaged config differs:
# it is read from the unpacked root.
if [ "$(id -u)" = 0 ] && unshare -m true 2> /dev/null; then
  mkdir -p "$tmp/etc" "$tmp/stubs"
  cp -a /etc/. "$tmp/etc/"
  for s in deb-systemd-helper deb-systemd-invoke systemctl; do
    printf '#!/bin/sh\necho "%s $*" >> "%s/calls"\n' "$s" "$tmp" > "$tmp/stubs/$s"
    chmod +x "$tmp/stubs/$s"
  done
  shipped=$tmp/root$prefix/share/spd/spd.conf
  for s in postinst postrm; do
    sed "s#$prefix/share/spd/spd.conf#$shipped#" "$tmp/control-spd/$s" > "$tmp/$s"
  done
  as_dpkg() { unshare -m sh -c 'mount --bind "$1" /etc && shift && PATH="$0:$PATH" exec sh "$@"' \
                "$tmp/stubs" "$tmp/etc" "$@" > /dev/null || fail "$* failed"; }
  as_dpkg "$tmp/postinst" configure
  group=$(grep '^spd:' "$tmp/etc/group") || fail "postinst created no group spd"
  gid=$(echo "$group" | cut -d: -f3)
  [ "$gid" -lt 1000 ] || fail "spd is not a system group: $group"
  user=$(grep '^spd:' "$tmp/etc/passwd") || fail "postinst created no user spd"
  [ "$(echo "$user" | cut -d: -f3)" -lt 1000 ] && [ "$(echo "$user" | cut -d: -f4)" = "$gid" ] ||
    fail "spd is not a system user in the group spd: $user"
  [[ ,$(echo "$group" | cut -d: -f4), == *,root,* ]] || fail "root is not in the group spd: $group"
  diff <(sed 's/^allow_group ""$/allow_group spd/' "$shipped") "$tmp/etc/spd/spd.conf" > /dev/null &&
    ! cmp -s "$shipped" "$tmp/etc/spd/spd.conf" || fail "/etc/spd/spd.conf is not the defaults with allow_group spd"
  grep -q '^deb-systemd-helper \(enable\|update-state\) spd.service$' "$tmp/calls" || fail "the unit was not enabled"
  # An upgrade keeps the group and an edited config.
  echo "log_level debug" >> "$tmp/etc/spd/spd.conf"
  as_dpkg "$tmp/postinst" configure "$ver-1"
  [ "$(grep '^spd:' "$tmp/etc/group")" = "$group" ] && [ "$(grep '^spd:' "$tmp/etc/passwd")" = "$user" ] &&
    grep -q '^log_level debug$' "$tmp/etc/spd/spd.conf" || fail "an upgrade changed the user, the group or the edited config"
  as_dpkg "$tmp/postrm" purge
  [ ! -e "$tmp/etc/spd" ] && grep -q '^deb-systemd-helper purge spd.service$' "$tmp/calls" ||
    fail "a purge left /etc/spd or the unit's state"
  echo "  maintainer scripts: system user and group spd (gid $gid), /etc/spd/spd.conf, the unit enabled; purged"
else
  echo "  (maintainer scripts not run: that needs root and a mount namespace)"
fi
# The unit starts the packaged spd.
unit=$tmp/root$prefix/lib/systemd/system/spd.service
exe=$(sed -n 's/^ExecStart=\([^ ]*\) .*/\1/p' "$unit")
[ "$exe" = "$prefix/bin/spd" ] && [ -x "$tmp/root$exe" ] || fail "the packaged unit runs '$exe', not the packaged spd"
# The binding lies in Debian's dist-packages under the prefix.
[ -f "$tmp/root$prefix/lib/python3/dist-packages/spclient/__init__.py" ] || fail "the binding is not in dist-packages"
echo "  $(ls "$tmp/debs" | grep -c '\.deb$') packages: $(ls "$tmp/debs" | grep '\.deb$' | tr '\n' ' ')"
check_tree "$tmp/root$prefix"
build_and_run "$tmp/root$prefix" root
echo "install: ok"
