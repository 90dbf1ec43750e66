#!/usr/bin/env bash
# Spark GPU discovery script: prints {"name": "gpu", "addresses": ["0", "1", ...]}, one address
# per GPU that nvidia-smi lists (the format Spark's resource discovery expects).
# For tests without GPUs, SPARKTRAIN_FAKE_GPUS="0,1" prints those addresses instead.
set -euo pipefail
if [ -n "${SPARKTRAIN_FAKE_GPUS:-}" ]; then
  addresses="$SPARKTRAIN_FAKE_GPUS"
else
  addresses="$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)"
fi
printf '{"name": "gpu", "addresses": [%s]}\n' "$(printf '%s' "$addresses" | sed 's/[^,][^,]*/"&"/g')"
