// api/flash_api.cpp — the one file of flash_cuda that sees torch tensors.
//
// It checks the tensors once more (the Python layer validates first, with friendlier
// messages), makes sure every row is 16-byte aligned, allocates outputs and the workspaces the
// families plan, fills the plain FwdParams / BwdParams structs and picks the kernel family
// (tiers/<family>/family.h: each one answers whether it applies, what workspace it needs, and
// runs). Nothing here knows a tile, a bucket or a kernel.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../arch/gpu_class.h"
#include "../core/dropout.cuh"
#include "../core/mask.cuh"
#include "../include/ablation.h"
#include "../include/params.h"
#include "../tiers/mma/family.h"
#include "../tiers/simt/family.h"
#include "../tiers/wgmma/family.h"

namespace flash_cuda {
namespace {

// The binding's checks: FLASH_CHECK(cond, values...) raises RuntimeError with the values in the
// message. The message is built without iostreams (std::to_string for numbers): with some torch
// builds, an extension that formats a number through std::ostream crashes the process, and
// TORCH_CHECK with values does so (a bare string literal raised).
inline void append(std::string& s, const char* x) { s += x; }
inline void append(std::string& s, const std::string& x) { s += x; }
inline void append(std::string& s, at::ScalarType x) { s += c10::toString(x); }
inline void append(std::string& s, at::IntArrayRef x) {
  s += '[';
  for (size_t i = 0; i < x.size(); ++i) s += (i ? ", " : "") + std::to_string(x[i]);
  s += ']';
}
template <typename T, typename = std::enable_if_t<std::is_arithmetic<T>::value>>
inline void append(std::string& s, T x) {
  s += std::to_string(x);
}

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::string message;
  (append(message, args), ...);
  throw std::runtime_error(message);
}
#define FLASH_CHECK(cond, ...)                      \
  do {                                              \
    if (!(cond)) ::flash_cuda::fail(__VA_ARGS__);   \
  } while (0)

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default:
      FLASH_CHECK(false, "flash_cuda: unsupported dtype ", t.scalar_type(),
                  "; accepted: float16, bfloat16, float32");
  }
}

// kAuto stays kAuto for 16-bit inputs: dispatch tries the Hopper tier first.
Tier resolve_tier(int64_t tier, DType dtype) {
  FLASH_CHECK(tier >= static_cast<int64_t>(Tier::kAuto) && tier <= static_cast<int64_t>(Tier::kWgmma),
              "flash_cuda: unknown kernel tier ", tier);
  Tier t = static_cast<Tier>(tier);
  if (t == Tier::kAuto && dtype == DType::kFloat32) t = Tier::kSimt;
  FLASH_CHECK(t != Tier::kSimt || dtype == DType::kFloat32,
              "flash_cuda: the 'simt' kernel takes float32 inputs only");
  FLASH_CHECK((t != Tier::kMma && t != Tier::kWgmma) || dtype != DType::kFloat32,
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
  // A params view: the tensor's pointer and its strides.
  template <typename Ptr>
  void view(const at::Tensor& t, Ptr& ptr, int64_t& batch, int64_t& head, int64_t& row) const {
    ptr = t.data_ptr();
    strides(t, batch, head, row);
  }
  // Shape of lse (and of the row statistics): dense (B, Hq, Sq), varlen (Hq, total_q).
  std::vector<int64_t> lse_shape() const {
    return varlen ? std::vector<int64_t>{Hq, rows_q} : std::vector<int64_t>{B, Hq, Sq};
  }
  bool empty() const { return B == 0 || Hq == 0 || rows_q == 0 || rows_k == 0 || Sq == 0 || Sk == 0; }
  // A dense call's sizes: q (B, Hq, Sq, D), k (B, Hkv, Sk, D) (the callers check that they agree).
  static Shape dense(const at::Tensor& q, const at::Tensor& k) {
    Shape s;
    s.B = q.size(0);
    s.Hq = q.size(1);
    s.Hkv = k.size(1);
    s.Sq = q.size(2);
    s.Sk = k.size(2);
    s.D = q.size(3);
    s.rows_q = s.Sq;
    s.rows_k = s.Sk;
    return s;
  }
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
  FLASH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "flash_cuda: q, k, v must be CUDA tensors");
  FLASH_CHECK(q.device() == k.device() && q.device() == v.device(),
              "flash_cuda: q, k, v must be on the same device");
  FLASH_CHECK(m.cu_seqlens_q.has_value() == m.cu_seqlens_k.has_value(),
              "flash_cuda: pass both cu_seqlens_q and cu_seqlens_k, or neither");
  const bool varlen = m.varlen();
  const int64_t ndim = varlen ? 3 : 4;
  FLASH_CHECK(q.dim() == ndim && k.dim() == ndim && v.dim() == ndim,
              varlen ? "flash_cuda: varlen q, k, v must be 3-d (total_rows, heads, head_dim)"
                     : "flash_cuda: q, k, v must be 4-d (batch, heads, seq, head_dim)");
  FLASH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "flash_cuda: q, k, v must share one dtype");
  dtype_of(q);
  FLASH_CHECK(q.stride(-1) == 1 && k.stride(-1) == 1 && v.stride(-1) == 1,
              "flash_cuda: the last dimension of q, k, v must be contiguous (stride 1)");
  FLASH_CHECK(k.sizes() == v.sizes(), "flash_cuda: k and v shapes differ");
  Shape s;
  s.varlen = varlen;
  s.D = q.size(-1);
  FLASH_CHECK(k.size(-1) == s.D, "flash_cuda: q, k, v head dims differ");
  if (varlen) {
    const at::Tensor& cq = *m.cu_seqlens_q;
    const at::Tensor& ck = *m.cu_seqlens_k;
    for (const at::Tensor* c : {&cq, &ck}) {
      FLASH_CHECK(c->scalar_type() == at::kInt && c->dim() == 1 && c->is_contiguous(),
                  "flash_cuda: cu_seqlens must be contiguous 1-d int32 tensors");
      FLASH_CHECK(c->device() == q.device(), "flash_cuda: cu_seqlens must be on q's device");
    }
    FLASH_CHECK(cq.size(0) == ck.size(0) && cq.size(0) >= 2,
                "flash_cuda: cu_seqlens_q and cu_seqlens_k must both have batch + 1 >= 2 entries");
    FLASH_CHECK(m.max_seqlen_q >= 0 && m.max_seqlen_k >= 0, "flash_cuda: max_seqlen must be >= 0");
    s.B = cq.size(0) - 1;
    s.Hq = q.size(1);
    s.Hkv = k.size(1);
    s.rows_q = q.size(0);
    s.rows_k = k.size(0);
    s.Sq = std::min(m.max_seqlen_q, s.rows_q);  // no sequence is longer than its tensor
    s.Sk = std::min(m.max_seqlen_k, s.rows_k);
    FLASH_CHECK(s.rows_q < (int64_t(1) << 31) && s.rows_k < (int64_t(1) << 31),
                "flash_cuda: varlen row counts must be < 2^31");
  } else {
    s = Shape::dense(q, k);
    FLASH_CHECK(k.size(0) == s.B, "flash_cuda: q, k, v batch sizes differ");
  }
  FLASH_CHECK(s.Hkv > 0 || s.Hq == 0, "flash_cuda: k/v have zero heads");
  FLASH_CHECK(s.Hkv == 0 || s.Hq % s.Hkv == 0, "flash_cuda: query heads (", s.Hq,
              ") must be a multiple of key/value heads (", s.Hkv, ")");
  FLASH_CHECK(s.D % 8 == 0 && s.D >= 8 && s.D <= 256,
              "flash_cuda: head dim must be a multiple of 8 in [8, 256], got ", s.D);
  FLASH_CHECK(s.B < 65536 && s.Hq < 65536, "flash_cuda: batch and heads must be < 65536");
  FLASH_CHECK(s.Sq < (int64_t(1) << 31) && s.Sk < (int64_t(1) << 31),
              "flash_cuda: sequence lengths must be < 2^31");
  FLASH_CHECK(m.window_left >= -1 && m.window_right >= -1, "flash_cuda: window sizes must be >= -1");
  FLASH_CHECK(std::isfinite(m.softcap) && m.softcap >= 0, "flash_cuda: softcap must be finite and >= 0");
  if (m.alibi_slopes.has_value()) {
    const at::Tensor& a = *m.alibi_slopes;
    FLASH_CHECK(a.scalar_type() == at::kFloat && a.is_contiguous() && a.device() == q.device(),
                "flash_cuda: alibi_slopes must be a contiguous float32 tensor on q's device");
    FLASH_CHECK((a.dim() == 1 && a.size(0) == s.Hq) || (a.dim() == 2 && a.size(0) == s.B && a.size(1) == s.Hq),
                "flash_cuda: alibi_slopes must have shape (heads,) or (batch, heads)");
  }
  const auto prop = at::cuda::getDeviceProperties(q.device().index());
  FLASH_CHECK(prop->major >= 8, "flash_cuda: needs a GPU of compute capability 8.0 or newer, got ",
              prop->major, ".", prop->minor);
  return s;
}

void fill_fwd(FwdParams& p, const Shape& s, const MaskArgs& m, const at::Tensor& q, const at::Tensor& k,
              const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, double scale) {
  const bool vl = s.varlen;
  s.view(q, p.q, p.q_batch_stride, p.q_head_stride, p.q_row_stride);
  s.view(k, p.k, p.k_batch_stride, p.k_head_stride, p.k_row_stride);
  s.view(v, p.v, p.v_batch_stride, p.v_head_stride, p.v_row_stride);
  s.view(out, p.o, p.o_batch_stride, p.o_head_stride, p.o_row_stride);
  p.softmax_lse = lse.defined() ? lse.data_ptr<float>() : nullptr;  // (fwd_kvcache: lse when asked for)
  // Row statistics: dense [b][hq][sq], varlen [hq][total_q] (include/params.h).
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
  FLASH_CHECK(scale >= 0, "flash_cuda: internal error: negative scale reached the kernels");
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
  p.cache_len = p.sk;  // (the decode family's view of attention(): every key is cached)
  p.dtype = dtype_of(out);  // O's type: q's, but for e4m3 inputs (fwd_fp8)
  const auto prop = at::cuda::getDeviceProperties(q.device().index());
  // Under FLASH_CUDA_EMULATE_ARCH (arch/gpu_class.h) the dispatcher sees that GPU class.
  p.sm_arch = emulated_arch() > 0 ? emulated_arch() : prop->major * 10 + prop->minor;
  p.num_sms = prop->multiProcessorCount;
}

// A forward's outputs, straight from the CUDA caching allocator (at::detail::empty_*_cuda) rather
// than through the dispatcher's empty / empty_like: a small call's host time is made of steps like
// these (OPTIMIZATION.md step 67). output_like: t's sizes and, where t is dense, its strides (as
// empty_like's preserve_format gives them; otherwise empty_like itself).
at::Tensor output_like(const at::Tensor& t) {
  if (!t.is_non_overlapping_and_dense()) return at::empty_like(t);
  return at::detail::empty_strided_cuda(t.sizes(), t.strides(), t.scalar_type(), t.device());
}
at::Tensor float_output(at::IntArrayRef shape, const at::Tensor& like) {
  return at::detail::empty_cuda(shape, at::kFloat, like.device(), std::nullopt);
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

constexpr const char* kNoWgmma =
    "flash_cuda: kernel='wgmma' needs an sm_90 GPU (H100/H200), a flash_cuda build that includes "
    "the 90a target, and a head dim in 33..128 (with softcap > 0 its backward also needs "
    "deterministic=False and inputs TMA can address); use kernel='auto' or 'mma'";
// Softcap's derivative is in the warp-specialized Hopper backward only (tiers/wgmma/bwd_ws.cuh),
// which adds dQ in a varying order: not with deterministic=True.
constexpr const char* kNoWgmmaSoftcap =
    "flash_cuda: kernel='wgmma' runs softcap's backward on the warp-specialized Hopper kernel only, "
    "which needs deterministic=False; use kernel='auto' or 'mma'";

// A zero-filled tensor by one cudaMemsetAsync on the current stream: at::zeros launches a fill
// kernel through the TensorIterator machinery, which costs the host several times more (a small
// call's step is bound by the host).
at::Tensor zeroed_on_stream(at::IntArrayRef shape, const at::TensorOptions& options) {
  at::Tensor t = at::empty(shape, options);
  if (t.numel() > 0) {
    C10_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, t.nbytes(), at::cuda::getCurrentCUDAStream().stream()));
  }
  return t;
}

// The call on family F (include/dispatch.h: the contract) if it applies: its plan's workspace
// allocated and attached, then its launch. False where it does not apply or declines.
template <typename F, typename Params>
bool run_family(Params& p, Tier tier, const at::TensorOptions& options) {
  if (!F::applies(p, tier)) return false;
  const Workspace ws = F::plan(p, tier);
  at::Tensor floats, ints;  // alive until the launch is enqueued (stream-ordered reuse after)
  if (ws.floats > 0) {
    floats = ws.zero_floats ? zeroed_on_stream({ws.floats}, options.dtype(at::kFloat))
                            : at::empty({ws.floats}, options.dtype(at::kFloat));
  }
  if (ws.ints > 0) ints = zeroed_on_stream({ws.ints}, options.dtype(at::kInt));
  F::attach(p, floats.defined() ? floats.data_ptr<float>() : nullptr, ints.defined() ? ints.data_ptr<int>() : nullptr);
  return F::run(p, tier, at::cuda::getCurrentCUDAStream().stream());
}

// The families in the order they are asked: fp32 -> simt; fp16 / bf16 -> split-KV decode for
// decode-shaped calls, the Hopper family where it applies, else mma.sync. kernel='wgmma' allows
// the Hopper family alone.
template <typename Params>
void dispatch(Params& p, Tier tier, const at::TensorOptions& options) {
  if (run_family<SimtFamily>(p, tier, options) || run_family<DecodeFamily>(p, tier, options) ||
      run_family<WgmmaFamily>(p, tier, options)) {
    return;
  }
  FLASH_CHECK(tier != Tier::kWgmma, kNoWgmma);
  FLASH_CHECK(run_family<MmaFamily>(p, tier, options),
              "flash_cuda: internal error: no kernel family ran the call");
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

// The attention sinks (FwdParams::sinks), checked where the kernels' memory safety rests on them:
// float32, contiguous, on q's device, one per query head. Undefined: none.
at::Tensor check_sinks(const std::optional<at::Tensor>& sinks, const at::Tensor& q, int64_t Hq) {
  if (!sinks.has_value() || !sinks->defined()) return at::Tensor();
  const at::Tensor& t = *sinks;
  FLASH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.device() == q.device() && t.numel() == Hq,
              "flash_cuda: sinks must be a contiguous float32 tensor of one logit per query head (", Hq,
              ") on q's device");
  return t;
}

// What a row that sees no key gets for lse: -inf, or with sinks its head's sink. lse is dense
// (B, Hq, Sq) or packed (Hq, total_q).
void fill_empty_lse(at::Tensor& lse, const at::Tensor& sinks, int64_t Hq) {
  if (!sinks.defined()) {
    lse.fill_(-INFINITY);
  } else if (lse.dim() == 3) {
    lse.copy_(sinks.view({1, Hq, 1}).expand_as(lse));
  } else {
    lse.copy_(sinks.view({Hq, 1}).expand_as(lse));
  }
}

// The fp32 family's per-row softmax statistics (include/params.h: softmax_stats) travel from the
// forward to the backward as `aux`: lse's shape + (2,) for float32, empty otherwise.
at::Tensor make_aux(const Shape& s, const at::Tensor& q) {
  if (q.scalar_type() != at::kFloat) return at::empty({0}, q.options().dtype(at::kFloat));
  std::vector<int64_t> shape = s.lse_shape();
  shape.push_back(2);
  return at::zeros(shape, q.options().dtype(at::kFloat));
}

}  // namespace

// Dropout's fields of the params (include/params.h: DropoutParams). The forward takes the next
// Philox (seed, offset) of the current device's CUDA generator (under CUDA-graph capture, the
// generator's device-side seed and offset, read by the kernel) and has the kernel record the
// pair in rng_state (int64 [2]); the backward reads it from there.
void set_dropout(FwdParams& p, double dropout_p, const std::optional<at::Tensor>& rng_state, bool forward) {
  if (dropout_p == 0.0) return;
  FLASH_CHECK(dropout_p > 0.0 && dropout_p <= 1.0, "flash_cuda: dropout_p must be in [0, 1], got ", dropout_p);
  FLASH_CHECK(rng_state.has_value() && rng_state->defined() && rng_state->scalar_type() == at::kLong &&
                  rng_state->numel() == 2 && rng_state->is_contiguous() && rng_state->is_cuda(),
              "flash_cuda: dropout needs rng_state, a contiguous CUDA int64 tensor of 2 elements");
  const int64_t threshold = std::llround((1.0 - dropout_p) * 65536.0);
  p.dropout.threshold = static_cast<uint32_t>(std::min<int64_t>(65536, std::max<int64_t>(0, threshold)));
  p.dropout.scale = p.dropout.threshold == 0 ? 0.f : static_cast<float>(65536.0 / p.dropout.threshold);
  if (p.dropout.threshold == 65536) return;  // p below 2^-17: every element kept, as the reference does
  int64_t* state = rng_state->data_ptr<int64_t>();
  if (!forward) {
    p.dropout.seed_ptr = state;
    p.dropout.offset_ptr = state + 1;
    return;
  }
  auto* gen = at::get_generator_or_default<at::CUDAGeneratorImpl>(std::nullopt,
                                                                  at::cuda::detail::getDefaultCUDAGenerator());
  at::PhiloxCudaState philox;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    philox = gen->philox_cuda_state(4);  // one counter word per call (core/dropout.cuh)
  }
  if (philox.captured_) {
    p.dropout.seed_ptr = philox.seed_.ptr;
    p.dropout.offset_ptr = philox.offset_.ptr;
    p.dropout.offset_extra = philox.offset_intragraph_;
  } else {
    p.dropout.seed = philox.seed_.val;
    p.dropout.offset = philox.offset_.val;
  }
  p.dropout.rng_state = state;
}

namespace {

// What the forward and the backward check alike: the mask arguments, q / k / v's shapes, the
// scale, the kernel family and whether it runs dropout.
struct CallArgs {
  MaskArgs m;
  Shape s;
  Tier t;
};

CallArgs check_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                    int64_t window_left, int64_t window_right, double softcap,
                    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& cu_seqlens_q,
                    const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
                    int64_t tier, double dropout_p) {
  const MaskArgs m = mask_args(window_left, window_right, softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k);
  const Shape s = check_qkv(q, k, v, m);
  FLASH_CHECK(std::isfinite(scale), "flash_cuda: scale must be finite");
  const Tier t = resolve_tier(tier, dtype_of(q));
  FLASH_CHECK(dropout_p == 0.0 || t == Tier::kAuto || t == Tier::kMma || t == Tier::kSimt,
              "flash_cuda: dropout runs on kernel='auto', 'mma' or 'simt'");
  return {m, s, t};
}

}  // namespace

// out, lse, aux = fwd(q, k, v, scale, window_left, window_right, softcap, alibi_slopes,
//                     cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, tier,
//                     dropout_p=0, rng_state=None, sinks=None, sm_margin=0)
// sinks: None, or float32 (Hq,), the attention sinks (include/params.h: FwdParams::sinks); the
// backward needs nothing of them (P = exp(s - lse) with their lse, and delta is unchanged).
// sm_margin: SMs a persistent launch leaves free, for work that must run beside it (the ring's
// NCCL transfers: a persistent CTA holds its SM to the end, so a kernel queued after it would
// otherwise wait for the whole launch).
namespace {

// fwd's body. empty_aux: what aux is where the call has no fp32 statistics (fwd: an empty
// tensor, which its op schema promises; fwd_direct: undefined, one allocation fewer).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_impl(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, double scale, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, int64_t tier, double dropout_p,
    const std::optional<at::Tensor>& rng_state, const std::optional<at::Tensor>& sinks_in, bool empty_aux,
    int64_t sm_margin) {
  const auto [m, s, t] = check_call(q_in, k_in, v_in, scale, window_left, window_right, softcap, alibi_slopes,
                                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, tier, dropout_p);
  const at::Tensor sinks = check_sinks(sinks_in, q_in, s.Hq);
  FLASH_CHECK(sm_margin >= 0, "flash_cuda: sm_margin must be >= 0, got ", sm_margin);

  at::Tensor out = output_like(q_in);
  at::Tensor lse = float_output(s.lse_shape(), q_in);
  at::Tensor aux = (empty_aux || q_in.scalar_type() == at::kFloat) ? make_aux(s, q_in) : at::Tensor();
  if (s.empty()) {  // no query, or no key at all: every row is empty
    out.zero_();
    fill_empty_lse(lse, sinks, s.Hq);
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
  if (sinks.defined()) p.sinks = sinks.data_ptr<float>();
  set_dropout(p, dropout_p, rng_state, /*forward=*/true);
  p.num_sms = static_cast<int>(std::max<int64_t>(1, p.num_sms - sm_margin));
  dispatch(p, t, q.options());
  return {out, lse, aux};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, int64_t tier, double dropout_p,
    const std::optional<at::Tensor>& rng_state, const std::optional<at::Tensor>& sinks, int64_t sm_margin) {
  return fwd_impl(q, k, v, scale, window_left, window_right, softcap, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                  max_seqlen_q, max_seqlen_k, tier, dropout_p, rng_state, sinks, /*empty_aux=*/true, sm_margin);
}

// The options of a dense call without ALiBi slopes, sinks or dropout, as flash_cuda's Python layer
// checked them once per argument signature (flash_cuda/signature.py: Plan.direct). fwd_direct and
// bwd_direct take them as one object: converting the dozen separate scalar and None arguments of
// fwd / bwd costs a small call more host time than the rest of the binding.
struct DirectPlan {
  double scale;
  int64_t window_left, window_right;
  double softcap;
  int64_t tier;
  bool deterministic;
};

// out, lse, aux = fwd_direct(q, k, v, plan): fwd for such a call; aux is None except for float32.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_direct(const at::Tensor& q, const at::Tensor& k,
                                                          const at::Tensor& v, const DirectPlan& d) {
  return fwd_impl(q, k, v, d.scale, d.window_left, d.window_right, d.softcap, std::nullopt, std::nullopt,
                  std::nullopt, 0, 0, d.tier, 0.0, std::nullopt, std::nullopt, /*empty_aux=*/false, /*sm_margin=*/0);
}

// dq, dk, dv = bwd(dout, q, k, v, out, lse, aux, dlse, scale, window_left, window_right, softcap,
//                  alibi_slopes, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic, tier,
//                  need_dq, need_dkdv)
// need_dq / need_dkdv: which gradients to compute (autograd's needs_input_grad; dK and dV come
// from the same products, so they go together). A gradient not computed is neither allocated nor
// worked on, and comes back undefined (None).
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in, const at::Tensor& aux_in,
    const std::optional<at::Tensor>& dlse_in, double scale, int64_t window_left, int64_t window_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    bool deterministic, int64_t tier, bool need_dq, bool need_dkdv, double dropout_p,
    const std::optional<at::Tensor>& rng_state) {
  const auto [m, s, t] = check_call(q_in, k_in, v_in, scale, window_left, window_right, softcap, alibi_slopes,
                                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, tier, dropout_p);
  FLASH_CHECK(t != Tier::kWgmma || m.softcap == 0 || WgmmaFamily::one_pass_backward(deterministic), kNoWgmmaSoftcap);
  FLASH_CHECK(dout_in.sizes() == q_in.sizes() && out_in.sizes() == q_in.sizes(),
              "flash_cuda: dout and out must have q's shape");
  FLASH_CHECK(dout_in.scalar_type() == q_in.scalar_type() && out_in.scalar_type() == q_in.scalar_type(),
              "flash_cuda: dout and out must have q's dtype");
  FLASH_CHECK(dout_in.device() == q_in.device() && out_in.device() == q_in.device() &&
                  lse_in.device() == q_in.device(),
              "flash_cuda: dout, out, lse must be on q's device");
  FLASH_CHECK(lse_in.scalar_type() == at::kFloat && lse_in.sizes() == at::IntArrayRef(s.lse_shape()),
              "flash_cuda: lse must be float32 of shape (B, Hq, Sq), or (Hq, total_q) for varlen");

  // kernel='wgmma' runs softcap's backward on the one-pass warp-specialized kernel alone (the
  // cp.async kernels have no softcap derivative), which computes every gradient: there the
  // unwanted ones are computed as well, and dropped by the caller.
  if (t == Tier::kWgmma && m.softcap > 0 && (need_dq || need_dkdv)) need_dq = need_dkdv = true;
  if (!need_dq && !need_dkdv) return {at::Tensor(), at::Tensor(), at::Tensor()};

  // A gradient not wanted stays undefined: nothing allocated, and its pointer in the params is
  // nullptr, which tells the families to skip its kernels (include/params.h).
  at::Tensor dq = need_dq ? at::empty_like(q_in) : at::Tensor();
  at::Tensor dk = need_dkdv ? at::empty_like(k_in) : at::Tensor();
  at::Tensor dv = need_dkdv ? at::empty_like(v_in) : at::Tensor();
  if (s.empty()) {
    for (at::Tensor* g : {&dq, &dk, &dv}) {
      if (g->defined()) g->zero_();
    }
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
    FLASH_CHECK(dlse_in->sizes() == lse_in.sizes(), "flash_cuda: dlse must have lse's shape");
    dlse = dlse_in->to(at::kFloat).contiguous();
  }
  at::Tensor delta = at::empty(s.lse_shape(), q.options().dtype(at::kFloat));

  BwdParams p;
  fill_fwd(p, s, m, q, k, v, out, lse, scale);
  set_dropout(p, dropout_p, rng_state, /*forward=*/false);
  p.softmax_lse = const_cast<float*>(lse.data_ptr<float>());
  if (q_in.scalar_type() == at::kFloat) {
    FLASH_CHECK(aux_in.scalar_type() == at::kFloat && aux_in.is_contiguous() &&
                    aux_in.numel() == 2 * lse_in.numel() && aux_in.device() == q_in.device(),
                "flash_cuda: aux must be the float32 statistics the forward returned");
    p.softmax_stats = const_cast<float*>(aux_in.data_ptr<float>());
  }
  s.view(dout, p.dout, p.do_batch_stride, p.do_head_stride, p.do_row_stride);
  p.dlse = dlse.defined() ? dlse.data_ptr<float>() : nullptr;
  if (need_dq) s.view(dq, p.dq, p.dq_batch_stride, p.dq_head_stride, p.dq_row_stride);
  if (need_dkdv) {
    s.view(dk, p.dk, p.dk_batch_stride, p.dk_head_stride, p.dk_row_stride);
    s.view(dv, p.dv, p.dv_batch_stride, p.dv_head_stride, p.dv_row_stride);
  }
  p.delta = delta.data_ptr<float>();
  p.deterministic = deterministic;
  // The fp32 tier's default backward adds dQ with float atomics straight into dq (fp32): dq
  // starts at zero. Every other path writes each gradient element exactly once.
  const bool dq_atomic = t == Tier::kSimt && simt::dq_by_atomics(p);
  if (dq_atomic) {
    C10_CUDA_CHECK(cudaMemsetAsync(dq.data_ptr(), 0, dq.nbytes(), at::cuda::getCurrentCUDAStream().stream()));
  }
  if (poison_outputs()) {
    for (at::Tensor* g : {&dq, &dk, &dv}) {
      if (g->defined() && !(dq_atomic && g == &dq)) g->fill_(NAN);
    }
    delta.fill_(NAN);
  }
  dispatch(p, t, q.options());
  if (negative_scale && need_dq) dq.neg_();
  return {dq, dk, dv};
}

// dq, dk, dv = bwd_direct(dout, q, k, v, out, lse, aux, dlse, plan, need_dq, need_dkdv): bwd for a
// call whose forward ran fwd_direct (aux None except for float32).
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_direct(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& aux, const std::optional<at::Tensor>& dlse,
    const DirectPlan& d, bool need_dq, bool need_dkdv) {
  FLASH_CHECK(aux.has_value() || q.scalar_type() != at::kFloat,
              "flash_cuda: aux must be the float32 statistics the forward returned");
  return bwd(dout, q, k, v, out, lse, aux.has_value() ? *aux : at::Tensor(), dlse, d.scale, d.window_left,
             d.window_right, d.softcap, std::nullopt, std::nullopt, std::nullopt, 0, 0, d.deterministic, d.tier,
             need_dq, need_dkdv, 0.0, std::nullopt);
}

namespace {

// The autograd node of an eager dense call with a DirectPlan (flash_cuda/eager.py's
// EagerAttentionDirect, in C++): the same forward and backward entries, the same tensors saved
// (q, k, v, out, lse, and aux for float32), gradients only where autograd asks for them, an unused
// output's gradient arriving undefined. In C++, the node costs autograd no Python: no context
// object, no unpacking of saved tensors into Python, no interpreter on the backward's thread.
struct DirectAttention : public torch::autograd::Function<DirectAttention> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v, const DirectPlan& d) {
    auto [out, lse, aux] = fwd_direct(q, k, v, d);
    ctx->save_for_backward({q, k, v, out, lse, aux});
    ctx->saved_data["scale"] = d.scale;
    ctx->saved_data["window_left"] = d.window_left;
    ctx->saved_data["window_right"] = d.window_right;
    ctx->saved_data["softcap"] = d.softcap;
    ctx->saved_data["tier"] = d.tier;
    ctx->saved_data["deterministic"] = d.deterministic;
    ctx->set_materialize_grads(false);
    return {out, lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const bool need_q = ctx->needs_input_grad(0), need_k = ctx->needs_input_grad(1),
               need_v = ctx->needs_input_grad(2);
    if (!(need_q || need_k || need_v)) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4], &aux = saved[5];
    const auto& data = ctx->saved_data;
    const DirectPlan d{data.at("scale").toDouble(),  data.at("window_left").toInt(), data.at("window_right").toInt(),
                       data.at("softcap").toDouble(), data.at("tier").toInt(),       data.at("deterministic").toBool()};
    const at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(out);
    const std::optional<at::Tensor> dlse = grads[1].defined() ? std::optional<at::Tensor>(grads[1]) : std::nullopt;
    auto [dq, dk, dv] = bwd_direct(dout, q, k, v, out, lse,
                                   aux.defined() ? std::optional<at::Tensor>(aux) : std::nullopt, dlse, d, need_q,
                                   need_k || need_v);
    return {need_q ? dq : at::Tensor(), need_k ? dk : at::Tensor(), need_v ? dv : at::Tensor(), at::Tensor()};
  }
};

}  // namespace

// out, lse = attention_direct(q, k, v, plan): fwd_direct's call with its backward recorded for
// autograd where q, k or v needs a gradient (grad mode on): the eager path of such a call.
std::tuple<at::Tensor, at::Tensor> attention_direct(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                    const DirectPlan& d) {
  auto outs = DirectAttention::apply(q, k, v, d);
  return {outs[0], outs[1]};
}

// out, lse = fwd_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, cache_len, block_table,
//                        scale, window_left, window_right, softcap, alibi_slopes, num_splits, return_lse,
//                        sinks=None)
// (lse is None unless return_lse. sinks as fwd's: with split key ranges, their merge adds them.)
// FP8 caches: k_cache / v_cache float8_e4m3fn with k_descale / v_descale float32 (batch, kv_heads),
// q and the new k / v float16 or bfloat16; the new rows are stored as e4m3(x / descale); compute
// capability 8.9 or newer, head dims multiples of 16; every query count runs the decode kernels.
// Attention of q against a KV cache (include/params.h: the KV-cache fields), after writing the
// new keys k_new / v_new into it in place. flash_cuda.attention_with_kvcache validates every
// argument first; the checks here are the ones memory safety rests on. The cache is never
// copied (it is written in place): its rows must be 16-byte aligned as given.
std::tuple<at::Tensor, at::Tensor> fwd_kvcache(
    const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k_new_in, const std::optional<at::Tensor>& v_new_in,
    const std::optional<at::Tensor>& cache_seqlens, int64_t cache_len, const std::optional<at::Tensor>& block_table,
    double scale, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, int64_t num_splits, bool return_lse,
    const std::optional<at::Tensor>& sinks_in, const std::optional<at::Tensor>& k_descale,
    const std::optional<at::Tensor>& v_descale) {
  FLASH_CHECK(q_in.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "flash_cuda: q, k_cache, v_cache must be 4-d");
  FLASH_CHECK(q_in.is_cuda() && k_cache.device() == q_in.device() && v_cache.device() == q_in.device(),
              "flash_cuda: q and the caches must be on one CUDA device");
  const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  FLASH_CHECK((fp8 ? at::kFloat8_e4m3fn : q_in.scalar_type()) == k_cache.scalar_type() &&
                  k_cache.scalar_type() == v_cache.scalar_type() && q_in.scalar_type() != at::kFloat &&
                  (q_in.scalar_type() == at::kHalf || q_in.scalar_type() == at::kBFloat16),
              "flash_cuda: q float16 or bfloat16, the caches q's dtype or both float8_e4m3fn");
  FLASH_CHECK(fp8 == (k_descale.has_value() && k_descale->defined()) &&
                  fp8 == (v_descale.has_value() && v_descale->defined()),
              "flash_cuda: k_descale and v_descale go with FP8 caches, and only with them");
  FLASH_CHECK(k_cache.sizes() == v_cache.sizes(), "flash_cuda: k_cache and v_cache shapes differ");
  FLASH_CHECK(q_in.stride(-1) == 1 && k_cache.stride(-1) == 1 && v_cache.stride(-1) == 1,
              "flash_cuda: the last dimension of q and the caches must be contiguous");
  const int64_t esize = k_cache.element_size();
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    bool ok = reinterpret_cast<uintptr_t>(c->data_ptr()) % 16 == 0;
    for (int i = 0; i < 3; ++i) ok = ok && (c->size(i) <= 1 || (c->stride(i) * esize) % 16 == 0);
    FLASH_CHECK(ok, "flash_cuda: the caches' rows must be 16-byte aligned (they are written in place)");
  }
  const bool paged = block_table.has_value() && block_table->defined();
  const int64_t B = q_in.size(0), Hq = q_in.size(1), Sq = q_in.size(2), D = q_in.size(3);
  const int64_t Hkv = k_cache.size(1);
  FLASH_CHECK(k_cache.size(3) == D && Hkv > 0 && Hq % Hkv == 0 && D % 8 == 0 && D >= 8 && D <= 256,
              "flash_cuda: bad head counts or head dim");
  if (fp8) {
    FLASH_CHECK(D % 16 == 0, "flash_cuda: FP8 caches take head dims that are multiples of 16");
    for (const at::Tensor* d : {&*k_descale, &*v_descale}) {
      FLASH_CHECK(d->scalar_type() == at::kFloat && d->dim() == 2 && d->size(0) == B && d->size(1) == Hkv &&
                      d->is_contiguous() && d->device() == q_in.device(),
                  "flash_cuda: k_descale / v_descale must be contiguous float32 (batch, kv_heads) on q's device");
    }
  }
  int64_t capacity = k_cache.size(2);
  if (paged) {
    const at::Tensor& bt = *block_table;
    FLASH_CHECK(bt.scalar_type() == at::kInt && bt.dim() == 2 && bt.size(0) == B && bt.stride(1) == 1 &&
                    bt.device() == q_in.device(),
                "flash_cuda: block_table must be int32 (batch, max_pages) on q's device, rows contiguous");
    FLASH_CHECK(k_cache.size(2) % 16 == 0 && k_cache.size(0) > 0, "flash_cuda: page size must be a multiple of 16");
    capacity = bt.size(1) * k_cache.size(2);
  } else {
    FLASH_CHECK(k_cache.size(0) == B, "flash_cuda: a dense cache has q's batch size");
  }
  const bool has_new = k_new_in.has_value() && k_new_in->defined();
  FLASH_CHECK(has_new == (v_new_in.has_value() && v_new_in->defined()), "flash_cuda: pass both k and v, or neither");
  int64_t s_new = 0;
  at::Tensor k_new, v_new;
  if (has_new) {
    FLASH_CHECK(k_new_in->dim() == 4 && k_new_in->sizes() == v_new_in->sizes() && k_new_in->size(0) == B &&
                    k_new_in->size(1) == Hkv && k_new_in->size(3) == D &&
                    k_new_in->scalar_type() == q_in.scalar_type() && v_new_in->scalar_type() == q_in.scalar_type() &&
                    k_new_in->device() == q_in.device() && v_new_in->device() == q_in.device(),
                "flash_cuda: k and v must be (batch, kv_heads, seqlen_new, head_dim) in q's dtype and device");
    FLASH_CHECK(k_new_in->stride(-1) == 1 && v_new_in->stride(-1) == 1,
                "flash_cuda: the last dimension of k and v must be contiguous");
    k_new = aligned(*k_new_in);
    v_new = aligned(*v_new_in);
    s_new = k_new.size(2);
  }
  const bool lens_on_device = cache_seqlens.has_value() && cache_seqlens->defined();
  if (lens_on_device) {
    FLASH_CHECK(cache_seqlens->scalar_type() == at::kInt && cache_seqlens->dim() == 1 &&
                    cache_seqlens->size(0) == B && cache_seqlens->is_contiguous() &&
                    cache_seqlens->device() == q_in.device(),
                "flash_cuda: cache_seqlens must be a contiguous int32 (batch,) tensor on q's device");
  } else {
    FLASH_CHECK(cache_len >= 0 && cache_len + s_new <= capacity,
                "flash_cuda: cache_seqlens + seqlen_new exceeds the cache");
  }
  FLASH_CHECK(s_new <= capacity && capacity < (int64_t(1) << 31) && Sq < (int64_t(1) << 31) && B < 65536 &&
                  Hq < 65536,
              "flash_cuda: sizes out of range");
  FLASH_CHECK(std::isfinite(scale) && std::isfinite(softcap) && softcap >= 0 && num_splits >= 0,
              "flash_cuda: bad scale, softcap or num_splits");
  const at::Tensor sinks = check_sinks(sinks_in, q_in, Hq);

  at::Tensor out = output_like(q_in);
  // lse only when asked for (None otherwise): one allocation less on every decode step.
  at::Tensor lse = return_lse ? float_output({B, Hq, Sq}, q_in) : at::Tensor();
  if (B == 0 || Sq == 0) return {out, lse};
  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = aligned(scale < 0 ? q_in.neg() : q_in);
  if (poison_outputs()) {
    out.fill_(NAN);
    if (return_lse) lse.fill_(NAN);
  }

  // The cache as a dense batch of `capacity` keys (each entry's own length is read by the kernel,
  // p.cache_seqlens / cache_len); every tensor here is (batch or page, head, row, dim).
  Shape dense;
  dense.B = B;
  dense.Hq = Hq;
  dense.Hkv = Hkv;
  dense.Sq = dense.rows_q = Sq;
  dense.Sk = dense.rows_k = capacity;
  dense.D = D;
  MaskArgs m;
  m.window_left = window_left;
  m.window_right = window_right;
  m.softcap = softcap;
  if (alibi_slopes.has_value() && alibi_slopes->defined()) {
    const at::Tensor& a = *alibi_slopes;
    FLASH_CHECK(a.scalar_type() == at::kFloat && a.is_contiguous() && a.device() == q_in.device() &&
                    ((a.dim() == 1 && a.size(0) == Hq) || (a.dim() == 2 && a.size(0) == B && a.size(1) == Hq)),
                "flash_cuda: alibi_slopes must be contiguous float32 (heads,) or (batch, heads) on q's device");
    m.alibi_slopes = a;
  }
  FwdParams p;
  fill_fwd(p, dense, m, q, k_cache, v_cache, out, lse, std::abs(scale));  // q holds a negative scale's sign
  p.cache_seqlens = lens_on_device ? cache_seqlens->data_ptr<int32_t>() : nullptr;
  p.cache_len = lens_on_device ? 0 : static_cast<int>(cache_len);
  if (sinks.defined()) p.sinks = sinks.data_ptr<float>();
  if (paged) {
    p.block_table = block_table->data_ptr<int32_t>();
    p.block_table_stride = block_table->stride(0);
    p.page_size = static_cast<int>(k_cache.size(2));
    p.num_pages = static_cast<int>(k_cache.size(0));
  }
  if (has_new) {
    dense.view(k_new, p.k_new, p.knew_batch_stride, p.knew_head_stride, p.knew_row_stride);
    dense.view(v_new, p.v_new, p.vnew_batch_stride, p.vnew_head_stride, p.vnew_row_stride);
    p.s_new = static_cast<int>(s_new);
  }
  p.splits_wanted = static_cast<int>(std::min<int64_t>(num_splits, 1024));
  FLASH_CHECK(p.sm_arch >= 80, "flash_cuda: needs a GPU of compute capability 8.0 or newer");
  if (fp8) {
    FLASH_CHECK(p.sm_arch >= 89, "flash_cuda: FP8 (e4m3) KV caches need a GPU of compute capability 8.9 or newer "
                "(Ada, Hopper, Blackwell); this one is ", p.sm_arch / 10, ".", p.sm_arch % 10);
    p.cache_fp8 = true;
    p.k_descale = k_descale->data_ptr<float>();
    p.v_descale = v_descale->data_ptr<float>();
  }
  // (FP8 caches: every query count through the decode kernels, which quantize the new rows as
  // they store them; the prefill route's gather lays keys out in 16 bits.)
  if (Sq > decode::kMaxDecodeQueries && (paged || lens_on_device) && !fp8) {
    // A prompt chunk whose keys' lengths or places only the device knows: the query-tiled forward
    // over the cache laid out densely (core/kv_gather.cuh), each sequence's key count in
    // seqused_k. (A dense cache with an int length: the Python layer's own prefill route.)
    const at::Tensor counts = at::empty({B}, q.options().dtype(at::kInt));
    at::Tensor keys = k_cache, values = v_cache;
    KvGatherTarget g;
    g.key_counts = counts.data_ptr<int32_t>();
    if (paged) {  // one sequence per batch entry, `capacity` rows: the pages in order
      keys = at::empty({B, Hkv, capacity, D}, q.options());
      values = at::empty({B, Hkv, capacity, D}, q.options());
      g.k = keys.data_ptr();
      g.v = values.data_ptr();
      g.batch_stride = keys.stride(0);
      g.head_stride = keys.stride(1);
      g.row_stride = keys.stride(2);
    }
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
    run_kv_gather<2>(p, g, stream);
    // The forward writes lse whether asked for or not.
    const at::Tensor rows_lse = return_lse ? lse : at::empty({B, Hq, Sq}, q_in.options().dtype(at::kFloat));
    FwdParams f;
    fill_fwd(f, dense, m, q, keys, values, out, rows_lse, std::abs(scale));
    f.seqused_k = counts.data_ptr<int32_t>();
    if (sinks.defined()) f.sinks = sinks.data_ptr<float>();
    dispatch(f, Tier::kAuto, q.options());
    return {out, lse};
  }
  FLASH_CHECK(run_family<DecodeFamily>(p, Tier::kAuto, q.options()),
              "flash_cuda: attention_with_kvcache: no decode kernel fits this GPU's shared memory at head dim ", D,
              " (head dims up to 128 run on every supported GPU)");
  return {out, lse};
}

// A KV-cache call's options (no ALiBi slopes, no sinks, a tensor cache_seqlens) as flash_cuda's
// Python layer checked them once per argument signature (flash_cuda/kvcache_checks.py:
// Plan.direct), taken as one object for the reason DirectPlan is.
struct KvcacheDirectPlan {
  double scale;
  int64_t window_left, window_right;
  double softcap;
  int64_t num_splits;
  bool return_lse;
};

// out, lse = fwd_kvcache_direct(q, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, plan)
std::tuple<at::Tensor, at::Tensor> fwd_kvcache_direct(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new, const at::Tensor& cache_seqlens,
    const std::optional<at::Tensor>& block_table, const KvcacheDirectPlan& d) {
  return fwd_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens, 0, block_table, d.scale, d.window_left,
                     d.window_right, d.softcap, std::nullopt, d.num_splits, d.return_lse, std::nullopt, std::nullopt,
                     std::nullopt);
}

namespace {

// One operand of merge_partials: a (batch, heads, rows, d) view of O, its (batch, heads, rows)
// float32 lse rows and optionally the (.., 2) (m, log2 l) pairs laid out as lse (MergeOperand).
MergeOperand merge_operand(const at::Tensor& o, const at::Tensor& lse, const std::optional<at::Tensor>& stats,
                           const char* name) {
  FLASH_CHECK(o.is_cuda() && o.dim() == 4 && o.stride(3) == 1, "flash_cuda.merge_partials: ", name,
              " must be a CUDA (batch, heads, rows, d) view with unit stride along d");
  const int64_t vec = 4 * o.element_size();  // the kernel moves 4 values at a time
  FLASH_CHECK(reinterpret_cast<uintptr_t>(o.data_ptr()) % vec == 0 && o.stride(0) % 4 == 0 &&
                  o.stride(1) % 4 == 0 && o.stride(2) % 4 == 0,
              "flash_cuda.merge_partials: the rows of ", name, " must start at multiples of 4 elements");
  FLASH_CHECK(lse.dim() == 3 && lse.scalar_type() == at::kFloat && lse.stride(2) == 1 &&
                  lse.sizes() == o.sizes().slice(0, 3) && lse.device() == o.device(),
              "flash_cuda.merge_partials: the lse of ", name, " must be float32 (batch, heads, rows), unit row stride");
  MergeOperand x;
  x.o = o.data_ptr();
  x.batch_stride = o.stride(0);
  x.head_stride = o.stride(1);
  x.row_stride = o.stride(2);
  x.lse = lse.data_ptr<float>();
  x.stat_batch_stride = lse.stride(0);
  x.stat_head_stride = lse.stride(1);
  x.dtype = dtype_of(o);
  if (stats.has_value() && stats->defined()) {
    const at::Tensor& st = *stats;
    FLASH_CHECK(st.dim() == 4 && st.size(3) == 2 && st.scalar_type() == at::kFloat && st.stride(3) == 1 &&
                    st.stride(2) == 2 && st.stride(1) == 2 * lse.stride(1) && st.stride(0) == 2 * lse.stride(0) &&
                    st.sizes().slice(0, 3) == lse.sizes() && st.device() == o.device(),
                "flash_cuda.merge_partials: the stats of ", name, " must be float32 (batch, heads, rows, 2) laid out as "
                "its lse");
    x.stats = st.data_ptr<float>();
  }
  return x;
}

}  // namespace

// merge_partials(a, a_lse, a_stats, b, b_lse, b_stats, out, out_lse, out_stats): the partial
// results a and b of the same query rows over disjoint key sets, merged by their row statistics
// into out (which may be a; core/combine.cuh: merge_partials_kernel). b is float16, bfloat16 or
// float32; a and out are b's dtype or float32. Stats (the fp32 kernels' (m, log2 l) pairs): all
// three or none.
void merge_partials(const at::Tensor& a, const at::Tensor& a_lse, const std::optional<at::Tensor>& a_stats,
                    const at::Tensor& b, const at::Tensor& b_lse, const std::optional<at::Tensor>& b_stats,
                    const at::Tensor& out, const at::Tensor& out_lse, const std::optional<at::Tensor>& out_stats) {
  FLASH_CHECK(a.sizes() == b.sizes() && out.sizes() == b.sizes(),
              "flash_cuda.merge_partials: a, b and out must have the same shape, got ", a.sizes(), ", ", b.sizes(),
              ", ", out.sizes());
  FLASH_CHECK(a.device() == b.device() && out.device() == b.device(),
              "flash_cuda.merge_partials: a, b and out must be on the same device");
  MergeParams p;
  p.a = merge_operand(a, a_lse, a_stats, "a");
  p.b = merge_operand(b, b_lse, b_stats, "b");
  p.out = merge_operand(out, out_lse, out_stats, "out");
  for (const MergeOperand* x : {&p.a, &p.out}) {
    FLASH_CHECK(x->dtype == p.b.dtype || x->dtype == DType::kFloat32,
                "flash_cuda.merge_partials: a and out must have b's dtype or float32");
  }
  FLASH_CHECK((p.a.stats == nullptr) == (p.b.stats == nullptr) && (p.b.stats == nullptr) == (p.out.stats == nullptr),
              "flash_cuda.merge_partials: pass stats for all three operands or for none");
  p.batch = static_cast<int>(b.size(0));
  p.heads = static_cast<int>(b.size(1));
  p.rows = static_cast<int>(b.size(2));
  p.d = static_cast<int>(b.size(3));
  FLASH_CHECK(p.d % 4 == 0, "flash_cuda.merge_partials: the head dim must be a multiple of 4, got ", p.d);
  if (b.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(b.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  switch (p.b.dtype) {
    case DType::kFloat16: run_merge_partials<kF16>(p, stream); break;
    case DType::kBFloat16: run_merge_partials<kBF16>(p, stream); break;
    default: run_merge_partials<static_cast<int>(DType::kFloat32)>(p, stream);
  }
}

// dropout_mask(batch, heads, sq, sk, threshold, seed, offset, like): the uint8 (batch, heads, sq,
// sk) mask of kept elements that the kernels' dropout draws (core/dropout.cuh), on like's device;
// threshold = round((1 - p) 2^16). For tests against flash_cuda.reference.dropout_keep_mask.
at::Tensor dropout_mask(int64_t batch, int64_t heads, int64_t sq, int64_t sk, int64_t threshold, uint64_t seed,
                        uint64_t offset, const at::Tensor& like) {
  FLASH_CHECK(batch >= 0 && heads >= 0 && sq >= 0 && sk >= 0, "flash_cuda.dropout_mask: negative size");
  FLASH_CHECK(threshold >= 0 && threshold <= 65536, "flash_cuda.dropout_mask: threshold must be in [0, 65536], got ",
              threshold);
  FLASH_CHECK(like.is_cuda(), "flash_cuda.dropout_mask: like must be a CUDA tensor");
  at::Tensor mask = at::empty({batch, heads, sq, sk}, like.options().dtype(at::kByte));
  DropoutMaskParams p;
  p.mask = mask.data_ptr<uint8_t>();
  p.heads_total = batch * heads;
  p.sq = static_cast<int>(sq);
  p.sk = static_cast<int>(sk);
  p.key = make_dropout_key(seed, offset, static_cast<uint32_t>(threshold));
  const c10::cuda::CUDAGuard guard(like.device());
  run_dropout_mask<uint8_t>(p, at::cuda::getCurrentCUDAStream().stream());
  return mask;
}

at::Tensor fp8_v_layout(const at::Tensor& v);
at::Tensor fp8_v_layout_impl(const at::Tensor& v, const at::Tensor* cu_seqlens_k, int64_t batch, int64_t max_seqlen_k);

// The FP8 forward on Hopper (tiers/wgmma/fwd: WsConfig's kFp8) behind fwd_fp8 (cu_seqlens nullptr:
// dense q (B, Hq, Sq, D), k / v (B, Hkv, Sk, D)) and fwd_fp8_varlen (packed q (total_q, Hq, D), k / v
// (total_k, Hkv, D), a descale row per sequence): float8_e4m3fn operands, float32 (B, Hkv)
// descales (flash_cuda/reference.py: fp8_descale), D 128 or 256, softcap (> 0) on the dequantized
// logits; out in out_dtype (bfloat16 or float16) with q's shape, lse float32 (B, Hq, Sq) or (Hq,
// total_q). V is laid out for the P V product first (fp8_v_layout_impl: a packed batch's in one
// slot of max_seqlen_k keys per sequence).
std::tuple<at::Tensor, at::Tensor> fp8_forward(const char* kWhat, const at::Tensor& q_in, const at::Tensor& k_in,
                                               const at::Tensor& v_in, const at::Tensor* cu_seqlens_q,
                                               const at::Tensor* cu_seqlens_k, int64_t max_seqlen_q,
                                               int64_t max_seqlen_k, const at::Tensor& q_descale,
                                               const at::Tensor& k_descale, const at::Tensor& v_descale, double scale,
                                               int64_t window_left, int64_t window_right, double softcap,
                                               at::ScalarType out_dtype) {
  const bool varlen = cu_seqlens_q != nullptr;
  FLASH_CHECK(q_in.is_cuda() && k_in.is_cuda() && v_in.is_cuda(), kWhat, ": q, k, v must be CUDA tensors");
  FLASH_CHECK(q_in.device() == k_in.device() && q_in.device() == v_in.device(), kWhat,
              ": q, k, v must be on the same device");
  for (const at::Tensor* t : {&q_in, &k_in, &v_in}) {
    FLASH_CHECK(t->scalar_type() == at::kFloat8_e4m3fn, kWhat, ": q, k, v must be float8_e4m3fn, got ",
                t->scalar_type());
    FLASH_CHECK(t->dim() == (varlen ? 3 : 4), kWhat,
                varlen ? ": q, k, v must be 3-d (total, heads, head_dim)" : ": q, k, v must be 4-d (batch, heads, seq, head_dim)");
    FLASH_CHECK(t->stride(-1) == 1, kWhat, ": the last dimension of q, k, v must be contiguous (stride 1)");
  }
  FLASH_CHECK(k_in.sizes() == v_in.sizes(), kWhat, ": k and v shapes differ");
  FLASH_CHECK(out_dtype == at::kBFloat16 || out_dtype == at::kHalf, kWhat,
              ": out_dtype must be bfloat16 or float16, got ", out_dtype);
  Shape s;
  if (varlen) {
    for (const at::Tensor* c : {cu_seqlens_q, cu_seqlens_k}) {
      FLASH_CHECK(c->scalar_type() == at::kInt && c->dim() == 1 && c->is_contiguous() && c->device() == q_in.device(),
                  kWhat, ": cu_seqlens must be contiguous 1-d int32 tensors on q's device");
    }
    FLASH_CHECK(cu_seqlens_q->size(0) == cu_seqlens_k->size(0) && cu_seqlens_q->size(0) >= 2, kWhat,
                ": cu_seqlens_q and cu_seqlens_k must both have batch + 1 >= 2 entries");
    FLASH_CHECK(max_seqlen_q >= 0 && max_seqlen_k >= 0, kWhat, ": max_seqlen must be >= 0");
    s.varlen = true;
    s.B = cu_seqlens_q->size(0) - 1;
    s.Hq = q_in.size(1);
    s.Hkv = k_in.size(1);
    s.D = q_in.size(2);
    s.rows_q = q_in.size(0);
    s.rows_k = k_in.size(0);
    s.Sq = std::min(max_seqlen_q, s.rows_q);
    s.Sk = std::min(max_seqlen_k, s.rows_k);
    FLASH_CHECK(k_in.size(2) == s.D, kWhat, ": q, k, v head dims differ");
  } else {
    s = Shape::dense(q_in, k_in);
    FLASH_CHECK(k_in.size(0) == s.B && k_in.size(3) == s.D, kWhat, ": q, k, v batch sizes or head dims differ");
  }
  FLASH_CHECK(s.Hkv > 0 && s.Hq % s.Hkv == 0, kWhat, ": query heads (", s.Hq,
              ") must be a multiple of key/value heads (", s.Hkv, ")");
  FLASH_CHECK(s.D == 64 || s.D == 128 || s.D == 256, kWhat, ": head_dim must be 64, 128 or 256, got ", s.D);
  FLASH_CHECK(s.B < 65536 && s.Hq < 65536 && s.rows_q < (int64_t(1) << 31) && s.rows_k < (int64_t(1) << 31) - 64,
              kWhat, ": batch and heads must be < 65536, sequence lengths and row counts < 2^31");
  FLASH_CHECK(std::isfinite(scale) && scale >= 0, kWhat, ": scale must be finite and >= 0, got ", scale);
  FLASH_CHECK(window_left >= -1 && window_right >= -1, kWhat, ": window sizes must be >= -1");
  FLASH_CHECK(std::isfinite(softcap) && softcap >= 0, kWhat, ": softcap must be finite and >= 0, got ", softcap);
  for (const at::Tensor* d : {&q_descale, &k_descale, &v_descale}) {
    FLASH_CHECK(d->scalar_type() == at::kFloat && d->is_contiguous() && d->device() == q_in.device() &&
                    d->dim() == 2 && d->size(0) == s.B && d->size(1) == s.Hkv,
                kWhat, ": descales must be contiguous float32 (batch, kv_heads) tensors on q's device");
  }
  const auto prop = at::cuda::getDeviceProperties(q_in.device().index());
  const int arch = emulated_arch() > 0 ? emulated_arch() : prop->major * 10 + prop->minor;
  FLASH_CHECK(arch == 90, kWhat, ": the FP8 forward runs on Hopper (sm_90) GPUs, got compute capability ",
              prop->major, ".", prop->minor);

  const c10::cuda::CUDAGuard guard(q_in.device());
  at::Tensor out = at::empty(q_in.sizes(), q_in.options().dtype(out_dtype));
  at::Tensor lse = at::empty(s.lse_shape(), q_in.options().dtype(at::kFloat));
  if (s.empty()) {
    out.zero_();
    lse.fill_(-INFINITY);
    return {out, lse};
  }
  const at::Tensor q = aligned(q_in), k = aligned(k_in), v = aligned(v_in);
  const at::Tensor vt = fp8_v_layout_impl(v, cu_seqlens_k, s.B, s.Sk);
  MaskArgs m;
  m.window_left = window_left;
  m.window_right = window_right;
  m.softcap = softcap;
  if (varlen) {
    m.cu_seqlens_q = *cu_seqlens_q;
    m.cu_seqlens_k = *cu_seqlens_k;
    m.max_seqlen_q = max_seqlen_q;
    m.max_seqlen_k = max_seqlen_k;
  }
  FwdParams p;
  fill_fwd(p, s, m, q, k, v, out, lse, scale);
  // V^T [b][hkv][d][sk_pad] in V's place (tiers/wgmma/tma_maps.h: make_fp8_tensor_maps).
  p.v = vt.data_ptr();
  p.v_batch_stride = vt.stride(0);
  p.v_head_stride = vt.stride(1);
  p.v_row_stride = vt.stride(2);
  p.q_descale = q_descale.data_ptr<float>();
  p.k_descale = k_descale.data_ptr<float>();
  p.v_descale = v_descale.data_ptr<float>();
  // The tile scheduler's counter (core/scheduler.cuh), as the 16-bit forward's (WgmmaFamily::plan):
  // where the persistent grid has more tiles of 64 rows or more than SMs.
  at::Tensor counter;
  if ((s.Sq + 63) / 64 * s.Hq * s.B > p.num_sms) {
    counter = zeroed_on_stream({1}, q_in.options().dtype(at::kInt));
    p.tile_counter = counter.data_ptr<int>();
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  const bool bf16 = out_dtype == at::kBFloat16;
  auto run = [&](auto head_dim) {
    constexpr int kD = decltype(head_dim)::value;
    return bf16 ? run_fwd_sm90_fp8<kBF16, kD>(p, stream) : run_fwd_sm90_fp8<kF16, kD>(p, stream);
  };
  const bool ran = s.D == 64    ? run(std::integral_constant<int, 64>{})
                   : s.D == 128 ? run(std::integral_constant<int, 128>{})
                                : run(std::integral_constant<int, 256>{});
  FLASH_CHECK(ran, kWhat, ": no FP8 kernel ran (the extension was built without sm_90a, or TMA cannot address these "
              "views: q and k need 16-byte aligned rows)");
  return {out, lse};
}

// out, lse = fwd_fp8(q, k, v, q_descale, k_descale, v_descale, scale, window_left, window_right,
//                    softcap, out_dtype): fp8_forward on a dense batch.
std::tuple<at::Tensor, at::Tensor> fwd_fp8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& q_descale, const at::Tensor& k_descale,
                                           const at::Tensor& v_descale, double scale, int64_t window_left,
                                           int64_t window_right, double softcap, at::ScalarType out_dtype) {
  return fp8_forward("flash_cuda.attention_fp8", q, k, v, nullptr, nullptr, 0, 0, q_descale, k_descale, v_descale,
                     scale, window_left, window_right, softcap, out_dtype);
}

// out, lse = fwd_fp8_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_descale,
//                           k_descale, v_descale, scale, window_left, window_right, softcap, out_dtype):
// fp8_forward on a packed batch.
std::tuple<at::Tensor, at::Tensor> fwd_fp8_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                                  int64_t max_seqlen_q, int64_t max_seqlen_k,
                                                  const at::Tensor& q_descale, const at::Tensor& k_descale,
                                                  const at::Tensor& v_descale, double scale, int64_t window_left,
                                                  int64_t window_right, double softcap, at::ScalarType out_dtype) {
  return fp8_forward("flash_cuda.varlen_attention_fp8", q, k, v, &cu_seqlens_q, &cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, q_descale, k_descale, v_descale, scale, window_left, window_right, softcap,
                     out_dtype);
}

// fp8_v_layout(v): V (batch, kv_heads, seqlen_k, head_dim) in float8_e4m3fn laid out for the FP8
// forward's P V product (core/fp8_v_layout.cuh): (batch, kv_heads, head_dim, seqlen_k rounded up
// to 32), each head dim's keys contiguous in the order of P's A fragments (core/fragment.cuh:
// e4m3_pv_key), zeros past seqlen_k. For the FP8 forward and for tests of that order.
// V^T of a dense v (batch, kv_heads, seqlen_k, head_dim) or, with cu_seqlens_k, of a packed v
// (total_k, kv_heads, head_dim) in `batch` slots of max_seqlen_k keys (core/fp8_v_layout.cuh).
at::Tensor fp8_v_layout_impl(const at::Tensor& v, const at::Tensor* cu_seqlens_k, int64_t batch, int64_t max_seqlen_k) {
  const bool packed = cu_seqlens_k != nullptr;
  FLASH_CHECK(v.is_cuda(), "flash_cuda.fp8_v_layout: v must be a CUDA tensor");
  FLASH_CHECK(v.scalar_type() == at::kFloat8_e4m3fn, "flash_cuda.fp8_v_layout: v must be float8_e4m3fn, got ",
              v.scalar_type());
  FLASH_CHECK(v.dim() == (packed ? 3 : 4), packed ? "flash_cuda.fp8_v_layout: a packed v must be (total_k, kv_heads, head_dim), got "
                                                  : "flash_cuda.fp8_v_layout: v must be (batch, kv_heads, seqlen_k, head_dim), got ",
              v.sizes());
  const int64_t d = v.size(-1), hkv = v.size(-2 - (packed ? 0 : 1));
  FLASH_CHECK(d % 16 == 0 && d > 0 && d <= 256, "flash_cuda.fp8_v_layout: head_dim must be a multiple of 16 in [16, 256], got ", d);
  FLASH_CHECK(v.stride(-1) == 1 && v.stride(-2 - (packed ? 1 : 0)) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(v.data_ptr()) % 16 == 0,
              "flash_cuda.fp8_v_layout: v's rows must be contiguous and 16-byte aligned (stride(-1) == 1, "
              "the row stride a multiple of 16)");
  const int64_t sk = packed ? max_seqlen_k : v.size(2);
  FLASH_CHECK(batch * hkv <= 65535 && sk <= INT32_MAX - 64 && v.size(0) <= INT32_MAX,
              "flash_cuda.fp8_v_layout: v is too large (batch * kv_heads must be at most 65535)");
  Fp8VLayoutParams p;
  p.b = static_cast<int>(batch);
  p.hkv = static_cast<int>(hkv);
  p.sk = static_cast<int>(sk);
  p.d = static_cast<int>(d);
  p.sk_pad = (p.sk + 31) / 32 * 32;
  at::Tensor vt = at::empty({batch, hkv, d, p.sk_pad}, v.options());
  p.v = v.data_ptr();
  if (packed) {
    p.v_batch_stride = 0;
    p.v_head_stride = v.stride(1);
    p.v_row_stride = v.stride(0);
    p.cu_seqlens = cu_seqlens_k->data_ptr<int32_t>();
    p.rows = static_cast<int>(v.size(0));
  } else {
    p.v_batch_stride = v.stride(0);
    p.v_head_stride = v.stride(1);
    p.v_row_stride = v.stride(2);
  }
  p.vt = vt.data_ptr();
  if (vt.numel() == 0) return vt;
  const c10::cuda::CUDAGuard guard(v.device());
  run_fp8_v_layout<uint8_t>(p, at::cuda::getCurrentCUDAStream().stream());
  return vt;
}

at::Tensor fp8_v_layout(const at::Tensor& v) {
  FLASH_CHECK(v.dim() == 4, "flash_cuda.fp8_v_layout: v must be (batch, kv_heads, seqlen_k, head_dim), got ",
              v.sizes());
  return fp8_v_layout_impl(v, nullptr, v.size(0), v.size(2));
}

// fp8_v_layout_packed(v, cu_seqlens_k, max_seqlen_k): a packed v (total_k, kv_heads, head_dim) in one
// slot of max_seqlen_k keys (rounded up to 32) per sequence, as varlen_attention_fp8 lays it out; for
// tests of that layout.
at::Tensor fp8_v_layout_packed(const at::Tensor& v, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_k) {
  FLASH_CHECK(cu_seqlens_k.scalar_type() == at::kInt && cu_seqlens_k.dim() == 1 && cu_seqlens_k.size(0) >= 2 &&
                  cu_seqlens_k.is_contiguous() && cu_seqlens_k.device() == v.device(),
              "flash_cuda.fp8_v_layout_packed: cu_seqlens_k must be a contiguous 1-d int32 tensor of batch + 1 >= 2 "
              "entries on v's device");
  FLASH_CHECK(max_seqlen_k >= 0, "flash_cuda.fp8_v_layout_packed: max_seqlen_k must be >= 0");
  return fp8_v_layout_impl(v, &cu_seqlens_k, cu_seqlens_k.size(0) - 1, max_seqlen_k);
}

}  // namespace flash_cuda

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_cuda kernels (use flash_cuda.attention / varlen_attention, not this module)";
  // Whether this build has the ablation rungs of the optimization record (include/ablation.h).
  m.attr("ablations") = pybind11::bool_(flash_cuda::kAblations);
  m.def("fwd", &flash_cuda::fwd, "attention forward: (out, lse, aux)", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("scale"), py::arg("window_left"), py::arg("window_right"), py::arg("softcap"),
        py::arg("alibi_slopes"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"),
        py::arg("max_seqlen_k"), py::arg("tier"), py::arg("dropout_p") = 0.0, py::arg("rng_state") = py::none(),
        py::arg("sinks") = py::none(), py::arg("sm_margin") = 0);
  m.def("bwd", &flash_cuda::bwd, "attention backward: (dq, dk, dv)", py::arg("dout"), py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("aux"), py::arg("dlse"),
        py::arg("scale"), py::arg("window_left"), py::arg("window_right"), py::arg("softcap"),
        py::arg("alibi_slopes"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_q"),
        py::arg("max_seqlen_k"), py::arg("deterministic"), py::arg("tier"), py::arg("need_dq") = true,
        py::arg("need_dkdv") = true, py::arg("dropout_p") = 0.0, py::arg("rng_state") = py::none());
  py::class_<flash_cuda::DirectPlan>(m, "DirectPlan", "a dense call's checked options, for fwd_direct / bwd_direct")
      .def(py::init([](double scale, int64_t window_left, int64_t window_right, double softcap, int64_t tier,
                       bool deterministic) {
             return flash_cuda::DirectPlan{scale, window_left, window_right, softcap, tier, deterministic};
           }),
           py::arg("scale"), py::arg("window_left"), py::arg("window_right"), py::arg("softcap"), py::arg("tier"),
           py::arg("deterministic"));
  m.def("fwd_direct", &flash_cuda::fwd_direct,
        "fwd of a dense call without ALiBi slopes, sinks or dropout: (out, lse, aux or None)");
  m.def("bwd_direct", &flash_cuda::bwd_direct, "bwd of a call whose forward ran fwd_direct: (dq, dk, dv)");
  m.def("attention_direct", &flash_cuda::attention_direct,
        "fwd_direct with its backward recorded for autograd (a C++ node): (out, lse)");
  m.def("fwd_kvcache", &flash_cuda::fwd_kvcache, "attention against a KV cache, new keys appended: (out, lse)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_new"), py::arg("v_new"),
        py::arg("cache_seqlens"), py::arg("cache_len"), py::arg("block_table"), py::arg("scale"),
        py::arg("window_left"), py::arg("window_right"), py::arg("softcap"), py::arg("alibi_slopes"),
        py::arg("num_splits"), py::arg("return_lse"), py::arg("sinks") = py::none(),
        py::arg("k_descale") = py::none(), py::arg("v_descale") = py::none());
  py::class_<flash_cuda::KvcacheDirectPlan>(m, "KvcacheDirectPlan",
                                            "a KV-cache call's checked options, for fwd_kvcache_direct")
      .def(py::init([](double scale, int64_t window_left, int64_t window_right, double softcap, int64_t num_splits,
                       bool return_lse) {
             return flash_cuda::KvcacheDirectPlan{scale, window_left, window_right, softcap, num_splits, return_lse};
           }),
           py::arg("scale"), py::arg("window_left"), py::arg("window_right"), py::arg("softcap"),
           py::arg("num_splits"), py::arg("return_lse"));
  m.def("fwd_kvcache_direct", &flash_cuda::fwd_kvcache_direct,
        "fwd_kvcache of a call without ALiBi slopes or sinks, with a tensor cache_seqlens: (out, lse)");
  m.def("dropout_mask", &flash_cuda::dropout_mask,
        "the mask of kept elements the kernels' dropout draws (uint8, batch x heads x sq x sk)");
  m.def("merge_partials", &flash_cuda::merge_partials,
        "merges two partial (out, lse[, stats]) results of the same rows into out (context parallelism)");
  m.def("fwd_fp8", &flash_cuda::fwd_fp8,
        "the FP8 (e4m3) forward on Hopper: (out, lse); descales float32 (batch, kv_heads)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("q_descale"), py::arg("k_descale"), py::arg("v_descale"),
        py::arg("scale"), py::arg("window_left"), py::arg("window_right"), py::arg("softcap"),
        py::arg("out_dtype"));
  m.def("fwd_fp8_varlen", &flash_cuda::fwd_fp8_varlen,
        "the FP8 (e4m3) forward on Hopper over a packed batch: (out, lse); descales float32 (batch, kv_heads)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"),
        py::arg("max_seqlen_q"), py::arg("max_seqlen_k"), py::arg("q_descale"), py::arg("k_descale"),
        py::arg("v_descale"), py::arg("scale"), py::arg("window_left"), py::arg("window_right"), py::arg("softcap"),
        py::arg("out_dtype"));
  m.def("fp8_v_layout_packed", &flash_cuda::fp8_v_layout_packed,
        "a packed V (total_k, kv_heads, head_dim) e4m3 laid out in one slot of max_seqlen_k keys per sequence",
        py::arg("v"), py::arg("cu_seqlens_k"), py::arg("max_seqlen_k"));
  m.def("fp8_v_layout", &flash_cuda::fp8_v_layout,
        "V (batch, kv_heads, seqlen_k, head_dim) e4m3 laid out for the FP8 forward's P V product");
}
