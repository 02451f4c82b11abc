#!/usr/bin/env bash
# Every benchmark on a GPU machine, in one go, most important first; each step has
# its own time limit so one failure or overrun never costs the others.
#
#   bash bench/gpu_suite.sh OUTDIR          # e.g. $OUT on the device machine
#
# GPU steps: footprint, setup (cuda backend, workers on GPU 0), agreement (workers
# holding CUDA contexts; on the control page too), abort latency, status round trips. Then, on that machine's many cores,
# the host-backend failure and throughput benchmarks.
OUTDIR=${1:-bench/results}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PYTHON:-python3}
if ! $PY -c "import peerd_client" 2>/dev/null; then  # not installed: map the package dir by hand
  mkdir -p /tmp/peerd-path && ln -sfn "$PWD/client" /tmp/peerd-path/peerd_client
  export PYTHONPATH="$PWD:/tmp/peerd-path${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi -L || true
$PY -c "import torch, peerd_client, zmq; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'zmq', zmq.__version__)"
nproc
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)"; local t0=$SECONDS
  timeout -k 5 "$limit" "$@"; echo "=== rc=$? in $((SECONDS - t0))s"; }
step 40  $PY bench/gpu_footprint.py --out "$OUTDIR"
step 90  $PY bench/setup_latency.py --backend cuda --iters ${SETUP_ITERS:-15} --out "$OUTDIR"
step 70  $PY bench/agree_latency.py --backend cuda --rounds 2000 --sync-rounds 300 --out "$OUTDIR"
step 180 $PY bench/agree_page.py --backend cuda --ranks 2,8 --rounds 100000 --message-rounds 3000 --sync-rounds 1000 --pin --out "$OUTDIR"
step 150 $PY bench/abort_latency.py --backend cuda --ranks 2,4,8 --repeats 5 --out "$OUTDIR"
step 120 $PY bench/allreduce.py --ranks 2,8 --json "$OUTDIR/allreduce.json"
step 25  $PY bench/status_latency.py --backend cuda --cli-iters 5 --out "$OUTDIR"
step 70  $PY bench/failure_latency.py --ranks 8 --repeats 2 --seed-repeats 1 --seed-timeout 5 --out "$OUTDIR"
if [ -n "$RUN_THROUGHPUT" ]; then
  step 90 $PY bench/throughput.py --rss-cycles 0 --votes 6000 --cycles 2000 --seed-votes 2000 --seed-cycles 200 --out "$OUTDIR"
fi
