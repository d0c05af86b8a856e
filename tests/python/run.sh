#!/usr/bin/env bash
# Runs the Python tests (pytest) against the build: ctest passes the spd binary
# and libspclient, and which tests: "host" (the default: every module but
# test_cuda*.py) or "cuda" (ops on CUDA tensors). Exits 77 (skipped, with the
# reason) when Debian's python3 lacks numpy, torch or pytest (tools/setup
# installs them), and when every test selected was skipped (no GPU for the
# cuda ones).
#
#   tests/python/run.sh build/daemon/spd build/client/libspclient.so [host|cuda] [pytest args]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
abs() { case $1 in /*) echo "$1" ;; *) echo "$(pwd)/$1" ;; esac; }
export SPD_BIN=$(abs "$1") SPCLIENT_LIB=$(abs "$2")
which=${3:-host}
shift $(( $# < 3 ? $# : 3 ))
case $which in
  host) select=(--ignore-glob="$here/test_cuda*.py" "$here") ;;
  cuda) select=("$here"/test_cuda*.py) ;;
  *) echo "run.sh: which tests, host or cuda, not '$which'" >&2; exit 2 ;;
esac
py=${SP_PYTHON:-/usr/bin/python3}
if ! "$py" -c 'import numpy, torch, pytest' 2>/dev/null; then
  echo "skipped: $py cannot import numpy, torch and pytest (apt-get install python3-numpy python3-torch python3-pytest)" >&2
  exit 77
fi
# ThreadSanitizer's runtime loads into a running python3 only while static TLS
# is left (torch often takes it first), and preloaded it would check all of Python.
deps=$(ldd "$SPCLIENT_LIB")
if [[ $deps == *libtsan* ]]; then
  echo "skipped: libspclient is built with ThreadSanitizer, which python3 cannot load" >&2
  exit 77
fi
# A sanitizer build of libspclient needs its runtime loaded first; Python itself
# is not built for leak checking. libstdc++ goes in with it: ASan finds the
# real __cxa_throw when it starts, and torch throws C++ exceptions (an op it
# lacks, a failed check) that would otherwise abort the interpreter.
if asan=$(ldd "$SPCLIENT_LIB" | awk '/libasan/ {print $3}') && [ -n "$asan" ]; then
  cxx=$(ldconfig -p | awk '/libstdc\+\+\.so\.6 .*x86-64/ {p = $NF} END {print p}')
  export LD_PRELOAD="$asan${cxx:+:$cxx}${LD_PRELOAD:+:$LD_PRELOAD}" ASAN_OPTIONS=detect_leaks=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}
fi
cd "$here"
export SP_PYTEST_SKIPPED_EXIT=77
[ "$which" = host ] && exec "$py" -m pytest -q -rs -p no:cacheprovider "${select[@]}" "$@"
# Each CUDA module in a pytest of its own: a module that runs CUDA in the
# pytest process (test_cuda_blockwise.py) leaves it unable to fork ranks that
# use the GPU (the driver does not survive a fork once initialised), and the
# next module's ranks would hang. 77 only when every module was skipped.
rc=77
for m in "${select[@]}"; do
  st=0
  "$py" -m pytest -q -rs -p no:cacheprovider "$m" "$@" || st=$?
  if [ $st -ne 77 ] && { [ $rc -eq 77 ] || [ $rc -eq 0 ]; }; then rc=$st; fi
done
exit $rc
