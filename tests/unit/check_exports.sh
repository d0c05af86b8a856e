#!/bin/sh
# libspclient.so exports the public API and nothing else: every defined dynamic
# symbol is spc_* (or the version node), and the API is there.
lib="$1"
bad=$(nm -D --defined-only "$lib" | awk '{print $3}' | grep -v -e '^spc_' -e '^SPCLIENT_0$')
if [ -n "$bad" ]; then
  echo "FAIL: libspclient exports symbols outside spc_*:"; echo "$bad"; exit 1
fi
for sym in spc_attach spc_submit spc_wait spc_allreduce spc_status_name spc_query spc_register_device; do
  nm -D --defined-only "$lib" | grep -q " $sym@" || { echo "FAIL: $sym is not exported"; exit 1; }
done
echo "exports: $(nm -D --defined-only "$lib" | grep -c ' spc_') spc_* symbols, nothing else"
