"""One GPU check in one short command, prepared and rehearsed on the CPU.

The check is built for a GPU machine that has no network and may be had for minutes rather
than hours: ``python -m bench.gpu_check`` (``make gpu-check``) measures what matters in
priority order, each part within its own time budget, and writes each part's JSON the moment
it finishes, so a run cut short still returns everything done so far:

1. the environment and a calibration (device copy GB/s, bf16 GEMM TFLOP/s);
2. the gpu-marked correctness tests, pass/fail per test;
3. the fused norms' bandwidth table at the 1.3B shape;
4. the step table (pre, siamese, siamese_hybrid, interleaved, over rounds);
5. what time remains: post and hybridnorm, the optimizer step at the full shape, a profile of
   siamese against pre, and the backward kernels' open layout alternatives.

``python -m bench.gpu_check.bundle`` (``make gpu-bundle``) builds on the CPU the folder the
run carries (the wheels the GPU machine lacks) and prints the command to run there.
``--rehearse`` runs the same parts on the CPU at tiny shapes (Triton's interpreter), so the
command is known to work before a GPU minute is spent. ``bench.gpu_check.docs_tables``
writes the GPU tables of README.md and docs/benchmarks.md from the newest
``docs/results/gpu-*.json``.
"""
