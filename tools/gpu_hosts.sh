#!/usr/bin/env bash
# Two "hosts" on one GPU machine: the multi-host start of jaxep (jaxep.launch --nnodes 2, the node
# layout from the machine, the network findings, NVSHMEM's bootstrap pinned to the interface that
# reaches JAX's coordinator), run for real on the lent one-GPU H200 (docs/performance.md §14).
# Needs root and unshare(1). From the repository root on the GPU machine, after a build
# (`STEPS=build bash tools/gpu_next.sh`):  OUT=/some/dir bash tools/gpu_hosts.sh
#   doctor  python -m jaxep.doctor --nodes 2, plain and with NVSHMEM_IB_ENABLE_IBGDA=1 (the real
#           driver's dma-buf answer, its registry keys)
#   a       node 1's launcher in a mount namespace with another kernel boot id: two hosts for
#           jaxep, one for NVSHMEM (it hashes the hostname), so P2P reaches every PE. 2 x 2 ranks
#           of tests/gpu/multirank_worker.py, every case bitwise; expect rc 0 twice
#   b       node 1's launcher under another hostname ("localhost", which resolves): two hosts for
#           NVSHMEM too, whose P2P then refuses the other "host" and which has no network
#           transport here. Expect every rank to fail in NVSHMEM's init, within seconds, with
#           jaxep's network findings in its error
#   c       one host, NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME==nosuch0: expect a fast failure naming it
#   one     tests/gpu/test_multirank.py -k "2-default": the one-host start, unchanged
# Every rank shares the GPU through one MPS daemon started here (jaxep.launch's --share-gpu does
# not combine with --nnodes).
set -uo pipefail
R=${OUT:-/tmp/jaxep_hosts}; mkdir -p "$R"
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$R/steps.txt"; }
python3 -m jaxep.doctor --nodes 2 > "$R/doctor_nodes2.txt" 2>&1; echo "rc=$?" >> "$R/doctor_nodes2.txt"
NVSHMEM_IB_ENABLE_IBGDA=1 python3 -m jaxep.doctor --nodes 2 > "$R/doctor_ibgda.txt" 2>&1
echo "rc=$?" >> "$R/doctor_ibgda.txt"; t doctor
IP=$(python3 -c "
import psutil, socket
print(next(a.address for n, v in psutil.net_if_addrs().items() for a in v
           if a.family == socket.AF_INET and not a.address.startswith('127.')))")
export CUDA_MPS_PIPE_DIRECTORY=/tmp/jaxep_hosts_mps CUDA_MPS_LOG_DIRECTORY=/tmp/jaxep_hosts_mpslog
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"; nvidia-cuda-mps-control -d; sleep 1
port() { python3 -c "import socket; s=socket.socket(); s.bind(('',0)); print(s.getsockname()[1])"; }
W="tests/gpu/multirank_worker.py --case all --timeout_s 30"
BOOT=/tmp/jaxep_hosts_boot_id; echo "0b0b0b0b-1111-2222-3333-444455556666" > $BOOT
ID=/proc/sys/kernel/random/boot_id
# pair NAME NODE1_SHELL: both launchers (2 ranks each, 4 on the one GPU); node 1's command line
# runs inside `sh -c "NODE1_SHELL"`, whose "$L" is its launcher
pair() {
  local name=$1 node1=$2 P
  P=$(port)
  export L="python3 -m jaxep.launch --nnodes 2 --nproc 2 --coordinator $IP:$P --timeout 150 --node_rank"
  ( timeout 180 $L 0 $W > "$R/${name}_node0.txt" 2>&1; echo "rc=$?" >> "$R/${name}_node0.txt" ) &
  timeout 180 sh -c "$node1" > "$R/${name}_node1.txt" 2>&1; echo "rc=$?" >> "$R/${name}_node1.txt"
  wait
  t "($name) node 0 $(tail -1 "$R/${name}_node0.txt"), node 1 $(tail -1 "$R/${name}_node1.txt")"
}
wanted() { [[ " ${STEPS:-a b c one} " == *" $1 "* ]]; }
export W XLA_PYTHON_CLIENT_MEM_FRACTION=0.18 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 \
  NVSHMEM_DISABLE_NCCL=1 JAXEP_LOG_LEVEL=INFO
wanted a && CUDA_VISIBLE_DEVICES=0,0 pair a \
  "unshare -m sh -c 'mount --bind $BOOT $ID && cat $ID && exec \$L 1 \$W'"
wanted b && CUDA_VISIBLE_DEVICES=0,0 pair b \
  "unshare -u sh -c 'hostname localhost && hostname && exec \$L 1 \$W'"
if wanted c; then
  NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME==nosuch0 timeout 130 python3 -m jaxep.launch --nproc 2 \
    --share-gpu --timeout 110 $W > "$R/c_badif.txt" 2>&1; echo "rc=$?" >> "$R/c_badif.txt"
  t "(c) $(tail -1 "$R/c_badif.txt")"
fi
if wanted one; then
  timeout 200 python3 -m pytest -q tests/gpu/test_multirank.py -k "2-default" > "$R/one.txt" 2>&1
  echo "rc=$?" >> "$R/one.txt"; t "(one) $(tail -2 "$R/one.txt" | head -1)"
fi
echo quit | nvidia-cuda-mps-control
# one archive of every log (the device tool brings back only a few files per call)
( cd "$R" && tar czf hosts_logs.tar.gz ./*.txt && rm -f ./*_node?.txt c_badif.txt one.txt doctor_*.txt )
echo "=== gpu_hosts"; cat "$R/steps.txt"
for f in a_node0 a_node1 b_node0 b_node1 c_badif; do
  echo "--- $f"
  tar xzf "$R/hosts_logs.tar.gz" -O "./$f.txt" 2>/dev/null \
    | grep -E "LAYOUT|SUMMARY|bootstrap set|GPUDirect|jaxep.initialize|not accessible|rc=" \
    | cut -c1-600 | head -12
done
