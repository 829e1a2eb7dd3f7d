"""The CPU speed layer: C kernels built for the machine they run on, and what the model and
the engine call to use them. Every piece has a torch reference that it is tested against,
and the engine falls back to that reference where a piece cannot run.

    features.py   what the CPU has (flags, caches), read once; decides the fast paths
    build.py      compile csrc/ once per compiler, target ISA, sources and flags; cache; status
    kernels.py    the kernels' Python side (argument checks, ctypes calls)
    linear.py     packed weights: small_gemm panels, oneDNN's layout, the bf16 LM head
    ops.py        CpuOps: fused residual + RMSNorm, RoPE, SiLU x up (models.ops.Ops)

The paged attention kernels are served by the `cpu` attention backend (cbgen.attention).
"""
