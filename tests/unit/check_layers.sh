#!/bin/sh
# tools/check-layers passes on this tree, and fails, naming the file and line,
# on an include planted against the layers in a copy of it.
set -u
src="$1"
"$src/tools/check-layers" "$src" || { echo "FAIL: the tree's includes go against its layers"; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
plant() {   # plant FILE LINE: a copy of the tree with LINE added to FILE; prints check-layers' verdict
  rm -rf "$tmp/tree" && mkdir -p "$tmp/tree/client" "$tmp/tree/kernels"
  cp -r "$src/proto" "$src/common" "$src/daemon" "$tmp/tree/"
  cp -r "$src/client/include" "$tmp/tree/client/" && cp -r "$src/kernels/include" "$tmp/tree/kernels/"
  printf '%s\n' "$2" >> "$tmp/tree/$1"
  lines=$(wc -l < "$tmp/tree/$1")
  if out=$("$src/tools/check-layers" "$tmp/tree"); then
    echo "FAIL: $2 in $1 passed"; exit 1
  fi
  echo "$out" | grep -q "^$1:$lines: " || { echo "FAIL: the verdict does not name $1:$lines:"; echo "$out"; exit 1; }
  echo "$out" | head -1
}
plant daemon/core/mem.c '#include "ctl/server.h"'      # the core reaching up to the control plane
plant common/sp_place.c '#include "core/engine.h"'     # the planning library reaching into the daemon
plant daemon/gpu/gpu.c '#include "engine.h"'           # a daemon header without its layer
echo "check-layers: passes here, and fails on each include planted against the layers"
