#!/usr/bin/env bash
# Runs the Python tests (pytest) against the build: ctest passes the spd binary
# and libspclient. Exits 77 (skipped, with the reason) when Debian's python3
# lacks numpy, torch or pytest (tools/setup installs them).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export SPD_BIN=$1 SPCLIENT_LIB=$2
py=${SP_PYTHON:-/usr/bin/python3}
if ! "$py" -c 'import numpy, torch, pytest' 2>/dev/null; then
  echo "skipped: $py cannot import numpy, torch and pytest (apt-get install python3-numpy python3-torch python3-pytest)" >&2
  exit 77
fi
# A sanitizer build of libspclient needs its runtime loaded first; Python itself
# is not built for leak checking.
if asan=$(ldd "$SPCLIENT_LIB" | awk '/libasan/ {print $3}') && [ -n "$asan" ]; then
  export LD_PRELOAD="$asan${LD_PRELOAD:+:$LD_PRELOAD}" ASAN_OPTIONS=detect_leaks=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}
fi
cd "$here"
exec "$py" -m pytest -q -p no:cacheprovider "$here"
