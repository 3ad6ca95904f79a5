"""The tile table of flash_cuda: every kernel family's head-dim buckets and the tile shapes of the
simt and mma.sync families, in one place (the Hopper family's shapes depend on the call and live in
csrc/tiers/wgmma/tile_policy.h). generate.py writes it out as csrc/include/tiles.h (the families'
C++ reads the shapes from there) and writes the instance files from its buckets. Why each shape was chosen, with the
measurements, is in OPTIMIZATION.md; a line here says what the numbers are.
"""

DTYPES = {"fp16": "kFloat16", "bf16": "kBFloat16"}

# ---- fp32, CUDA cores (tiers/simt) ----
# TileConfig<kHeadDim, kRows, kCols, kTM, kG, kMinBlocksPerSm>: a CTA owns kRows rows and streams
# kCols rows of the other operand per step; kTM rows per thread, kG lanes per row group.
# "compact": the configuration that fits 99 KiB of shared memory (sm_86 / sm_89 / sm_120; sm_80
# for d >= 128), taken where the device cannot give the first its shared memory. "outer": the
# forward of that bucket runs the outer-product kernel (fwd_outer.cuh) where it fits.
SIMT_FWD = {
    32: dict(config=(32, 128, 64, 8, 8, 2), compact=None, outer=False),
    64: dict(config=(64, 128, 64, 8, 8, 2), compact=(64, 128, 32, 8, 8, 2), outer=False),
    128: dict(config=(128, 64, 32, 4, 16, 1), compact=None, outer=True),
    256: dict(config=(256, 64, 64, 4, 16, 1), compact=(256, 32, 16, 2, 16, 1), outer=False),
}
# dK/dV kernel (rows = keys) and dQ kernel (rows = queries); "atomic": the dK/dV kernel that also
# adds dQ (deterministic=False), where it differs from the deterministic one.
SIMT_BWD = {
    32: dict(dkdv=(32, 64, 64, 4, 8, 2), dq=(32, 64, 64, 4, 8, 2)),
    64: dict(dkdv=(64, 64, 64, 4, 8, 2), dq=(64, 64, 64, 4, 8, 2), compact_dkdv=(64, 64, 32, 4, 8, 2)),
    128: dict(dkdv=(128, 64, 64, 4, 16, 1), dq=(128, 128, 32, 4, 8, 1), compact_dkdv=(128, 32, 32, 2, 16, 1),
              compact_dq=(128, 32, 32, 2, 16, 1)),
    256: dict(dkdv=(256, 64, 32, 4, 16, 1), dq=(256, 64, 32, 4, 16, 1), compact_dkdv=(256, 16, 16, 1, 16, 1),
              compact_dq=(256, 16, 16, 1, 16, 1), compact_atomic_dkdv=(256, 16, 16, 1, 16, 2)),
}

# ---- fp16 / bf16, mma.sync (tiers/mma) ----
# Forward: kBlockM queries x kBlockN keys, kNWarps warps, kMinBlocks CTAs per SM. "compact": the
# 99 KiB shape (32-key steps keep the warps' 16-row tiles).
MMA_FWD = {
    32: dict(tile=(128, 64, 4, 2)),
    64: dict(tile=(128, 64, 4, 2)),
    96: dict(tile=(128, 64, 4, 2)),
    128: dict(tile=(128, 64, 4, 2), compact=(128, 32, 4, 1)),
    192: dict(tile=(64, 64, 4, 1), compact=(64, 32, 4, 1)),
    256: dict(tile=(64, 64, 4, 1), compact=(64, 32, 4, 1)),
}
# Backward: (kKVWarps, kKVMTiles, kKVBlockM, kSplitDKDV, kKVMinBlocks, kQWarps, kQMTiles,
# kQBlockN, kQMinBlocks): the dK/dV CTA owns 16 kKVMTiles kKVWarps keys and steps over kKVBlockM
# queries; the dQ CTA owns 16 kQMTiles kQWarps queries and steps over kQBlockN keys. "tile" fits
# an A100's 163 KiB; "large" the Hopper budget (sm_90 only), "compact" 99 KiB.
MMA_BWD = {
    32: dict(tile=(4, 2, 48, False, 2, 4, 2, 64, 2)),
    64: dict(tile=(4, 2, 32, False, 2, 4, 2, 64, 2)),
    96: dict(tile=(8, 1, 64, False, 1, 4, 2, 32, 2), compact=(4, 1, 48, False, 2, 4, 2, 32, 2)),
    128: dict(tile=(4, 1, 48, False, 2, 8, 1, 64, 1), compact=(4, 1, 48, False, 2, 4, 1, 48, 2)),
    192: dict(tile=(8, 1, 32, True, 1, 8, 1, 32, 1), compact=(4, 1, 16, True, 2, 4, 1, 16, 2)),
    256: dict(tile=(4, 1, 32, True, 1, 4, 1, 32, 1), large=(8, 1, 32, True, 1, 8, 1, 32, 1),
              compact=(3, 1, 16, True, 2, 3, 1, 16, 2)),
}

# ---- fp16 / bf16, Hopper (tiers/wgmma) ----
# The buckets with instances; every Hopper tile shape is csrc/tiers/wgmma/tile_policy.h's.
# Forward (warp-specialized), and the buckets with extended (varlen, softcap, ALiBi) and
# GQA-packed instances.
WGMMA_FWD = (64, 96, 128, 192, 256)
# The FP8 (e4m3) forward's head dims (tiers/wgmma/fwd/launch.cuh: run_fwd_sm90_fp8): Q, K and V^T
# in 128-byte lines (Q and K 64-byte at d = 64); O in each 16-bit dtype.
WGMMA_FWD_FP8 = (64, 128, 256)
WGMMA_FWD_EXT = (64, 96, 128, 192, 256)
WGMMA_FWD_GQA = (64, 96, 128)
WGMMA_FWD_DROPOUT = (64, 96, 128)  # the forward with attention dropout (dense, no score modifier)
# The warp-specialized backward with dropout (on the 128-wide tiles at every bucket).
WGMMA_BWD_DROPOUT = (64, 96, 128)
# Backward (dK/dV and dQ kernels of bwd.cuh, which bwd_ws.cuh builds on).
WGMMA_BWD = (64, 96, 128)
# The wide backward (bwd_wide.cuh, head dims 129..256).
WGMMA_BWD_WIDE = (192, 256)

# ---- fp16 / bf16, split-KV decode (tiers/mma/decode.cuh) ----
# Head-dim buckets; the tile shapes follow from the rows of a call (decode.cuh: Config, 16, 32 or
# 64 packed query rows, 16 keys per warp per step), the 96 KiB ring budget and the GPU class
# (decode.cuh: ConfigPolicy, the half-step tiles where two steps do not fit 99 KiB).
DECODE_BUCKETS = (64, 128, 256)

SIMT_BUCKETS = tuple(SIMT_FWD)
MMA_BUCKETS = tuple(MMA_FWD)
