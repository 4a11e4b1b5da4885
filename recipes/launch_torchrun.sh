#!/usr/bin/env bash
# DeepSeek-V4-Flash LoRA recipe (impl.recipe.flash_lora.deepseek_v4_flash_lora_recipe) on NNODES x NPROC_PER_NODE GPUs.
# Run once per node (same command on every node; NODE_RANK differs). See recipes/deepseek_v4_flash_lora.md.
#
#   DSV4_FLASH_CHECKPOINT=/data/DeepSeek-V4-Flash MASTER_ADDR=node0 NODE_RANK=0 recipes/launch_torchrun.sh
#   DSV4_RUN=gpu32 ... recipes/launch_torchrun.sh      # the 32-rank conformance tests instead of qualify
set -euo pipefail

: "${DSV4_FLASH_CHECKPOINT:?set DSV4_FLASH_CHECKPOINT to the official-layout DeepSeek-V4-Flash checkpoint directory}"
NNODES="${NNODES:-4}"
NPROC_PER_NODE="${NPROC_PER_NODE:-8}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_ID="${RDZV_ID:-dsv4-flash-lora}"
OUT="${DSV4_OUT:-out/flash-lora}"
STEPS="${DSV4_STEPS:-3}"
PYTHON="${PYTHON:-python}"
WORLD=$((NNODES * NPROC_PER_NODE))

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
# One NCCL communicator per parallel group; fail fast instead of hanging on a dead peer.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"

TORCHRUN=(
  "$PYTHON" -m torch.distributed.run
  --nnodes "$NNODES"
  --nproc-per-node "$NPROC_PER_NODE"
  --node-rank "$NODE_RANK"
  --rdzv-backend c10d
  --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"
  --rdzv-id "$RDZV_ID"
  --max-restarts 0
)

case "${DSV4_RUN:-qualify}" in
  qualify)
    # The recipe's flags; suites/reference/test_recipe.py checks they equal impl.recipe.flash_lora.to_qualify_args(recipe).
    # --no-oracle: a transformers model of the whole base on rank 0 does not fit a host at full size.
    exec "${TORCHRUN[@]}" -m impl.cli qualify \
      --base "$DSV4_FLASH_CHECKPOINT" \
      --tp 1 --pp 4 --ep 8 \
      --nproc "$WORLD" \
      --targets wq_a,wq_b,wkv,wo_a,wo_b \
      --rank 16 --alpha 32.0 \
      --steps "$STEPS" \
      --timeout 3600 \
      --out "$OUT" \
      --no-oracle
    ;;
  gpu32)
    exec "${TORCHRUN[@]}" -m pytest -p no:cacheprovider -m gpu32 suites/reference/test_gpu32.py -rs -x
    ;;
  gpu)
    # Single-node distributed suite under NCCL (NPROC_PER_NODE=8, NNODES=1).
    exec "${TORCHRUN[@]}" -m pytest -p no:cacheprovider -m gpu suites/reference/test_gpu.py --nproc "$WORLD" -rs
    ;;
  *)
    echo "DSV4_RUN must be qualify, gpu32 or gpu (got '${DSV4_RUN}')" >&2
    exit 2
    ;;
esac
