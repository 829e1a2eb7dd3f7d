"""The CPU kernel layer: C kernels built for the machine they run on, behind Python functions
that take tensors (and packed buffers) and return tensors. It knows no model, attention backend
or engine (tests/test_imports.py holds it): cbgen.runtime binds a model to these kernels, and
the `cpu` attention backend (cbgen.attention) serves the paged attention with them. Every
kernel has a torch reference it is tested against.

    features.py   what the CPU has (flags, caches), read once; decides the fast paths
    build.py      compile csrc/ once per compiler, target ISA, sources and flags; cache; status
    c_header.py   csrc/cbgen.h read back: the ctypes signatures checked against it
    checks.py     what every wrapper checks of a tensor handed to C; the library, or why not
    kernels.py    attention, the fused element-wise ops and the sampler: checks, ctypes calls
    gemm.py       small_gemm: weights packed into 32-column panels, the plain and gated products
    head_kernels.py  the exact LM heads' kernels (bf16, int16) and the int16 head's packing
    arena.py      huge-page memory for the packed weights (HugePageArena)
    thresholds.py what the build answers of its tiles: small_gemm's rows, the prefill split
    linear.py     oneDNN's packed matmul, and the exact LM heads (bf16, int16 logits)
    tuning.py     the row thresholds and the head measured once per build on this machine
"""
