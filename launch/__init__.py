"""Launching training: torchrun on one node or many (torchrun.sh), slurm batch jobs with
preemption and requeue (slurm/), and the run-complete check those jobs use (finished.py)."""
