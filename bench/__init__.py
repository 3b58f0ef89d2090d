"""Benchmarks that print tables: kernels, saved activations, schemes, GPU steps, throughput."""
