"""Launching training: torchrun on one node or many (torchrun.sh, which runs torchrun through
torchrun_main.py so that a user's mistake ends the launch in one line), slurm batch jobs with
preemption and requeue (slurm/), and what those jobs ask of this machine: whether the run is
complete (finished.py) and a free rendezvous port (port.py)."""
