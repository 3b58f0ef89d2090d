"""What a run tells its user: console, progress, metrics and W&B, throughput, the dry run."""
