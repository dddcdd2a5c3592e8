#!/bin/bash
# mcore-rl training job, rendered by `mcore-rl launch slurm` from launch/templates/sbatch.sh.
# Placeholders are written @@{name}; everything else is plain bash.
@{directives}
#
# One torchrun per node (srun, one task per node); the c10d rendezvous runs on the first
# node of the allocation. Preemption: SLURM sends USR1 to this shell before the time limit
# (the --signal directive above). torchrun does not pass USR1 on to the ranks, so the trap
# below touches the stop file instead; every rank checks it at each step boundary, all of
# them agree (one all-reduce), save a checkpoint, and rank 0 acknowledges. This shell then
# requeues the job, and the requeued job resumes from that checkpoint by itself.
set -uo pipefail

PYTHON=@{python}
RUN_DIR=@{run_dir}
export MCORE_RL_STOP_FILE="$RUN_DIR/.stop-$SLURM_JOB_ID"
stop_ack="$MCORE_RL_STOP_FILE.saved"
rm -f "$MCORE_RL_STOP_FILE" "$stop_ack"  # left from an earlier start of this job
log() { echo "mcore-rl[job $SLURM_JOB_ID, start ${SLURM_RESTART_COUNT:-0}] $(date '+%F %T'): $*"; }
request_stop() {
  log "got a stop signal: ranks stop at the next step boundary, checkpoint, requeue"
  touch "$MCORE_RL_STOP_FILE"
}
trap request_stop USR1 TERM

# Defaults that the submitting environment may override (sbatch passes it on).
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-@{threads_per_rank}}"
@{backend_env}

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
# A free port on this (the first) node for the rendezvous store.
rdzv_port=$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])')
log "nodes $SLURM_JOB_NODELIST, @{procs_per_node} rank(s) per node," \
  "rendezvous $head_node:$rdzv_port"

srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 @{srun_extra}--kill-on-bad-exit=1 \
  "$PYTHON" -m torch.distributed.run --nnodes="$SLURM_NNODES" --nproc-per-node=@{procs_per_node} \
    --rdzv-backend=c10d --rdzv-endpoint="$head_node:$rdzv_port" --rdzv-id="$SLURM_JOB_ID" \
    --max-restarts=0 \
    -m mcore_rl.cli.main train @{train_args} &
srun_pid=$!
# A trapped signal interrupts `wait` (status > 128); keep waiting until srun has ended.
while :; do
  wait "$srun_pid"; status=$?
  kill -0 "$srun_pid" 2>/dev/null || break
done

if [ -f "$stop_ack" ]; then
  log "checkpoint saved after step $(cat "$stop_ack"); requeueing"
  trap - USR1 TERM  # the requeue ends this shell with SIGTERM
  rm -f "$MCORE_RL_STOP_FILE" "$stop_ack"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
log "training exited with status $status"
exit "$status"
