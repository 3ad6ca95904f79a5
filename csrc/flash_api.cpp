// flash_api.cpp — the one file of flash_cuda that sees torch tensors.
//
// It checks the tensors once more (the Python layer validates first, with friendlier
// messages), makes sure every row is 16-byte aligned, allocates outputs and workspaces,
// fills the plain FwdParams / BwdParams structs and dispatches on (tier, dtype, head-dim
// bucket) to the kernel entry points declared in launch.h.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "core/gpu_class.h"
#include "core/mask.cuh"
#include "flash_params.h"
#include "launch.h"

namespace flash_cuda {
namespace {

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "flash_cuda: unsupported dtype ", t.scalar_type(),
                  "; accepted: float16, bfloat16, float32");
  }
}

// kAuto stays kAuto for 16-bit inputs: dispatch tries the Hopper tier first.
Tier resolve_tier(int64_t tier, DType dtype) {
  TORCH_CHECK(tier >= 0 && tier <= 4, "flash_cuda: unknown kernel tier ", tier);
  Tier t = static_cast<Tier>(tier);
  if (t == Tier::kAuto && dtype == DType::kFloat32) t = Tier::kSimt;
  TORCH_CHECK(t != Tier::kSimt || dtype == DType::kFloat32,
              "flash_cuda: the 'simt' kernel takes float32 inputs only");
  TORCH_CHECK((t != Tier::kMma && t != Tier::kWgmma && t != Tier::kWgmmaWs) || dtype != DType::kFloat32,
              "flash_cuda: the 'mma' and 'wgmma' kernels take float16 or bfloat16 inputs only");
  return t;
}

// Every kernel reads rows with 16-byte vectors: the base pointer and every stride that
// matters (of a dimension longer than 1) must be 16-byte multiples. Views that are not
// get a packed copy (the common layouts — contiguous, (B,S,H,D).transpose(1,2) — never do).
at::Tensor aligned(const at::Tensor& t) {
  const int64_t esize = t.element_size();
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int i = 0; i + 1 < t.dim() && ok; ++i) {
    if (t.size(i) > 1 && (t.stride(i) * esize) % 16 != 0) ok = false;
  }
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// The two layouts a call can have. Dense: q (B, Hq, Sq, D), k / v (B, Hkv, Sk, D). Varlen (packed):
// q (total_q, Hq, D), k / v (total_k, Hkv, D) and cu_seqlens of B + 1 int32 entries; Sq / Sk are
// then max_seqlen_q / max_seqlen_k. Every dimension is read through these names, never by index.
struct Shape {
  bool varlen = false;
  int64_t B = 0, Hq = 0, Hkv = 0, Sq = 0, Sk = 0, D = 0;
  int64_t rows_q = 0, rows_k = 0;  // rows of q and k per head: Sq / Sk dense, total_q / total_k varlen
  // The (batch, head, row) strides of a q-like or k-like tensor, as the params want them: a
  // packed tensor has no batch stride (its sequences are told apart by cu_seqlens).
  void strides(const at::Tensor& t, int64_t& batch, int64_t& head, int64_t& row) const {
    batch = varlen ? 0 : t.stride(0);
    head = t.stride(1);
    row = varlen ? t.stride(0) : t.stride(2);
  }
  // Shape of lse (and of the row statistics): dense (B, Hq, Sq), varlen (Hq, total_q).
  std::vector<int64_t> lse_shape() const {
    return varlen ? std::vector<int64_t>{Hq, rows_q} : std::vector<int64_t>{B, Hq, Sq};
  }
  bool empty() const { return B == 0 || Hq == 0 || rows_q == 0 || rows_k == 0 || Sq == 0 || Sk == 0; }
};

// The masking and modifier arguments of a call, as the Python layer passes them.
struct MaskArgs {
  int64_t window_left = -1, window_right = -1;
  double softcap = 0.0;
  std::optional<at::Tensor> alibi_slopes, cu_seqlens_q, cu_seqlens_k;
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  bool varlen() const { return cu_seqlens_q.has_value(); }
  bool any_feature() const {
    return window_left >= 0 || (window_right >= 0) || softcap > 0 || alibi_slopes.has_value() || varlen();
  }
};

Shape check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const MaskArgs& m) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "flash_cuda: q, k, v must be CUDA tensors");
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(),
              "flash_cuda: q, k, v must be on the same device");
  TORCH_CHECK(m.cu_seqlens_q.has_value() == m.cu_seqlens_k.has_value(),
              "flash_cuda: pass both cu_seqlens_q and cu_seqlens_k, or neither");
  const bool varlen = m.varlen();
  const int64_t ndim = varlen ? 3 : 4;
  TORCH_CHECK(q.dim() == ndim && k.dim() == ndim && v.dim() == ndim,
              varlen ? "flash_cuda: varlen q, k, v must be 3-d (total_rows, heads, head_dim)"
                     : "flash_cuda: q, k, v must be 4-d (batch, heads, seq, head_dim)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "flash_cuda: q, k, v must share one dtype");
  dtype_of(q);
  TORCH_CHECK(q.stride(-1) == 1 && k.stride(-1) == 1 && v.stride(-1) == 1,
              "flash_cuda: the last dimension of q, k, v must be contiguous (stride 1)");
  TORCH_CHECK(k.sizes() == v.sizes(), "flash_cuda: k and v shapes differ");
  Shape s;
  s.varlen = varlen;
  s.D = q.size(-1);
  TORCH_CHECK(k.size(-1) == s.D, "flash_cuda: q, k, v head dims differ");
  if (varlen) {
    const at::Tensor& cq = *m.cu_seqlens_q;
    const at::Tensor& ck = *m.cu_seqlens_k;
    for (const at::Tensor* c : {&cq, &ck}) {
      TORCH_CHECK(c->scalar_type() == at::kInt && c->dim() == 1 && c->is_contiguous(),
                  "flash_cuda: cu_seqlens must be contiguous 1-d int32 tensors");
      TORCH_CHECK(c->device() == q.device(), "flash_cuda: cu_seqlens must be on q's device");
    }
    TORCH_CHECK(cq.size(0) == ck.size(0) && cq.size(0) >= 2,
                "flash_cuda: cu_seqlens_q and cu_seqlens_k must both have batch + 1 >= 2 entries");
    TORCH_CHECK(m.max_seqlen_q >= 0 && m.max_seqlen_k >= 0, "flash_cuda: max_seqlen must be >= 0");
    s.B = cq.size(0) - 1;
    s.Hq = q.size(1);
    s.Hkv = k.size(1);
    s.rows_q = q.size(0);
    s.rows_k = k.size(0);
    s.Sq = std::min(m.max_seqlen_q, s.rows_q);  // no sequence is longer than its tensor
    s.Sk = std::min(m.max_seqlen_k, s.rows_k);
    TORCH_CHECK(s.rows_q < (int64_t(1) << 31) && s.rows_k < (int64_t(1) << 31),
                "flash_cuda: varlen row counts must be < 2^31");
  } else {
    s.B = q.size(0);
    s.Hq = q.size(1);
    s.Hkv = k.size(1);
    s.Sq = q.size(2);
    s.Sk = k.size(2);
    s.rows_q = s.Sq;
    s.rows_k = s.Sk;
    TORCH_CHECK(k.size(0) == s.B, "flash_cuda: q, k, v batch sizes differ");
  }
  TORCH_CHECK(s.Hkv > 0 || s.Hq == 0, "flash_cuda: k/v have zero heads");
  TORCH_CHECK(s.Hkv == 0 || s.Hq % s.Hkv == 0, "flash_cuda: query heads (", s.Hq,
              ") must be a multiple of key/value heads (", s.Hkv, ")");
  TORCH_CHECK(s.D % 8 == 0 && s.D >= 8 && s.D <= 256,
              "flash_cuda: head dim must be a multiple of 8 in [8, 256], got ", s.D);
  TORCH_CHECK(s.B < 65536 && s.Hq < 65536, "flash_cuda: batch and heads must be < 65536");
  TORCH_CHECK(s.Sq < (int64_t(1) << 31) && s.Sk < (int64_t(1) << 31),
              "flash_cuda: sequence lengths must be < 2^31");
  TORCH_CHECK(m.window_left >= -1 && m.window_right >= -1, "flash_cuda: window sizes must be >= -1");
  TORCH_CHECK(std::isfinite(m.softcap) && m.softcap >= 0, "flash_cuda: softcap must be finite and >= 0");
  if (m.alibi_slopes.has_value()) {
    const at::Tensor& a = *m.alibi_slopes;
    TORCH_CHECK(a.scalar_type() == at::kFloat && a.is_contiguous() && a.device() == q.device(),
                "flash_cuda: alibi_slopes must be a contiguous float32 tensor on q's device");
    TORCH_CHECK((a.dim() == 1 && a.size(0) == s.Hq) || (a.dim() == 2 && a.size(0) == s.B && a.size(1) == s.Hq),
                "flash_cuda: alibi_slopes must have shape (heads,) or (batch, heads)");
  }
  const auto prop = at::cuda::getDeviceProperties(q.device().index());
  TORCH_CHECK(prop->major >= 8, "flash_cuda: needs a GPU of compute capability 8.0 or newer, got ",
              prop->major, ".", prop->minor);
  return s;
}

void fill_fwd(FwdParams& p, const Shape& s, const MaskArgs& m, const at::Tensor& q, const at::Tensor& k,
              const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, double scale) {
  const bool vl = s.varlen;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  s.strides(q, p.q_batch_stride, p.q_head_stride, p.q_row_stride);
  s.strides(k, p.k_batch_stride, p.k_head_stride, p.k_row_stride);
  s.strides(v, p.v_batch_stride, p.v_head_stride, p.v_row_stride);
  s.strides(out, p.o_batch_stride, p.o_head_stride, p.o_row_stride);
  p.softmax_lse = lse.data_ptr<float>();
  // Row statistics: dense [b][hq][sq], varlen [hq][total_q] (flash_params.h).
  p.stat_batch_stride = vl ? 0 : s.Hq * s.Sq;
  p.stat_head_stride = vl ? s.rows_q : s.Sq;
  p.b = static_cast<int>(s.B);
  p.hq = static_cast<int>(s.Hq);
  p.hkv = static_cast<int>(s.Hkv);
  p.sq = static_cast<int>(s.Sq);
  p.sk = static_cast<int>(s.Sk);
  p.d = static_cast<int>(s.D);
  // Kernels take the row max of the raw scores and fold the scale into the exp2's FFMA,
  // which needs scale >= 0 (callers fold a negative scale into q). scale_log2 stays a
  // normal float so that masked (-inf) scores times it stay -inf, never NaN; the exact
  // p.scale (0 included) is what the gradients use.
  TORCH_CHECK(scale >= 0, "flash_cuda: internal error: negative scale reached the kernels");
  p.scale = static_cast<float>(scale);
  p.scale_log2 = std::max(static_cast<float>(scale * M_LOG2E), 1e-30f);
  // Window sides beyond every key are the same as unbounded: keeps the int arithmetic small.
  const int64_t span = s.Sq + s.Sk;
  p.window_left = m.window_left < 0 ? -1 : static_cast<int>(std::min(m.window_left, span));
  p.window_right = m.window_right < 0 ? -1 : static_cast<int>(std::min(m.window_right, span));
  const AttnMask dense_mask = AttnMask::make(p.sq, p.sk, p.window_left, p.window_right);
  p.diag_lo = dense_mask.diag_lo;
  p.diag_hi = dense_mask.diag_hi;
  p.softcap = static_cast<float>(m.softcap);
  if (m.alibi_slopes.has_value()) {
    p.alibi_slopes = m.alibi_slopes->data_ptr<float>();
    p.alibi_batch_stride = m.alibi_slopes->dim() == 2 ? s.Hq : 0;
  }
  if (vl) {
    p.cu_seqlens_q = m.cu_seqlens_q->data_ptr<int32_t>();
    p.cu_seqlens_k = m.cu_seqlens_k->data_ptr<int32_t>();
    p.total_q = static_cast<int>(s.rows_q);
    p.total_k = static_cast<int>(s.rows_k);
  }
  p.dtype = dtype_of(q);
  const auto prop = at::cuda::getDeviceProperties(q.device().index());
  // Under FLASH_CUDA_EMULATE_ARCH (core/gpu_class.h) the dispatcher sees that GPU class.
  p.sm_arch = emulated_arch() > 0 ? emulated_arch() : prop->major * 10 + prop->minor;
  p.num_sms = prop->multiProcessorCount;
}

// FLASH_CUDA_POISON_OUTPUTS=1 (set by the test suite) fills every output with NaN before
// the kernels run, so an element a kernel forgets to write fails the comparison instead of
// silently keeping whatever the caching allocator left there (often the right answer of an
// identical earlier call).
bool poison_outputs() {
  static const bool poison = [] {
    const char* env = std::getenv("FLASH_CUDA_POISON_OUTPUTS");
    return env != nullptr && env[0] != '\0' && env[0] != '0';
  }();
  return poison;
}

// Smallest bucket that holds head dim d.
int simt_bucket(int d) { return d <= 32 ? 32 : d <= 64 ? 64 : d <= 128 ? 128 : 256; }
int mma_bucket(int d) {
  return d <= 32 ? 32 : d <= 64 ? 64 : d <= 96 ? 96 : d <= 128 ? 128 : d <= 192 ? 192 : 256;
}

// Calls Fn::template run<Bucket>(args...) for the smallest bucket of `buckets` that holds d.
template <typename Fn, int... kBuckets, typename... Args>
auto with_bucket(int d, std::integer_sequence<int, kBuckets...>, Args&&... args) {
  using R = decltype(Fn::template run<256>(args...));
  R result{};
  bool done = false;
  ((!done && d <= kBuckets ? (result = Fn::template run<kBuckets>(args...), done = true) : false), ...);
  return result;
}
using SimtBuckets = std::integer_sequence<int, 32, 64, 128, 256>;
using MmaBuckets = std::integer_sequence<int, 32, 64, 96, 128, 192, 256>;
using Sm90Buckets = std::integer_sequence<int, 64, 128>;          // the cp.async forward
using Sm90BwdBuckets = std::integer_sequence<int, 64, 96, 128>;  // 96: the 128-wide tiles
using Sm90WsBuckets = std::integer_sequence<int, 64, 96, 128, 192, 256>;  // tier 4 alone
using Sm90WideBwdBuckets = std::integer_sequence<int, 192, 256>;  // the wide backward (d 129..256)

constexpr int kF16 = static_cast<int>(DType::kFloat16);
constexpr int kBF16 = static_cast<int>(DType::kBFloat16);

// Each entry point behind a bucket switch (and, for 16-bit kernels, a dtype switch). They
// return bool so that with_bucket has one shape: false means "this tier does not apply".
struct SimtFwd {
  template <int kD> static bool run(const FwdParams& p, cudaStream_t s) { run_fwd_simt<kD>(p, s); return true; }
};
struct SimtBwd {
  template <int kD> static bool run(const BwdParams& p, cudaStream_t s) { run_bwd_simt<kD>(p, s); return true; }
};
struct SimtFwdPlan {
  template <int kD> static int64_t run(FwdParams& p) { return plan_fwd_simt<kD>(p); }
};
struct SimtBwdPlan {
  template <int kD> static int64_t run(BwdParams& p) { return plan_bwd_simt<kD>(p); }
};
template <int kDType, int kVariant> struct MmaFwd {
  template <int kD> static bool run(const FwdParams& p, cudaStream_t s) {
    run_fwd_mma<kDType, kD, kVariant>(p, s);
    return true;
  }
};
template <int kDType, int kVariant> struct MmaBwd {
  template <int kD> static bool run(const BwdParams& p, cudaStream_t s) {
    run_bwd_mma<kDType, kD, kVariant>(p, s);
    return true;
  }
};
template <int kDType, int kVariant> struct Sm90Fwd {
  template <int kD> static bool run(const FwdParams& p, cudaStream_t s) { return run_fwd_sm90<kDType, kD, kVariant>(p, s); }
};
template <int kDType, int kVariant> struct Sm90WsFwd {
  template <int kD> static bool run(const FwdParams& p, cudaStream_t s) {
    if constexpr (kVariant == kPlain && kD <= 128) {
      // GQA-packed tiles where they pay (launch.h: ws_pack_gqa); the launcher may decline.
      if (ws_pack_gqa(p) && run_fwd_sm90_ws_gqa<kDType, kD>(p, s)) return true;
    }
    return run_fwd_sm90_ws<kDType, kD, kVariant>(p, s);
  }
};
template <int kDType, int kVariant> struct Sm90Bwd {
  template <int kD> static bool run(const BwdParams& p, cudaStream_t s) { return run_bwd_sm90<kDType, kD, kVariant>(p, s); }
};
template <int kDType, int kVariant> struct Sm90WideBwd {
  template <int kD> static bool run(const BwdParams& p, cudaStream_t s) {
    return run_bwd_sm90_wide<kDType, kD, kVariant>(p, s);
  }
};

// The static switches over dtype and variant, then the bucket: Entry<kDType, kVariant> is one
// of the structs above. Only the backwards (mma.sync, Hopper) have kSoftcapGrad instances
// (kWithSoftcapGrad).
template <template <int, int> class Entry, typename Buckets, bool kWithSoftcapGrad = false, typename Params>
bool with_dtype_variant(const Params& p, Variant variant, cudaStream_t stream) {
  const bool f16 = p.dtype == DType::kFloat16;
  switch (variant) {
    case kPlain:
      return f16 ? with_bucket<Entry<kF16, kPlain>>(p.d, Buckets{}, p, stream)
                 : with_bucket<Entry<kBF16, kPlain>>(p.d, Buckets{}, p, stream);
    case kExtended:
      return f16 ? with_bucket<Entry<kF16, kExtended>>(p.d, Buckets{}, p, stream)
                 : with_bucket<Entry<kBF16, kExtended>>(p.d, Buckets{}, p, stream);
    default:
      if constexpr (kWithSoftcapGrad) {
        return f16 ? with_bucket<Entry<kF16, kSoftcapGrad>>(p.d, Buckets{}, p, stream)
                   : with_bucket<Entry<kBF16, kSoftcapGrad>>(p.d, Buckets{}, p, stream);
      }
      TORCH_CHECK(false, "flash_cuda: internal error: no softcap-gradient instance for this tier");
  }
}

// The Hopper tier serves head-dim buckets 64 and 128 (every d in 33..128: d 65..96 runs the
// 128-wide kernels, TMA filling the columns past d with zeros, which at d = 96 still beats the
// mma.sync kernels of the 96 bucket by far; OPTIMIZATION.md); it returns false, having launched
// nothing, where it does not apply (other head dims, a GPU other than sm_90, a build without the
// 90a target, softcap's backward where its warp-specialized kernel does not run).
bool sm90_bucket(int d) { return d > 32 && d <= 128; }
bool sm90_ws_bucket(int d) { return d > 32 && d <= 256; }
// The wide warp-specialized backward (launch.h: sm90_bwd_wide): kernel='auto', dense or packed
// batches, softcap and ALiBi included, d = 129..256, deterministic=False, unless its switch is 0.
// It also needs the dq_accum workspace (bwd allocates it under the same condition) and may still
// decline (a view TMA cannot address, a build without the 90a target): the mma.sync backward runs
// then.
bool sm90_wide_bwd_applies(const BwdParams& p, Tier tier) {
  return tier == Tier::kAuto && !p.deterministic && p.sm_arch == 90 && p.d > 128 && p.d <= 256 && sm90_bwd_wide();
}

// Whether the call goes to the warp-specialized forward (its launcher may still decline, having
// launched nothing: a view TMA cannot address, a build without the 90a target). kernel='auto':
// every head dim it has (33..256), dense and packed batches, softcap, ALiBi; kernel='wgmma': the
// head dims the Hopper backward also has; tier 4: always.
bool ws_fwd_applies(const FwdParams& p, Tier tier) {
  if (p.sm_arch != 90 || !sm90_ws_bucket(p.d)) return false;
  if (tier == Tier::kWgmmaWs) return true;
  if (!ws_enabled()) return false;
  if (tier == Tier::kWgmma) return sm90_bucket(p.d);
  return tier == Tier::kAuto;
}

constexpr const char* kNoWgmma =
    "flash_cuda: kernel='wgmma' needs an sm_90 GPU (H100/H200), a flash_cuda build that includes "
    "the 90a target, and a head dim in 33..128 (with softcap > 0 its backward also needs "
    "deterministic=False, FLASH_CUDA_SM90_BWD unset or 'ws', and inputs TMA can address); "
    "use kernel='auto' or 'mma'";
// Softcap's derivative is in the warp-specialized Hopper backward only (sm90_bwd_ws.cuh), which
// adds dQ in a varying order: not with deterministic=True, nor with the ablation modes.
constexpr const char* kNoWgmmaSoftcap =
    "flash_cuda: kernel='wgmma' runs softcap's backward on the warp-specialized Hopper kernel only, "
    "which needs deterministic=False and FLASH_CUDA_SM90_BWD unset or 'ws'; use kernel='auto' or "
    "'mma'";

void dispatch_fwd(const FwdParams& p, Tier tier, cudaStream_t stream) {
  if (tier == Tier::kSimt) {
    with_bucket<SimtFwd>(p.d, SimtBuckets{}, p, stream);
    return;
  }
  const Variant variant = variant_of(p, /*backward=*/false);
  if (tier == Tier::kWgmmaWs) {
    const bool launched = sm90_ws_bucket(p.d) && with_dtype_variant<Sm90WsFwd, Sm90WsBuckets>(p, variant, stream);
    TORCH_CHECK(launched,
                "flash_cuda: the warp-specialized forward (tier 4) needs an sm_90 GPU, a build with the "
                "90a target, head dim 33..256, and "
                "16-byte aligned strides");
    return;
  }
  if (tier == Tier::kAuto || tier == Tier::kWgmma) {
    // The warp-specialized forward where it applies, else the cp.async one.
    if (ws_fwd_applies(p, tier) && with_dtype_variant<Sm90WsFwd, Sm90WsBuckets>(p, variant, stream)) return;
    if (sm90_bucket(p.d) && with_dtype_variant<Sm90Fwd, Sm90Buckets>(p, variant, stream)) return;
    TORCH_CHECK(tier == Tier::kAuto, kNoWgmma);
  }
  with_dtype_variant<MmaFwd, MmaBuckets>(p, variant, stream);
}

// params.dq_accum is read only by the Hopper backward, which also writes dq from it.
void dispatch_bwd(const BwdParams& p, Tier tier, cudaStream_t stream) {
  if (tier == Tier::kWgmmaWs) tier = Tier::kAuto;  // the warp-specialized forward has no backward of its own
  if (tier == Tier::kSimt) {
    with_bucket<SimtBwd>(p.d, SimtBuckets{}, p, stream);
    return;
  }
  const Variant variant = variant_of(p, /*backward=*/true);
  if ((tier == Tier::kAuto || tier == Tier::kWgmma) && sm90_bucket(p.d) &&
      with_dtype_variant<Sm90Bwd, Sm90BwdBuckets, /*kWithSoftcapGrad=*/true>(p, variant, stream)) {
    return;
  }
  TORCH_CHECK(tier != Tier::kWgmma, kNoWgmma);
  if (sm90_wide_bwd_applies(p, tier) && p.dq_accum != nullptr &&
      with_dtype_variant<Sm90WideBwd, Sm90WideBwdBuckets, /*kWithSoftcapGrad=*/true>(p, variant, stream)) {
    return;
  }
  with_dtype_variant<MmaBwd, MmaBuckets, /*kWithSoftcapGrad=*/true>(p, variant, stream);
}

MaskArgs mask_args(int64_t window_left, int64_t window_right, double softcap,
                   const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& cu_seqlens_q,
                   const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  MaskArgs m;
  m.window_left = window_left;
  m.window_right = window_right;
  m.softcap = softcap;
  auto defined = [](const std::optional<at::Tensor>& t) {
    return t.has_value() && t->defined() ? t : std::optional<at::Tensor>{};
  };
  m.alibi_slopes = defined(alibi_slopes);
  m.cu_seqlens_q = defined(cu_seqlens_q);
  m.cu_seqlens_k = defined(cu_seqlens_k);
  m.max_seqlen_q = max_seqlen_q;
  m.max_seqlen_k = max_seqlen_k;
  return m;
}

// A zero-filled workspace by one cudaMemsetAsync on the current stream: at::zeros launches a
// fill kernel through the TensorIterator machinery, which costs the host several times more
// (a small call's step is bound by the host).
at::Tensor zeroed_on_stream(at::IntArrayRef shape, const at::TensorOptions& options) {
  at::Tensor t = at::empty(shape, options);
  if (t.numel() > 0) {
    C10_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, t.nbytes(), at::cuda::getCurrentCUDAStream().stream()));
  }
  return t;
}

// The fp32 tier's per-row softmax statistics (flash_params.h: softmax_stats) travel from the
// forward to the backward as `aux`: lse's shape + (2,) for float32, empty otherwise.
at::Tensor make_aux(const Shape& s, const at::Tensor& q) {
  if (q.scalar_type() != at::kFloat) return at::empty({0}, q.options().dtype(at::kFloat));
  std::vector<int64_t> shape = s.lse_shape();
  shape.push_back(2);
  return at::zeros(shape, q.options().dtype(at::kFloat));
}

}  // namespace

// out, lse, aux = fwd(q, k, v, scale, window_left, window_right, softcap, alibi_slopes,
//                     cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, tier)
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, double scale, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, int64_t tier) {
  const MaskArgs m = mask_args(window_left, window_right, softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k);
  const Shape s = check_qkv(q_in, k_in, v_in, m);
  TORCH_CHECK(std::isfinite(scale), "flash_cuda: scale must be finite");
  const Tier t = resolve_tier(tier, dtype_of(q_in));

  at::Tensor out = at::empty_like(q_in);
  at::Tensor lse = at::empty(s.lse_shape(), q_in.options().dtype(at::kFloat));
  at::Tensor aux = make_aux(s, q_in);
  if (s.empty()) {  // no query, or no key at all: every row is empty
    out.zero_();
    lse.fill_(-INFINITY);
    return {out, lse, aux};
  }

  const c10::cuda::CUDAGuard guard(q_in.device());
  // softmax(scale * q.k) with scale < 0 is softmax(|scale| * (-q).k).
  const at::Tensor q = aligned(scale < 0 ? q_in.neg() : q_in);
  const at::Tensor k = aligned(k_in), v = aligned(v_in);
  scale = std::abs(scale);
  if (poison_outputs()) {
    out.fill_(NAN);
    lse.fill_(NAN);
  }
  FwdParams p;
  fill_fwd(p, s, m, q, k, v, out, lse, scale);
  if (aux.numel() > 0) p.softmax_stats = aux.data_ptr<float>();
  at::Tensor workspace;  // partial results of split key ranges (fp32 tier), if the plan splits
  if (t == Tier::kSimt) {
    const int64_t floats = with_bucket<SimtFwdPlan>(p.d, SimtBuckets{}, p);
    if (floats > 0) {
      workspace = at::empty({floats}, q.options().dtype(at::kFloat));
      p.o_accum = workspace.data_ptr<float>();
    }
  }
  at::Tensor tile_counter;  // the warp-specialized Hopper forward's tile scheduler, where it may run
  if (ws_fwd_applies(p, t)) {
    tile_counter = zeroed_on_stream({1}, q.options().dtype(at::kInt));
    p.tile_counter = tile_counter.data_ptr<int>();
  }
  dispatch_fwd(p, t, at::cuda::getCurrentCUDAStream().stream());
  return {out, lse, aux};
}

// dq, dk, dv = bwd(dout, q, k, v, out, lse, aux, dlse, scale, window_left, window_right, softcap,
//                  alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic, tier)
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const at::Tensor& aux_in,
    const std::optional<at::Tensor>& dlse_in, double scale, int64_t window_left, int64_t window_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    bool deterministic, int64_t tier) {
  const MaskArgs m = mask_args(window_left, window_right, softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k);
  const Shape s = check_qkv(q_in, k_in, v_in, m);
  TORCH_CHECK(std::isfinite(scale), "flash_cuda: scale must be finite");
  const Tier t = resolve_tier(tier, dtype_of(q_in));
  TORCH_CHECK(t != Tier::kWgmma || m.softcap == 0 || (!deterministic && sm90_bwd_ws()), kNoWgmmaSoftcap);
  TORCH_CHECK(dout_in.sizes() == q_in.sizes() && out_in.sizes() == q_in.sizes(),
              "flash_cuda: dout and out must have q's shape");
  TORCH_CHECK(dout_in.scalar_type() == q_in.scalar_type() && out_in.scalar_type() == q_in.scalar_type(),
              "flash_cuda: dout and out must have q's dtype");
  TORCH_CHECK(dout_in.device() == q_in.device() && out_in.device() == q_in.device() &&
                  lse_in.device() == q_in.device(),
              "flash_cuda: dout, out, lse must be on q's device");
  TORCH_CHECK(lse_in.scalar_type() == at::kFloat && lse_in.sizes() == at::IntArrayRef(s.lse_shape()),
              "flash_cuda: lse must be float32 of shape (B, Hq, Sq), or (Hq, total_q) for varlen");

  // The fp32 tier's default backward adds dQ with float atomics straight into dq (fp32):
  // dq starts at zero. Every other path writes each gradient element exactly once.
  const bool dq_atomic = t == Tier::kSimt && !deterministic;
  at::Tensor dq = dq_atomic ? at::zeros_like(q_in) : at::empty_like(q_in);
  at::Tensor dk = at::empty_like(k_in);
  at::Tensor dv = at::empty_like(v_in);
  if (s.empty()) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv};
  }

  const c10::cuda::CUDAGuard guard(q_in.device());
  const bool negative_scale = scale < 0;  // see fwd: the kernels saw -q and |scale|
  const at::Tensor q = aligned(negative_scale ? q_in.neg() : q_in);
  const at::Tensor k = aligned(k_in), v = aligned(v_in);
  const at::Tensor out = aligned(out_in);
  scale = std::abs(scale);
  // dout comes from autograd and may be any view: only stride(-1) == 1 plus alignment
  // matter to the kernels.
  at::Tensor dout = dout_in.stride(-1) == 1 ? aligned(dout_in) : dout_in.contiguous();
  const at::Tensor lse = lse_in.contiguous();
  at::Tensor dlse;
  if (dlse_in.has_value() && dlse_in->defined()) {
    TORCH_CHECK(dlse_in->sizes() == lse_in.sizes(), "flash_cuda: dlse must have lse's shape");
    dlse = dlse_in->to(at::kFloat).contiguous();
  }
  at::Tensor delta = at::empty(s.lse_shape(), q.options().dtype(at::kFloat));
  if (poison_outputs()) {
    if (!dq_atomic) dq.fill_(NAN);
    dk.fill_(NAN);
    dv.fill_(NAN);
    delta.fill_(NAN);
  }

  BwdParams p;
  fill_fwd(p, s, m, q, k, v, out, lse, scale);
  p.softmax_lse = const_cast<float*>(lse.data_ptr<float>());
  if (q_in.scalar_type() == at::kFloat) {
    TORCH_CHECK(aux_in.scalar_type() == at::kFloat && aux_in.is_contiguous() &&
                    aux_in.numel() == 2 * lse_in.numel() && aux_in.device() == q_in.device(),
                "flash_cuda: aux must be the float32 statistics the forward returned");
    p.softmax_stats = const_cast<float*>(aux_in.data_ptr<float>());
  }
  p.dout = dout.data_ptr();
  s.strides(dout, p.do_batch_stride, p.do_head_stride, p.do_row_stride);
  p.dlse = dlse.defined() ? dlse.data_ptr<float>() : nullptr;
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  s.strides(dq, p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride);
  s.strides(dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride);
  s.strides(dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride);
  p.delta = delta.data_ptr<float>();
  p.dq_accum = nullptr;  // set below for the Hopper backward's atomic dQ
  p.deterministic = deterministic;
  at::Tensor workspace;  // partial dK/dV of split key blocks (fp32 tier), if the plan splits
  if (t == Tier::kSimt) {
    const int64_t floats = with_bucket<SimtBwdPlan>(p.d, SimtBuckets{}, p);
    if (floats > 0) {
      workspace = at::empty({floats}, q.options().dtype(at::kFloat));
      p.dkv_accum = workspace.data_ptr<float>();
    }
  }
  // The Hopper backward's dQ accumulated across key blocks (launch.h: sm90_bwd_mode; the
  // warp-specialized kernel, dense and packed batches, by default): a zero-filled fp32 workspace
  // of about B * Hq * Sq * D * 4 bytes (packed: Hq * total_q * D * 4 plus a partial tile per
  // sequence, launch.h: sm90_dq_accum_floats), which the kernels' launcher converts into dq.
  // Softcap's backward has it in the warp-specialized kernel only (the atomic mode's cp.async
  // kernel has no softcap derivative: mma.sync runs it, without a workspace).
  at::Tensor dq_accum;
  const bool softcap_grad = variant_of(p, /*backward=*/true) == kSoftcapGrad;
  // The wide backward (d = 129..256) adds into the same workspace in
  // its row layout (dispatch_bwd: sm90_wide_bwd_applies; tier 4 runs kernel='auto's backward).
  const Tier bwd_tier = t == Tier::kWgmmaWs ? Tier::kAuto : t;
  const bool wide_bwd = sm90_wide_bwd_applies(p, bwd_tier);
  if ((t == Tier::kAuto || t == Tier::kWgmma || t == Tier::kWgmmaWs) && !deterministic && p.sm_arch == 90 &&
      ((sm90_bucket(p.d) && (sm90_bwd_ws() || (sm90_dq_atomic() && !softcap_grad))) || wide_bwd)) {
    dq_accum = zeroed_on_stream({sm90_dq_accum_floats(p, lse.numel())}, q.options().dtype(at::kFloat));
    p.dq_accum = dq_accum.data_ptr<float>();
  }
  dispatch_bwd(p, t, at::cuda::getCurrentCUDAStream().stream());
  if (negative_scale) dq.neg_();
  return {dq, dk, dv};
}

}  // namespace flash_cuda

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_cuda kernels (use flash_cuda.attention / varlen_attention, not this module)";
  m.def("fwd", &flash_cuda::fwd, "attention forward: (out, lse, aux)", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("scale"), py::arg("window_left"), py::arg("window_right"), py::arg("softcap"),
        py::arg("alibi_slopes"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"),
        py::arg("max_seqlen_k"), py::arg("tier"));
  m.def("bwd", &flash_cuda::bwd, "attention backward: (dq, dk, dv)", py::arg("dout"), py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("aux"), py::arg("dlse"),
        py::arg("scale"), py::arg("window_left"), py::arg("window_right"), py::arg("softcap"),
        py::arg("alibi_slopes"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"),
        py::arg("max_seqlen_k"), py::arg("deterministic"), py::arg("tier"));
}
