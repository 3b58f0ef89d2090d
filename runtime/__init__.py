"""What a run needs besides the model: devices, process groups and the launcher's environment,
the CPU compatibility layer, megatron's schedules, gradient finalisation, weight I/O and the
error types for user mistakes."""
