"""`python -m smp.gpu_check`: one command that checks smp on a GPU machine and writes a report.

Steps (one module each): `device_checks` (world-1 equivalence, checkpointing, export, delayed
init: on CUDA when there is one, else on CPU), `triton_kernels` (smp_collectives' fused kernels:
bitwise equality and bandwidth), `step_time` (smp vs a plain PyTorch loop, MFU, torch.compile)
and `activation_offloading` (peak memory, step time, copy/compute overlap); the last three need
a CUDA device and are reported as skipped without one. See docs/gpu-check.md.
"""
