#!/bin/bash
# mcore-rl driver job on Ray, rendered by `mcore-rl launch slurm` from
# launch/templates/sbatch_ray.sh. Placeholders are written @@{name}; the rest is plain bash.
@{directives}
#
# One Ray node per SLURM node: the head on the first node, at an address chosen here and
# given to everyone explicitly, and a worker on each other node (srun, one task per node).
# Each Ray node has a temp dir and ports of its own (nodes may share a host). The driver
# script runs once, in this shell on the first node, with RAY_ADDRESS set. Whatever the end
# (success, failure, preemption), every node's Ray is stopped before this shell exits: only
# the processes of its own temp dir (`ray stop` would end every Ray on the host), so a
# requeued job finds no stale head. Preemption: SLURM sends USR1 to this shell before the
# time limit; the trap touches the stop file, the driver checks it between its steps, saves
# a checkpoint and acknowledges, and this shell requeues the job.
set -uo pipefail

PYTHON=@{python}
RUN_DIR=@{run_dir}
export MCORE_RL_RUN_DIR="$RUN_DIR"
export MCORE_RL_STOP_FILE="$RUN_DIR/.stop-$SLURM_JOB_ID"
stop_ack="$MCORE_RL_STOP_FILE.saved"
rm -f "$MCORE_RL_STOP_FILE" "$stop_ack"  # left from an earlier start of this job
log() { echo "mcore-rl[job $SLURM_JOB_ID, start ${SLURM_RESTART_COUNT:-0}] $(date '+%F %T'): $*"; }
request_stop() {
  log "got a stop signal: the driver stops at its next step boundary, checkpoints, requeue"
  touch "$MCORE_RL_STOP_FILE"
}
trap request_stop USR1 TERM

export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-@{threads_per_rank}}"
export RAY_DEDUP_LOGS=0
# How long Ray's processes retry a dead GCS before they give up (Ray's default: 60 s).
export RAY_gcs_rpc_server_reconnect_timeout_s="${RAY_gcs_rpc_server_reconnect_timeout_s:-@{ray_reconnect_timeout_s}}"
# Ray's token authentication, with a token of this job's own that every node and the driver
# inherit (srun passes the environment on).
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
export RAY_AUTH_TOKEN="${RAY_AUTH_TOKEN:-$("$PYTHON" -c 'import secrets; print(secrets.token_hex(32))')}"
@{backend_env}

# Every node's Ray of this job, ended (also the ones left by an earlier start of this job).
stop_ray() {
  srun --overlap --nodes="$SLURM_NNODES" --ntasks="$SLURM_NNODES" --ntasks-per-node=1 \
    "$PYTHON" -m mcore_rl.launch.ray_node stop --job "$SLURM_JOB_ID"
}
# Wait for a background process; a trapped signal interrupts `wait` (status > 128).
wait_for() {
  local status
  while :; do
    wait "$1"; status=$?
    kill -0 "$1" 2>/dev/null || return "$status"
  done
}
ray_pids=()
finish() {
  if stop_ray; then log "Ray stopped on every node"; else log "stopping Ray failed (see above)"; fi
  local pid tries
  for pid in "${ray_pids[@@]}"; do  # the node steps end with their Ray; srun gets 30 s
    for tries in $(seq 300); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  done
}

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
head_ip=$("$PYTHON" -c 'import socket, sys; print(socket.gethostbyname(sys.argv[1]))' "$head_node")
head_port=$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])')
export RAY_ADDRESS="$head_ip:$head_port"
log "nodes $SLURM_JOB_NODELIST, Ray head $RAY_ADDRESS on $head_node"

srun --overlap --nodes=1 --ntasks=1 --nodelist="$head_node" @{srun_extra}\
  "$PYTHON" -m mcore_rl.launch.ray_node start --head --port "$head_port" \
    --job "$SLURM_JOB_ID" @{ray_resources} &
ray_pids+=($!)
if [ "$SLURM_NNODES" -gt 1 ]; then
  srun --overlap --nodes=$((SLURM_NNODES - 1)) --ntasks=$((SLURM_NNODES - 1)) \
    --ntasks-per-node=1 --exclude="$head_node" \
    @{srun_extra}"$PYTHON" -m mcore_rl.launch.ray_node start --address "$RAY_ADDRESS" \
      --job "$SLURM_JOB_ID" @{ray_resources} &
  ray_pids+=($!)
fi

if ! "$PYTHON" -m mcore_rl.flow.cluster wait --nodes "$SLURM_NNODES" --timeout 180; then
  finish
  log "driver exited with status 1 (Ray did not start on every node)"
  exit 1
fi
driver=(@{driver_args})
log "driver: ${driver[*]}"
"$PYTHON" "${driver[@@]}" &
driver_pid=$!
wait_for "$driver_pid"; status=$?
log "driver exited with status $status"
finish

if [ -f "$stop_ack" ]; then
  log "checkpoint saved after step $(cat "$stop_ack"); requeueing"
  trap - USR1 TERM  # the requeue ends this shell with SIGTERM
  rm -f "$MCORE_RL_STOP_FILE" "$stop_ack"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
