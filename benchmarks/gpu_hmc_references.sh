#!/bin/bash
# HMC references for pyro-fa classify's MLPs on a lent GPU, as one prepared device call:
#
#   bash benchmarks/gpu_hmc_references.sh TASK NUM_STEPS [more pyro-fa hmc-reference arguments]
#   bash benchmarks/gpu_hmc_references.sh digits 1000 --precision 0.01   # seed 0's MAP choice, known
#   DEVICE=cpu bash benchmarks/gpu_hmc_references.sh digits 5 --quick    # a dry run of the script here
#
# TASK is digits or mnist1d (split 0), NUM_STEPS the leapfrog steps per iteration. The reference (.pt) and its
# diagnostics (.json: R-hat, ESS, the chains' agreement) land in $OUT/TASK (the device tool's folder; runs/hmc-gpu
# elsewhere), the log in $OUT/log.txt. The chains' unit files lie one folder deeper and do not come back. Run from
# the repository root with the machine's own python3 (torch with CUDA).
#
# Why 1 000 steps: on the 2-core CPU, 100 leapfrog steps per iteration (trajectories of about 0.17 in the
# mass-scaled units) and 1 400 iterations left the digits MLP's chains in their own modes (R-hat 2.0;
# benchmarks/results/classify_fidelity.md); a trajectory of about pi / 2 in those units is what a Gaussian
# posterior needs to decorrelate, ten times longer.
set -uo pipefail
task=${1:-digits}
steps=${2:-1000}
shift $(( $# < 2 ? $# : 2 ))
out=${OUT:-runs/hmc-gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, '| cuda:', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')" \
    | tee "$out/log.txt"
start=$(date +%s)
python3 -m pyro_fa.cli hmc-reference --tasks "$task" --splits 0 --device "${DEVICE:-cuda}" --num-steps "$steps" \
    --output-dir "$out/$task" --no-progress "$@" 2>&1 | tee -a "$out/log.txt"
status=${PIPESTATUS[0]}
echo "exit $status after $(( $(date +%s) - start )) s" | tee -a "$out/log.txt"
exit "$status"
