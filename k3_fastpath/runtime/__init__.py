"""What serves a decode step: the executor behind ``decode_backend: latency_specialized`` (``executor.py``)
with its options, envelope, op tables (fast kernels, the standard path's library ops), step, caches, CUDA
graphs, L2 prefetch and trace; the sampler and batched generation; tensor parallelism (``tp*.py``). What
measures a step (floor, section timing, kernel profile, rank emulation) is ``k3_fastpath/measure/``."""
