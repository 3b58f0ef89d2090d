#!/usr/bin/env bash
# The body of single-node.sbatch and multi-node.sbatch, run as the job's batch shell.
#
# One task per node (srun) starts launch/torchrun.sh, which starts that node's ranks; the nodes
# meet at the first node of the allocation. Preemption: slurm sends the batch shell SIGUSR1
# some minutes before the time limit (#SBATCH --signal=B:USR1@...). The shell passes it on
# to srun, which hands it to every task; torchrun forwards it to the ranks, and they finish
# their step, save a checkpoint and exit. The shell then requeues the job (scontrol requeue)
# unless the run had already reached run.steps. The requeued job starts this script again with
# the same arguments, and `python -m pretrain train` resumes from the run folder's latest
# checkpoint and continues the same W&B run. SIGTERM (scancel, or slurm's own preemption) is
# passed on the same way, but the job is not requeued by this script.
set -uo pipefail

if [[ -z ${SLURM_JOB_ID:-} || -z ${SLURM_SUBMIT_DIR:-} ]]; then
  echo "error: job.sh runs as a slurm batch job: sbatch launch/slurm/single-node.sbatch ..." >&2
  exit 2
fi
cd "$SLURM_SUBMIT_DIR" || exit 2
if [[ ! -f launch/torchrun.sh ]]; then
  echo "error: submit from the repository root (no launch/torchrun.sh in $PWD)" >&2
  exit 2
fi
if (($# == 0)); then
  echo "error: no arguments for python -m pretrain (e.g. train --config X.toml)" >&2
  exit 2
fi

if [[ -z ${PYTHON:-} ]]; then  # the same interpreter launch/torchrun.sh picks
  PYTHON=python3
  [[ -x .venv/bin/python ]] && PYTHON=$PWD/.venv/bin/python
fi
export PYTHON

nodes=${SLURM_JOB_NUM_NODES:-1}
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# The head's address as slurm knows it (NodeAddr), so its name need not resolve elsewhere.
head_addr=$(scontrol show node "$head" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
# The rendezvous port: the job's own, 20000 + id mod 20000, or (probed here, on the first node,
# where this shell runs and the rendezvous store will listen) the next free one after it.
port=${RDZV_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
if [[ -z ${RDZV_PORT:-} && ${SLURMD_NODENAME:-} == "$head" ]]; then
  port=$("$PYTHON" -m launch.port "$port") || exit 2
fi
echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $nodes node(s), head $head" \
  "(${head_addr:-$head}:$port), started $(date -Is)"

signalled="" signals=0 srun_pid=""
on_signal() {
  signalled=$1
  signals=$((signals + 1))
  echo "job $SLURM_JOB_ID: SIG$1 received, asking the run to checkpoint and stop"
  [[ -n $srun_pid ]] && kill -s "$1" "$srun_pid" 2>/dev/null
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

# Since slurm 22.05 a step no longer inherits the job's --cpus-per-task: ask for every CPU
# of the node, or torchrun and all its ranks may share one core.
srun --nodes="$nodes" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}" \
  --kill-on-bad-exit=1 \
  bash launch/torchrun.sh --nnodes "$nodes" --master-addr "${head_addr:-$head}" \
  --master-port "$port" -- "$@" &
srun_pid=$!
[[ -n $signalled ]] && kill -s "$signalled" "$srun_pid" 2>/dev/null  # came before srun did
# `wait` returns early whenever a trapped signal arrives; wait again until srun has ended.
while :; do
  before=$signals
  wait "$srun_pid"
  status=$?
  ((signals == before)) && break
done

if [[ $signalled == USR1 ]]; then
  if "$PYTHON" -W ignore -m launch.finished "$@"; then
    echo "job $SLURM_JOB_ID: the run is complete; not requeued"
    exit 0
  fi
  echo "job $SLURM_JOB_ID: checkpoint saved (srun status $status); requeueing"
  if ! scontrol requeue "$SLURM_JOB_ID"; then
    echo "error: scontrol requeue $SLURM_JOB_ID failed (submitted with --no-requeue, or" \
      "JobRequeue=0 on this cluster?); resubmit the same command to resume" >&2
    exit 1
  fi
  exit 0
fi
echo "job $SLURM_JOB_ID: srun exited with status $status at $(date -Is)"
exit "$status"
