"""torchrun and slurm launchers for single- and multi-node runs (arrive with the launch work)."""
