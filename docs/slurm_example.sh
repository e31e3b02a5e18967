#!/bin/bash
# napari-gpu-relion on a SLURM cluster with the cluster's own MPI (example; adapt partition, modules, paths).
#
# One MPI rank per GPU, 2 nodes x 4 GPUs. Every rank runs the E-step on its share of the particles (both
# gold-standard halves are spread over all ranks); the accumulators are summed with MPI_Allreduce; rank 0 writes
# every file. Without --gpu each rank takes GPU (its rank on the node) % (GPUs it sees); SLURM's
# --gpus-per-task=1 makes each rank see only its own GPU, so every rank uses "GPU 0" of its own set.
#
#SBATCH --job-name=refine3d
#SBATCH --partition=gpu
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-task=1
#SBATCH --cpus-per-task=8
#SBATCH --mem=0
#SBATCH --time=12:00:00
#SBATCH --output=Refine3D/job012/run.out
#SBATCH --error=Refine3D/job012/run.err

set -euo pipefail

# 1. The cluster's MPI (not the mpich wheel of the [mpi] extra): load it, then build mpi4py against it, once:
#      module load openmpi/4.1       # or intel-mpi, mpich, ...
#      python -m venv ~/venvs/ngr && ~/venvs/ngr/bin/pip install -e ".[cuda12]"
#      ~/venvs/ngr/bin/pip install --no-binary=mpi4py --no-cache-dir mpi4py   # compiled with this module's mpicc
#    (python -c "from mpi4py import MPI; print(MPI.Get_library_version())" must name the cluster's MPI, and the
#    mpich wheel must not be installed in that environment: pip uninstall mpich)
module load openmpi/4.1
source ~/venvs/ngr/bin/activate

export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK}

# 2. srun starts the ranks (PMIx or PMI-2, whichever the cluster's MPI was built for). The same command line as
#    a single-GPU run; --continue resumes from the last complete iteration with any number of ranks.
srun --mpi=pmix napari-gpu-relion refine3d \
    --i Select/job010/particles.star --ref InitialModel/job011/initial_model.mrc \
    --o Refine3D/job012/run --ctf --particle_diameter 180 --ini_high 40 --sym C1 \
    --healpix_order 2 --auto_local_healpix_order 4 --flatten_solvent

# Several ranks per GPU (e.g. 8 ranks on 4 GPUs of one node), RELION's syntax:
#   srun --ntasks=8 --gpus=4 napari-gpu-relion class3d ... --gpu 0:1:2:3
# On one workstation without SLURM:
#   mpirun -n 4 napari-gpu-relion class2d --i particles.star --o Class2D/job005/run --K 100 --gpu 0:1:2:3
