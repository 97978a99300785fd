#!/usr/bin/env bash
# One command on a GPU machine: measure tools/gpu_matrix.json on CUDA, write ${1:-$OUT/gpu_matrix.json}.
exec "${PYTHON:-python3}" "$(dirname "$0")/gpu_matrix.py" --out "${1:-${OUT:-.}/gpu_matrix.json}" "${@:2}"
