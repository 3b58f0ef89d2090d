"""Launching training: torchrun on one node or many (torchrun.sh, which runs torchrun through
torchrun_main.py so that a user's mistake ends the launch in one line), slurm batch jobs with
preemption and requeue (slurm/), and the run-complete check those jobs use (finished.py)."""
