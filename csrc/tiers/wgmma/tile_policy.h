// tiers/wgmma/tile_policy.h — every tile choice of the Hopper family, forward and backward, in
// one place: the launchers (fwd/launch.cuh, bwd_ws.cuh, bwd.cuh, bwd_wide.cuh) and the family's
// contract (config.h, family.h) read them here. Which head-dim buckets have instances is the tile
// table's (csrc/instances/tiles.py); why each shape won, with the measurements, is in
// OPTIMIZATION.md. Host and device code; no switch is read here.
#pragma once

namespace flash_cuda {
namespace wgmma {

// ---- head dims served on tiles wider than d ----
// d <= 32 runs the 64-wide tiles with the products over d 32 deep (TMA's zeros past d), for
// dense batches without score modifiers or dropout (and, backward, the one-pass kernel): what was
// measured there (config.h: narrow_fwd_applies / narrow_bwd_applies). d 65..96 runs the 128-wide
// tiles 96 deep, which at d = 96 still beats the mma.sync kernels of the 96 bucket by far.
constexpr int kNarrowDepth = 32;
constexpr int tile_width(int bucket) { return bucket == 96 ? 128 : bucket; }

// The forward's V tiles, P V's N and O's accumulator: as wide as the Q / K tiles, except for
// d 65..96 (the tiles 128 wide, 96 deep), where they are natively 96 wide. P V over 128
// columns would run 96 + 128 = 224 units of tensor work per key step for 192 useful ones (+14%),
// and O would take 64 accumulator registers instead of 48. V is then stored as three 32-column
// slabs with the 64-byte swizzle (arch/sm90.cuh; a 96-column row is 192 bytes, which no single
// 128-byte-swizzled slab holds), read by one m64n96k16 per k-step. Q and K keep the 128-wide
// 128-byte-swizzled tiles (Q K^T stops after the 6 k-steps of d 96 already); O is staged in
// Q's layout, of which only the first 96 columns are written (its TMA store clips at d).
// The backward's warp-specialized kernel has its own switch (kBwdD96Native below).
constexpr int fwd_value_width(int width, int depth) { return width == 128 && depth == 96 ? 96 : width; }

// ---- forward (fwd/) ----
// Query rows per consumer warpgroup: one wgmma M of 64.
constexpr int kFwdRowsPerConsumer = 64;

// The default tiles of a head-dim bucket: keys per step, K/V stages, consumer warpgroups (64
// query rows each), and the depth of S = Q K^T (the bucket's head dims; the tile keeps its width).
//   Keys per step: 128 up to d = 128; 64 beyond, where two stages of 128-key K/V tiles and Q
//   would not fit next to each other (d = 256: Q 64 KiB + 4 x 32 KiB at 64 keys); d = 256's
//   overlapped instances take 80 where kFwdD256KeySteps80 says so (below).
//   Two stages fit every head dim; more only at d = 64, where they did not pay.
// kSerialOnly (d = 256, the extended instances): softcap's C and 1 / C, ALiBi's slope and a
// packed sequence's offsets beside O's 128 accumulator registers spill with the overlapped
// schedule's second S tile, so those instances have the serial schedule alone.
constexpr int fwd_block_n(int width) { return width <= 128 ? 128 : 64; }

// d = 256, the overlapped schedule (the plain instances and the GQA-packed kernel): 80-key steps
// instead of 64. Q 64 KiB + 2 stages x (K 40 KiB + V 40 KiB) = 224 KiB, with the barriers and
// the swizzle's 1024 bytes of slack inside 227 KiB (O has no staging tile of its own at d = 256:
// kFwdStageOInQ below). Fewer steps per tile, so fewer per-step waits and hand-overs per key;
// Q K^T runs m64n80k16, P V 5 k-steps of 16 keys. The serial-only (extended) and the dropout
// instances keep 64: their consumers have no registers for S of 80 keys beside what they hold.
// A switch of its own so that the two d = 256 levers (this one and kFwdTurnsAtD256) can be
// measured apart: flip it in a copy of the tree and compare with bench/ab_builds.py.
constexpr bool kFwdD256KeySteps80 = true;
constexpr int fwd_overlap_block_n(int width) { return width == 256 && kFwdD256KeySteps80 ? 80 : fwd_block_n(width); }

// The ping-pong "turn" barriers between the consumer warpgroups (fwd/mainloop.cuh: Turns), which
// order their product groups so that one warpgroup's softmax runs under the other's products.
// At d = 256 the products of one step (P V over 256 columns beside Q K^T 256 deep) are long next
// to the softmax of 80 keys, so the tensor cores stay busy without the ordering and the hand-overs
// only make one warpgroup wait for the other's issue. Off there when false. d = 192 keeps them:
// without them it measured the same (OPTIMIZATION.md), so its kernel stays as it was.
constexpr bool kFwdTurnsAtD256 = false;
constexpr bool fwd_turn_barriers(int width) { return width < 256 || kFwdTurnsAtD256; }

// Where O's own staging tile does not fit (d = 256: fwd/smem.h), O is staged in Q's tile
// instead and leaves by TMA stores as at the other head dims: each consumer warp writes its 16
// rows over its own rows of Q once its warpgroup's last S = Q K^T is done, and Q is released to
// the producer only after the TMA unit has read them: the stores become 16-row boxes, and the
// next tile's Q loads after this tile's epilogue instead of under its last P V. When false, each
// consumer thread stores its own pairs of O from registers.
constexpr bool kFwdStageOInQ = true;

// The FP8 forward (fwd/launch.cuh: run_fwd_sm90_fp8): 128-row tiles, two stages. At d = 128 its
// products take half the 16-bit time while the softmax per key is the same, so it runs 192-key
// steps: fewer per-step reductions, waits and hand-overs per key (V^T then in 64-key slabs;
// 256 spills beside O and two S tiles). d = 64, whose softmax outweighs its products further,
// takes them too; d = 256 keeps 128.
constexpr int fwd_fp8_block_n(int width) { return width <= 128 ? 192 : 128; }

template <int kBucket, bool kExtended = false>
struct FwdTile {
  static constexpr int kWidth = tile_width(kBucket);
  static constexpr int kBlockN = kExtended ? fwd_block_n(kWidth) : fwd_overlap_block_n(kWidth);
  static constexpr int kStages = 2;
  static constexpr int kConsumerWGs = 2;
  static constexpr int kDepth = kBucket;
  static constexpr bool kSerialOnly = kBucket == 256 && kExtended;
};

// d = 64, dense batches without modifiers (kPlain): 192-row tiles, three consumer warpgroups, so
// that three warps per scheduler interleave their dependent softmax chains (d = 64 is
// latency-bound), with 128-key steps: at 160 registers a consumer holds S of 128 keys beside P
// and O once its tile loop keeps no word across the key loop (fwd/config.cuh: kLeanTileLoop).
// Short queries lose with them (fewer, partly empty tiles), hence the threshold. d <= 32 takes the
// same threshold and 96-key steps, 32 deep.
// d = 96 (the 128-wide Q / K tiles 96 deep, V and O 96 wide) takes them too, with 80-key steps
// (96 spill beside O's 48 registers), but only where no key is masked: on a causal or windowed
// call the taller diagonal tiles cost more than the third warpgroup gains.
constexpr int kFwdTallConsumerWGs = 3;
constexpr int kFwdTallBlockN = 128;
constexpr int kFwdTallBlockNNarrow = 96;
constexpr int kFwdTallBlockN96 = 80;
constexpr int kFwdTallMinSq = 2048;
constexpr bool fwd_tall_tiles(int bucket, int sq, bool masked) {
  return sq >= kFwdTallMinSq && (bucket != 96 || !masked);
}

// GQA packing (fwd/launch.cuh: run_fwd_sm90_ws_gqa) runs the bucket's default tiles, for
// Sq <= kPackGqaMaxSq (config.h: pack_gqa says why there).
constexpr int kPackGqaMaxSq = 64;

// The dropout instances: the default tiles, except 96-key steps on the 128-wide tiles: with 128
// the draws' registers beside S, P and O spill 44-56 bytes, with 96 nothing.
constexpr int fwd_dropout_block_n(int width) { return width == 128 ? 96 : fwd_block_n(width); }

// ---- backward ----
// The dK/dV and dQ kernels of bwd.cuh per bucket (bwd_ws.cuh builds on the first): the dK/dV CTA
// has kKVWarpGroups x 64 keys and steps over kKVBlockM queries; the dQ CTA has kQWarpGroups x 64
// queries and steps over kQBlockN keys. Larger steps help while the accumulators fit (d = 64: 128
// queries / keys per step; d = 128: 96 keys per dQ step). d 65..96 runs the 128-wide tiles.
template <int kKVWarpGroups_, int kKVBlockM_, int kQWarpGroups_, int kQBlockN_>
struct BwdShape {
  static constexpr int kKVWarpGroups = kKVWarpGroups_;
  static constexpr int kKVBlockM = kKVBlockM_;
  static constexpr int kQWarpGroups = kQWarpGroups_;
  static constexpr int kQBlockN = kQBlockN_;
};
template <int kBucket> struct BwdTile;
template <> struct BwdTile<64> { using Tile = BwdShape<2, 128, 2, 128>; static constexpr int kWidth = 64; };
template <> struct BwdTile<128> { using Tile = BwdShape<2, 64, 2, 96>; static constexpr int kWidth = 128; };
template <> struct BwdTile<96> { using Tile = BwdTile<128>::Tile; static constexpr int kWidth = tile_width(96); };

// The warp-specialized backward (bwd_ws.cuh) at d 65..96: on tiles natively 96 wide instead of
// the bucket's 128-wide ones (BwdTile<96>, which the cp.async kernels of bwd.cuh keep). On 128-wide
// tiles dV += P^T dO, dK += dS^T Q and dQ = dS K run N = 128 for 96 useful columns, about a
// sixth of the kernel's tensor work (S^T and dP^T already stop after 6 k-steps); dK and dV take
// 64 accumulator registers each instead of 48. Natively: Q, dO and V are three 32-column slabs
// with the 64-byte swizzle (read K-major by S^T, dP^T and MN-major by dV, dK as one m64n96k16 per
// k-step), K six 16-column slabs with the 32-byte swizzle (K-major for S^T, MN-major for dQ,
// whose two warpgroups each take 48 columns, m64n48k16: the second half starts at column 48,
// inside a 32-column slab, where no MN-major operand can start), and dQ's workspace tiles, its
// staging and dK / dV's epilogue 96 wide (config.h: bwd_tile_width). The dropout instances keep
// the 128-wide tiles (kBwdDropoutTileWidth). A switch of its own so that a copy of the tree with
// it false is the A/B baseline (bench/ab_builds.py); false compiles the kernels as before it.
constexpr bool kBwdD96Native = true;
// The width of the warp-specialized backward's tiles for a bucket's tile width and the depth of
// its products over d.
constexpr int bwd_ws_width(int width, int depth) { return kBwdD96Native && width == 128 && depth == 96 ? 96 : width; }

// Query rows per step of the warp-specialized backward at a tile width (bwd_ws.cuh:
// WsBwdConfig::kBlockM static_asserts against this): the height of its dQ workspace tiles.
constexpr int bwd_block_m(int width) { return width <= 64 ? 128 : 64; }

// The warp-specialized backward at d 97..128 steps over 80 queries instead of 64 (bwd_ws.cuh:
// TilesOf80Queries, dQ transposed) for dense calls without score modifiers or dropout from this
// many queries on (config.h: bwd_steps80); its dQ workspace tiles are then 80 rows high. Measured
// (OPTIMIZATION.md step 56): 2-3% faster from 4k, 7% slower at 1k causal, where the diagonal cuts
// more of the taller steps.
constexpr int kBwdSteps80MinSq = 4096;

// The backward with dropout runs the 128-wide tiles at every d (64-query steps): the 64-wide
// tiles' 128-query steps leave no registers for the keep bits. At d 65..96 too: kBwdD96Native
// leaves these instances on the 128-wide tiles, so that its A/B measures the kernels without
// dropout alone.
constexpr int kBwdDropoutTileWidth = 128;

// The wide backward (bwd_wide.cuh, d 129..256): 64 keys per CTA shared by both consumer
// warpgroups, 64 queries per step; a ring of three Q / dO stages where they fit (d = 192), else two.
constexpr int kWideBlockN = 64;
constexpr int kWideBlockM = 64;
constexpr int kWideMaxStages = 3;
constexpr int kWideMinStages = 2;

}  // namespace wgmma
}  // namespace flash_cuda
