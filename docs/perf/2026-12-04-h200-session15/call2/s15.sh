#!/usr/bin/env bash
# Session 15, one device call: build; the doctor's new findings on a real driver; two emulated
# hosts on the one GPU (a) jaxep sees 2 hosts (boot id), NVSHMEM one: must pass bitwise, with the
# bootstrap pinned to the coordinator's interface; (b) NVSHMEM sees 2 hosts too (hostname): its
# init must fail, bounded, with jaxep's network findings in the message; (c) a bad bootstrap
# interface name on one host: bounded?
set -uo pipefail
R=$OUT
export PIP_BREAK_SYSTEM_PACKAGES=1 NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
T0=$(date +%s); t() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a $R/steps.txt; }
( id -u; command -v unshare mount hostname; hostname; cat /proc/sys/kernel/random/boot_id ) > $R/env.txt 2>&1
OUT=$R/gn STEPS="build" BUDGET=200 bash tools/gpu_next.sh > $R/build.txt 2>&1; t "build rc=$?"
python3 -c "import jaxep._ffi as f; print(f.is_available(), f.build_info())" >> $R/build.txt 2>&1
python3 -m jaxep.doctor --nodes 2 > $R/doctor_nodes2.txt 2>&1; echo "rc=$?" >> $R/doctor_nodes2.txt
NVSHMEM_IB_ENABLE_IBGDA=1 python3 -m jaxep.doctor --nodes 2 > $R/doctor_ibgda.txt 2>&1; echo "rc=$?" >> $R/doctor_ibgda.txt
python3 -m jaxep.doctor --json > $R/doctor.json 2>/dev/null; t doctor
IP=$(python3 -c "
import psutil, socket
print(next(a.address for n, v in psutil.net_if_addrs().items() for a in v
           if a.family == socket.AF_INET and not a.address.startswith('127.')))")
python3 -c "from jaxep import topology; print(topology.route_interface('$IP:1'), topology.route_interface('127.0.0.1:1'))" > $R/route.txt 2>&1
cat $R/route.txt
# MPS for the emulated hosts (jaxep.launch --share-gpu cannot be combined with --nnodes)
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog; nvidia-cuda-mps-control -d; sleep 1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.18 CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 NVSHMEM_DISABLE_NCCL=1 \
  CUDA_VISIBLE_DEVICES=0,0 JAXEP_LOG_LEVEL=INFO
port() { python3 -c "import socket; s=socket.socket(); s.bind(('',0)); print(s.getsockname()[1])"; }
W="tests/gpu/multirank_worker.py --case all --timeout_s 30"
echo "0b0b0b0b-1111-2222-3333-444455556666" > /tmp/bootB
A=0; B=0
unshare -m bash -c "mount --bind /tmp/bootB /proc/sys/kernel/random/boot_id && cat /proc/sys/kernel/random/boot_id" 2>&1 | grep -q 0b0b0b0b && A=1
unshare -u bash -c "hostname nodeb && hostname" 2>&1 | grep -q nodeb && B=1
t "namespaces: boot id A=$A hostname B=$B"
# (a) 2 hosts for jaxep (node 1 under another boot id), one host for NVSHMEM
if [ $A = 1 ]; then
P=$(port); L="python3 -m jaxep.launch --nnodes 2 --nproc 2 --coordinator $IP:$P --timeout 150"
( timeout 180 $L --node_rank 0 $W > $R/a_node0.txt 2>&1; echo "rc=$?" >> $R/a_node0.txt ) &
timeout 180 unshare -m bash -c "mount --bind /tmp/bootB /proc/sys/kernel/random/boot_id && cat /proc/sys/kernel/random/boot_id && exec $L --node_rank 1 $W" > $R/a_node1.txt 2>&1; echo "rc=$?" >> $R/a_node1.txt
wait; t "(a) $(tail -1 $R/a_node0.txt) $(tail -1 $R/a_node1.txt)"
fi
# (b) 2 hosts for NVSHMEM too: node 1 under another hostname
if [ $B = 1 ]; then
P=$(port)
L="python3 -m jaxep.launch --nnodes 2 --nproc 2 --coordinator $IP:$P --timeout 150"
( timeout 180 $L --node_rank 0 $W > $R/b_node0.txt 2>&1; echo "rc=$?" >> $R/b_node0.txt ) &
timeout 180 unshare -u bash -c "hostname nodeb && exec $L --node_rank 1 $W" > $R/b_node1.txt 2>&1; echo "rc=$?" >> $R/b_node1.txt
wait; t "(b) $(tail -1 $R/b_node0.txt) $(tail -1 $R/b_node1.txt)"
fi
# (c) one host, an interface name that does not exist
unset CUDA_VISIBLE_DEVICES
NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME==nosuch0 timeout 130 python3 -m jaxep.launch --nproc 2 --share-gpu --timeout 110 $W > $R/c_badif.txt 2>&1; echo "rc=$?" >> $R/c_badif.txt
t "(c) $(tail -1 $R/c_badif.txt)"
echo quit | nvidia-cuda-mps-control
echo "=== summary"; cat $R/steps.txt
for f in a_node0 a_node1 b_node0 b_node1 c_badif; do
  echo "--- $f"; grep -E "LAYOUT|SUMMARY|bootstrap|GPUDirect|jaxep network|Error|error|not accessible|FAIL|rc=" $R/$f.txt | cut -c1-400 | head -25
done
