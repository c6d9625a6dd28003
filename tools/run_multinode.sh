#!/usr/bin/env bash
# Launch pretrain_gpt.py (or $SCRIPT) with torchrun on this node of a multi-node job.
#
# Set on every node:  MASTER_ADDR MASTER_PORT NNODES NODE_RANK GPUS_PER_NODE
# Under SLURM (`srun --ntasks-per-node=1 bash tools/run_multinode.sh ...`) they default to
# the first host of SLURM_JOB_NODELIST, SLURM_NNODES and SLURM_NODEID.
# GPUS_PER_NODE defaults to the visible GPUs, or 1 process per node on a CPU-only machine.
# Remaining arguments go to the training script, e.g. `--tp 4 --pp 2`.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
script="${SCRIPT:-$here/pretrain_gpt.py}"

if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
  MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}"
  NNODES="${NNODES:-${SLURM_NNODES}}"
  NODE_RANK="${NODE_RANK:-${SLURM_NODEID}}"
fi
: "${MASTER_ADDR:?set MASTER_ADDR (the address of node 0)}"
: "${NNODES:?set NNODES (the number of nodes)}"
: "${NODE_RANK:?set NODE_RANK (this node, 0..NNODES-1)}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
  GPUS_PER_NODE="$(python3 -c 'import torch; print(max(torch.cuda.device_count(), 1))')"
fi

exec python3 -m torch.distributed.run \
  --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE" \
  --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
  "$script" "$@"
