#!/usr/bin/env bash
# Packs what the GPU machine needs into .devrun/ (ignored by git): a CUDA build
# for Hopper, the shared libraries it links that the machine lacks (it has no
# Debian -dev packages), UCX's transport modules, and run.sh, which runs the GPU
# tests (test_device_ops: ops on device regions through a real spd;
# test_register_vmm: the same on cuMem memory; test_stream_order: ops ordered
# on the ranks' CUDA streams; test_gpu_lanes: spd's lanes each on a hardware
# queue of its own, one stalled; test_restart_gpu: spd killed and started again
# under ranks whose ops run on GPU memory, test_restart_stream_gpu under ranks
# with CUDA streams open and ops queued on them; test_multigpu: one rank per GPU, where there are
# several; test_nccl_nodes: ops across two daemons through
# NCCL, which spd loads from the machine's own libnccl.so.2; test_nccl_gpus:
# the same with a rank on each of two GPUs per daemon, where there are two; the Python
# binding's ops on CUDA tensors, tests/python/test_cuda.py, with the python3
# that holds torch there), the GPU kernel benchmark beside the torch path, the
# tiny training example on the GPU, the all-to-all and the small allreduce
# through spd from 2, 4 and 8 processes on the GPU (spbench-gpu-procs), the
# communication the compute hides (spbench_overlap.py), one attention layer up
# to S = 128k (client/examples/long_context.py), spd's view of the node, the
# tests across daemons and spbench --nodes 2. The binding loads
# .devrun/lib/libspclient.so.0 (SPCLIENT_LIB; else by soname through
# LD_LIBRARY_PATH).
#
#   tests/gpu/pack-for-device.sh            # here; then, on the device machine,
#   bash .devrun/run.sh                     # from the checkout's root, with .devrun carried
#   bash .devrun/run.sh tests               # the GPU tests alone
#   bash .devrun/run.sh procs               # spbench-gpu-procs alone
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
cmake -S . -B build-gpu -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build-gpu
rm -rf .devrun && mkdir -p .devrun/bin .devrun/lib
grep -qx '/.devrun/' "$(git rev-parse --git-dir)/info/exclude" 2>/dev/null || {
  mkdir -p "$(git rev-parse --git-dir)/info" && echo /.devrun/ >> "$(git rev-parse --git-dir)/info/exclude"; }
cp build-gpu/daemon/spd build-gpu/client/spctl build-gpu/tests/bench/spbench build-gpu/tests/test_reduce_gpu \
   build-gpu/tests/test_kernels_gpu build-gpu/tests/test_device_ops build-gpu/tests/test_register_device \
   build-gpu/tests/test_stream_order build-gpu/tests/test_register_vmm build-gpu/tests/test_multigpu \
   build-gpu/tests/test_nccl_nodes build-gpu/tests/test_nccl_gpus build-gpu/tests/test_nccl_absent \
   build-gpu/tests/test_restart_gpu \
   build-gpu/tests/test_restart_stream_gpu build-gpu/tests/test_gpu_lanes \
   build-gpu/tests/bench/spbench-gpu build-gpu/tests/bench/spbench-gpu-procs \
   build-gpu/tests/test_nodes build-gpu/tests/test_alltoall build-gpu/tests/test_spctl_topo .devrun/bin/
cp -L build-gpu/client/libspclient.so.0 .devrun/lib/
cp tests/bench/spbench_gpu_torch.py .devrun/
for b in .devrun/bin/*; do ldd "$b"; done | awk '/=> \//{print $3}' | sort -u |
  grep -vE 'libc\.so|libm\.so|libpthread|libdl|ld-linux|libcuda\.so|libstdc\+\+|libgcc_s' | xargs -I{} cp -L {} .devrun/lib/
cp -rL /usr/lib/x86_64-linux-gnu/ucx .devrun/lib/ucx
strip .devrun/bin/* .devrun/lib/*.so* 2>/dev/null || true
cat > .devrun/run.sh <<RUN
#!/bin/bash
here=\$(pwd)
export LD_LIBRARY_PATH=\$here/.devrun/lib:\${LD_LIBRARY_PATH:-} UCX_MODULE_DIR=\$here/.devrun/lib/ucx
# The test programs start spd and spctl by the paths of this build: put them there.
mkdir -p $root/build-gpu/daemon $root/build-gpu/client
ln -sf \$here/.devrun/bin/spd $root/build-gpu/daemon/spd
ln -sf \$here/.devrun/bin/spctl $root/build-gpu/client/spctl
# Each step is bounded: device time is scarce, and one hung test must not eat
# the steps after it. A step's rc 124 means it ran out its bound.
step() { local name=\$1 secs=\$2; shift 2; local t0=\$SECONDS
  echo "=== \$name"; timeout -k 5 "\$secs" "\$@"; local rc=\$?
  echo "=== \$name: rc=\$rc in \$((SECONDS - t0)) s"; }
nvidia-smi -L
if [ "\${1:-}" != procs ]; then
step test_reduce_gpu 60 .devrun/bin/test_reduce_gpu
step test_kernels_gpu 60 .devrun/bin/test_kernels_gpu
step test_register_device 60 .devrun/bin/test_register_device
step test_device_ops 90 .devrun/bin/test_device_ops
step test_stream_order 90 .devrun/bin/test_stream_order
step test_register_vmm 60 .devrun/bin/test_register_vmm
step test_restart_gpu 60 .devrun/bin/test_restart_gpu
step test_gpu_lanes 60 .devrun/bin/test_gpu_lanes
step test_restart_stream_gpu 60 .devrun/bin/test_restart_stream_gpu
# One rank per GPU: skipped (77, saying so) where the machine has one GPU.
step test_multigpu 120 .devrun/bin/test_multigpu
step test_nccl_nodes 90 .devrun/bin/test_nccl_nodes
step test_nccl_gpus 120 .devrun/bin/test_nccl_gpus
step test_nccl_absent 30 .devrun/bin/test_nccl_absent
# The binding on CUDA tensors: pytest with the python3 that holds torch; -s
# shows whether the ops ran in stream order or host-synchronously.
SP_PYTHON=\$(command -v python3) step python_cuda 240 bash tests/python/run.sh .devrun/bin/spd \\
  .devrun/lib/libspclient.so.0 cuda -s --durations=0
[ "\${1:-}" = tests ] && exit 0
SPCLIENT_LIB=\$here/.devrun/lib/libspclient.so.0 step "train_tiny_sp.py --device cuda" 120 \\
  python3 client/examples/train_tiny_sp.py --spd .devrun/bin/spd --device cuda --steps 5 --png ''
step spbench-gpu 60 .devrun/bin/spbench-gpu
step spbench_gpu_torch.py 60 python3 .devrun/spbench_gpu_torch.py
fi
# spd from P = 2, 4, 8 rank processes on this GPU, host-synchronous and stream
# ordered; the JSON lines go to \$OUT too when it names a folder to bring back.
for b in alltoall latency; do
  step "spbench-gpu-procs \$b" 120 .devrun/bin/spbench-gpu-procs \$b \${OUT:+--json-file "\$OUT/spbench-gpu-procs-\$b.json"}
done
# One rank on the GPU, as in deployment: the stream-ordered latency without
# other ranks' contexts switching in.
step "spbench-gpu-procs latency --procs 1" 60 .devrun/bin/spbench-gpu-procs latency --procs 1 \\
  \${OUT:+--json-file "\$OUT/spbench-gpu-procs-latency1.json"}
[ "\${1:-}" = procs ] && exit 0
# How much of the ring's K/V rotation and of the async Ulysses all-to-all the
# compute beside them hides (CUDA events), 2 and 4 rank processes.
SPCLIENT_LIB=\$here/.devrun/lib/libspclient.so.0 step spbench_overlap.py 120 \\
  python3 tests/bench/spbench_overlap.py --spd .devrun/bin/spd \${OUT:+--json-file "\$OUT/spbench-overlap.json"}
# One attention layer up to S = 128k in bf16, SP = 1, 2, 4, each rank capped
# at 16 GB (four share the GPU), beside torch's own attention on the whole
# sequence; the JSON lines go to \$OUT.
SPCLIENT_LIB=\$here/.devrun/lib/libspclient.so.0 step "long_context.py --device cuda" 120 \\
  python3 client/examples/long_context.py --spd .devrun/bin/spd --device cuda --dtype bf16 \\
  --seq 8192,32768,131072 --sp 1,2,4 --mode ring,ulysses --iters 2 --mem-cap 16e9 --point-timeout 40 \\
  \${OUT:+--json-file "\$OUT/long-context.json"}
echo "=== spd on this node"
mkdir -p /tmp/spd-dev; .devrun/bin/spd --set socket=/tmp/spd-dev/spd.sock --set log_file=/tmp/spd-dev/log &
for i in \$(seq 50); do [ -S /tmp/spd-dev/spd.sock ] && break; sleep 0.1; done
.devrun/bin/spctl --socket /tmp/spd-dev/spd.sock status | grep -iE "gpu|transport"
.devrun/bin/spctl --socket /tmp/spd-dev/spd.sock topo
kill %1; wait
for t in "test_spctl_topo" "test_nodes 3" "test_alltoall --nodes 2"; do
  timeout 90 .devrun/bin/\$t > /tmp/spd-dev/t.log 2>&1; echo "=== \$t: rc=\$?"; grep FAIL /tmp/spd-dev/t.log | head -3
done
echo "=== spbench --nodes 2 (no OpenMPI on this machine: spd alone)"
for op in alltoall shift; do timeout 60 .devrun/bin/spbench \$op --nodes 2 --sizes 64K,1M,16M 2>&1 | grep -E "^(alltoall|shift) "; done
RUN
chmod +x .devrun/run.sh
du -sh .devrun
