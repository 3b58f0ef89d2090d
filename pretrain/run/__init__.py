"""The run folder: its files, lock, stop signals, checkpoints and what identifies a run."""
