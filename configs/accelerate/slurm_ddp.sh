#!/bin/bash
# sbatch --nodes 2 configs/accelerate/slurm_ddp.sh configs/gpu/sd35m_flow_grpo_pickscore.yaml [key=value ...]
# One task per node; each starts accelerate with the node's rank, the first node's address and all GPUs of all nodes.
#SBATCH --job-name=mmrl
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail
# the GPUs SLURM gave each node (sbatch --gpus-per-node=N overrides the line above), else 8
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
MAIN_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # sed reads all: no SIGPIPE under pipefail
# ACCELERATE_CONFIG picks another engine's file (fsdp2.yaml, deepspeed_zero2.yaml, deepspeed_zero3.yaml): the
# flags below override its single-machine counts
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-configs/accelerate/ddp_multi_node.yaml}
srun bash -c "accelerate launch --config_file $ACCELERATE_CONFIG \
  --num_machines $SLURM_NNODES --num_processes $((SLURM_NNODES * GPUS_PER_NODE)) \
  --machine_rank \$SLURM_NODEID --main_process_ip $MAIN_IP --main_process_port 29500 \
  -m mmrl.cli train $*"
