"""The Triton kernels of KDA and their launchers; the public ops and autograd Functions are one level up.

Imported only through the "triton" backend (dispatch.TRITON_OPS, the chunk Function's launches): `triton` is an
optional dependency. Legend as in chunk_fwd.py. Modules:

    common      device and launch helpers, chunk and sequence bounds, the shared @triton.jit helpers
    launch      LAUNCH (the launch settings of every chunk kernel) and the helpers that read it
    chunk_fwd   the forward's launchers (chunk_fwd_pipeline, chunk_fwd_states) and its w/u, scan, output kernels
    intra_fwd   the forward's intra-chunk kernel (Aqk and L per 16-token sub-chunk)
    solve       the forward's (I + L)^-1 per chunk
    segments    the forward's w/u kernel and state scan in time segments on two streams
    chunk_bwd   the backward's launcher (chunk_bwd_triton) and its reverse scan and inter-chunk kernels
    intra_bwd   the backward's intra-chunk and dg kernels
    recurrent   the token recurrence (fused_recurrent_kda): decode and short appends
    gate        the KDA gate, one pass each way
    norm        the q / k L2 norm, one pass each way

Forward and backward modules share only `common` and `launch` (tests/kernels/test_kda_imports.py).
"""
