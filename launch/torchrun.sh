#!/usr/bin/env bash
# Start `python -m pretrain ARGS` on this node under torchrun: one node, or one of many.
#
#   launch/torchrun.sh [OPTIONS] [--] PRETRAIN_ARGS...
#   launch/torchrun.sh train --config configs/demo-cpu.toml       # this node only
#   launch/torchrun.sh --nnodes 2 --master-addr node0 --node-rank 0 train --config X.toml
#   launch/torchrun.sh --nnodes 2 --master-addr node0 --node-rank 1 train --config X.toml
#     (the first on node0, the second on the other node; under slurm, launch/slurm/ does this)
#
# Every option falls back to an environment variable, then to what slurm sets, then a default:
#   --nnodes N           NNODES          SLURM_JOB_NUM_NODES   1
#   --nproc-per-node P   NPROC_PER_NODE  SLURM_GPUS_ON_NODE    GPUs visible, else 1
#   --master-addr HOST   MASTER_ADDR     (required with more than one node)
#   --master-port PORT   MASTER_PORT     29500
#   --node-rank R        NODE_RANK       SLURM_NODEID          0
#   --local-addr ADDR    LOCAL_ADDR      (torchrun uses this machine's host name)
# PYTHON picks the interpreter (default: the repository's .venv, else python3).
#
# Nodes meet through torchrun's c10d rendezvous at MASTER_ADDR:MASTER_PORT; node rank 0 hosts
# its store (so it must run on MASTER_ADDR), and no node has to guess from host names whether
# it is the head. Global ranks are handed out at the rendezvous. --local-addr is the address other nodes reach this one at (needed
# only where this machine's host name does not resolve to it from the other nodes).
#
# Signals: SIGUSR1 and SIGTERM reach every rank, which finishes its step, saves a checkpoint and
# exits; after SIGUSR1 this script then exits 0 (see below). SHUTDOWN_TIMEOUT (default 600 s) is
# how long torchrun waits after SIGTERM before it kills the ranks, so it must cover one step
# plus one checkpoint save.
set -euo pipefail

nnodes=${NNODES:-${SLURM_JOB_NUM_NODES:-1}}
nproc=${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}
master_addr=${MASTER_ADDR:-}
master_port=${MASTER_PORT:-29500}
node_rank=${NODE_RANK:-${SLURM_NODEID:-0}}
local_addr=${LOCAL_ADDR:-}

fail() { echo "error: $*" >&2; exit 2; }

while (($#)); do
  case $1 in
    --nnodes|--nproc-per-node|--master-addr|--master-port|--node-rank|--local-addr)
      (($# >= 2)) || fail "$1 needs a value"
      case $1 in
        --nnodes) nnodes=$2 ;;
        --nproc-per-node) nproc=$2 ;;
        --master-addr) master_addr=$2 ;;
        --master-port) master_port=$2 ;;
        --node-rank) node_rank=$2 ;;
        --local-addr) local_addr=$2 ;;
      esac
      shift 2 ;;
    --) shift; break ;;
    -*) fail "unknown option $1 (options: see the header of launch/torchrun.sh)" ;;
    *) break ;;
  esac
done
if (($# == 0)); then
  fail "no arguments for python -m pretrain (usage: launch/torchrun.sh [OPTIONS] [--]" \
    "train --config X.toml ...)"
fi
for name in nnodes master_port node_rank; do
  [[ ${!name} =~ ^[0-9]+$ ]] || fail "${name//_/-} (${!name}) must be a whole number"
done
[[ -z $nproc || $nproc =~ ^[1-9][0-9]*$ ]] ||
  fail "nproc-per-node ($nproc) must be a whole number >= 1"
((nnodes >= 1)) || fail "nnodes ($nnodes) must be >= 1"
((node_rank < nnodes)) || fail "node-rank ($node_rank) must be below nnodes ($nnodes)"

if [[ -z $nproc ]]; then  # one rank per visible GPU; CPU-only machines get one rank
  nproc=$(nvidia-smi --list-gpus 2>/dev/null | grep -c '^GPU' || true)
  ((nproc > 0)) || nproc=1
fi
# torchrun's own default for several ranks on a node (one OpenMP thread each), set here so that
# it does not print a notice about it at every start; set OMP_NUM_THREADS to choose another.
((nproc == 1)) || export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z ${PYTHON:-} ]]; then
  PYTHON=python3
  [[ -x $repo/.venv/bin/python ]] && PYTHON=$repo/.venv/bin/python
fi

args=(--nproc-per-node "$nproc" --max-restarts 0 --shutdown-timeout "${SHUTDOWN_TIMEOUT:-600}")
if ((nnodes == 1)) && [[ -z $master_addr ]]; then
  args+=(--standalone)  # a private rendezvous on a free local port
else
  [[ -n $master_addr ]] || fail "--master-addr (or MASTER_ADDR) is required with $nnodes nodes"
  is_host=false
  [[ $node_rank == 0 ]] && is_host=true
  args+=(--nnodes "$nnodes" --rdzv-backend c10d
         --rdzv-endpoint "$master_addr:$master_port"
         --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-pretrain}}"
         --rdzv-conf "is_host=$is_host")
  [[ -n $local_addr ]] && args+=(--local-addr "$local_addr")
fi

# torchrun runs through launch/torchrun_main.py: when the ranks exit 2 (a user's mistake, one
# `error:` line from rank 0), 3 (an aborted run) or 4 (a hang: pretrain/train/watchdog.py), so
# does this script, without torchrun's failure report; any other failure keeps it.
# SIGUSR1 asks the ranks to save a checkpoint and stop: a normal end, after which torchrun must
# exit 0 as its ranks do (under slurm, a failed node would take the others down with it).
# torchrun exits 1 after any signal it handles, so it ignores USR1 instead (the ignore is
# inherited; each rank installs its own handler) and this shell hands USR1 to the ranks. Under
# slurm the ranks also get it from slurm itself (a signal to a job step reaches every process
# of the step); a second USR1 changes nothing. SIGTERM goes to torchrun, which passes it on and
# waits up to SHUTDOWN_TIMEOUT for the ranks to exit; SIGINT (Ctrl-C) goes to torchrun_main.py,
# which relays it to the ranks as SIGINT (see there).
set +e
( trap '' USR1; exec "$PYTHON" "$repo/launch/torchrun_main.py" "${args[@]}" -m pretrain "$@" ) &
torchrun=$!
trap 'pkill -USR1 -P "$torchrun"' USR1
trap 'kill -TERM "$torchrun" 2>/dev/null' TERM
trap 'kill -INT "$torchrun" 2>/dev/null' INT
while :; do  # `wait` returns early whenever a trapped signal arrives
  wait "$torchrun"
  status=$?
  kill -0 "$torchrun" 2>/dev/null || break
done
exit "$status"
