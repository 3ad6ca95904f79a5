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
  TORCH_CHECK(tier >= 0 && tier <= 3, "flash_cuda: unknown kernel tier ", tier);
  Tier t = static_cast<Tier>(tier);
  if (t == Tier::kAuto && dtype == DType::kFloat32) t = Tier::kSimt;
  TORCH_CHECK(t != Tier::kSimt || dtype == DType::kFloat32,
              "flash_cuda: the 'simt' kernel takes float32 inputs only");
  TORCH_CHECK((t != Tier::kMma && t != Tier::kWgmma) || dtype != DType::kFloat32,
              "flash_cuda: the 'mma' and 'wgmma' kernels take float16 or bfloat16 inputs only");
  return t;
}

// Every kernel reads rows with 16-byte vectors: the base pointer and every stride that
// matters (of a dimension longer than 1) must be 16-byte multiples. Views that are not
// get a packed copy (the common layouts — contiguous, (B,S,H,D).transpose(1,2) — never do).
at::Tensor aligned(const at::Tensor& t) {
  const int64_t esize = t.element_size();
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int i = 0; i < 3 && ok; ++i) {
    if (t.size(i) > 1 && (t.stride(i) * esize) % 16 != 0) ok = false;
  }
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.is_cuda() && k.is_cuda() && v.is_cuda(), "flash_cuda: q, k, v must be CUDA tensors");
  TORCH_CHECK(q.device() == k.device() && q.device() == v.device(),
              "flash_cuda: q, k, v must be on the same device");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "flash_cuda: q, k, v must be 4-d (batch, heads, seq, head_dim)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "flash_cuda: q, k, v must share one dtype");
  dtype_of(q);
  TORCH_CHECK(q.stride(-1) == 1 && k.stride(-1) == 1 && v.stride(-1) == 1,
              "flash_cuda: the last dimension of q, k, v must be contiguous (stride 1)");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B, "flash_cuda: q, k, v batch sizes differ");
  TORCH_CHECK(k.size(3) == D && v.size(3) == D, "flash_cuda: q, k, v head dims differ");
  TORCH_CHECK(k.sizes() == v.sizes(), "flash_cuda: k and v shapes differ");
  const int64_t Hkv = k.size(1);
  TORCH_CHECK(Hkv > 0 || Hq == 0, "flash_cuda: k/v have zero heads");
  TORCH_CHECK(Hkv == 0 || Hq % Hkv == 0, "flash_cuda: query heads (", Hq,
              ") must be a multiple of key/value heads (", Hkv, ")");
  TORCH_CHECK(D % 8 == 0 && D >= 8 && D <= 256,
              "flash_cuda: head dim must be a multiple of 8 in [8, 256], got ", D);
  TORCH_CHECK(B < 65536 && Hq < 65536, "flash_cuda: batch and heads must be < 65536");
  TORCH_CHECK(q.size(2) < (int64_t(1) << 31) && k.size(2) < (int64_t(1) << 31),
              "flash_cuda: sequence lengths must be < 2^31");
  const auto prop = at::cuda::getDeviceProperties(q.device().index());
  TORCH_CHECK(prop->major >= 8, "flash_cuda: needs a GPU of compute capability 8.0 or newer, got ",
              prop->major, ".", prop->minor);
}

void fill_fwd(FwdParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& out, const at::Tensor& lse, double scale, bool is_causal) {
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.o = out.data_ptr();
  p.q_batch_stride = q.stride(0), p.q_head_stride = q.stride(1), p.q_row_stride = q.stride(2);
  p.k_batch_stride = k.stride(0), p.k_head_stride = k.stride(1), p.k_row_stride = k.stride(2);
  p.v_batch_stride = v.stride(0), p.v_head_stride = v.stride(1), p.v_row_stride = v.stride(2);
  p.o_batch_stride = out.stride(0), p.o_head_stride = out.stride(1), p.o_row_stride = out.stride(2);
  p.softmax_lse = lse.data_ptr<float>();
  p.b = static_cast<int>(q.size(0));
  p.hq = static_cast<int>(q.size(1));
  p.hkv = static_cast<int>(k.size(1));
  p.sq = static_cast<int>(q.size(2));
  p.sk = static_cast<int>(k.size(2));
  p.d = static_cast<int>(q.size(3));
  // Kernels take the row max of the raw scores and fold the scale into the exp2's FFMA,
  // which needs scale >= 0 (callers fold a negative scale into q). scale_log2 stays a
  // normal float so that masked (-inf) scores times it stay -inf, never NaN; the exact
  // p.scale (0 included) is what the gradients use.
  TORCH_CHECK(scale >= 0, "flash_cuda: internal error: negative scale reached the kernels");
  p.scale = static_cast<float>(scale);
  p.scale_log2 = std::max(static_cast<float>(scale * M_LOG2E), 1e-30f);
  p.is_causal = is_causal;
  p.dtype = dtype_of(q);
  const auto prop = at::cuda::getDeviceProperties(q.device().index());
  p.sm_arch = prop->major * 10 + prop->minor;
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

#define FLASH_MMA_BUCKETS(DT, FN, P, S)                                   \
  switch (mma_bucket((P).d)) {                                            \
    case 32: FN<DT, 32>(P, S); break;                                     \
    case 64: FN<DT, 64>(P, S); break;                                     \
    case 96: FN<DT, 96>(P, S); break;                                     \
    case 128: FN<DT, 128>(P, S); break;                                   \
    case 192: FN<DT, 192>(P, S); break;                                   \
    default: FN<DT, 256>(P, S); break;                                    \
  }

#define FLASH_SIMT_BUCKETS(FN, P, S)                                      \
  switch (simt_bucket((P).d)) {                                           \
    case 32: FN<32>(P, S); break;                                         \
    case 64: FN<64>(P, S); break;                                         \
    case 128: FN<128>(P, S); break;                                       \
    default: FN<256>(P, S); break;                                        \
  }

constexpr int kF16 = static_cast<int>(DType::kFloat16);
constexpr int kBF16 = static_cast<int>(DType::kBFloat16);

// The Hopper tier serves head-dim buckets 64 and 128 (every d in 33..64 and 97..128).
// Returns false, having launched nothing, where it does not apply (other head dims, a GPU
// other than sm_90, or a build without the 90a target).
#define FLASH_SM90_BUCKETS(FN, P, S)                                                      \
  ((P).dtype == DType::kFloat16                                                           \
       ? (mma_bucket((P).d) == 64    ? FN<kF16, 64>(P, S)                                 \
          : mma_bucket((P).d) == 128 ? FN<kF16, 128>(P, S)                                \
                                     : false)                                             \
       : (mma_bucket((P).d) == 64    ? FN<kBF16, 64>(P, S)                                \
          : mma_bucket((P).d) == 128 ? FN<kBF16, 128>(P, S)                               \
                                     : false))

constexpr const char* kNoWgmma =
    "flash_cuda: kernel='wgmma' needs an sm_90 GPU (H100/H200), a flash_cuda build that includes "
    "the 90a target, and a head dim in 33..64 or 97..128; use kernel='auto' or 'mma'";

void dispatch_fwd(const FwdParams& p, Tier tier, cudaStream_t stream) {
  if (tier == Tier::kSimt) {
    FLASH_SIMT_BUCKETS(run_fwd_simt, p, stream);
    return;
  }
  if (tier == Tier::kAuto || tier == Tier::kWgmma) {
    if (FLASH_SM90_BUCKETS(run_fwd_sm90, p, stream)) return;
    TORCH_CHECK(tier == Tier::kAuto, kNoWgmma);
  }
  if (p.dtype == DType::kFloat16) {
    FLASH_MMA_BUCKETS(kF16, run_fwd_mma, p, stream);
  } else {
    FLASH_MMA_BUCKETS(kBF16, run_fwd_mma, p, stream);
  }
}

void dispatch_bwd(const BwdParams& p, Tier tier, cudaStream_t stream) {
  if (tier == Tier::kSimt) {
    FLASH_SIMT_BUCKETS(run_bwd_simt, p, stream);
    return;
  }
  if (tier == Tier::kAuto || tier == Tier::kWgmma) {
    if (FLASH_SM90_BUCKETS(run_bwd_sm90, p, stream)) return;
    TORCH_CHECK(tier == Tier::kAuto, kNoWgmma);
  }
  if (p.dtype == DType::kFloat16) {
    FLASH_MMA_BUCKETS(kF16, run_bwd_mma, p, stream);
  } else {
    FLASH_MMA_BUCKETS(kBF16, run_bwd_mma, p, stream);
  }
}

}  // namespace

// out, lse = fwd(q, k, v, scale, is_causal, tier)
std::tuple<at::Tensor, at::Tensor> fwd(const at::Tensor& q_in, const at::Tensor& k_in,
                                       const at::Tensor& v_in, double scale, bool is_causal,
                                       int64_t tier) {
  check_qkv(q_in, k_in, v_in);
  TORCH_CHECK(std::isfinite(scale), "flash_cuda: scale must be finite");
  const Tier t = resolve_tier(tier, dtype_of(q_in));
  const int64_t B = q_in.size(0), Hq = q_in.size(1), Sq = q_in.size(2), Sk = k_in.size(2);

  at::Tensor out = at::empty_like(q_in);
  at::Tensor lse = at::empty({B, Hq, Sq}, q_in.options().dtype(at::kFloat));
  if (B == 0 || Hq == 0 || Sq == 0) return {out, lse};
  if (Sk == 0) {  // no key at all: every row is empty
    out.zero_();
    lse.fill_(-INFINITY);
    return {out, lse};
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
  fill_fwd(p, q, k, v, out, lse, scale, is_causal);
  at::Tensor workspace;  // partial results of split key ranges (fp32 tier), if the plan splits
  if (t == Tier::kSimt) {
    int64_t floats = 0;
    switch (simt_bucket(p.d)) {
      case 32: floats = plan_fwd_simt<32>(p); break;
      case 64: floats = plan_fwd_simt<64>(p); break;
      case 128: floats = plan_fwd_simt<128>(p); break;
      default: floats = plan_fwd_simt<256>(p); break;
    }
    if (floats > 0) {
      workspace = at::empty({floats}, q.options().dtype(at::kFloat));
      p.o_accum = workspace.data_ptr<float>();
    }
  }
  dispatch_fwd(p, t, at::cuda::getCurrentCUDAStream().stream());
  return {out, lse};
}

// dq, dk, dv = bwd(dout, q, k, v, out, lse, dlse, scale, is_causal, deterministic, tier)
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd(const at::Tensor& dout_in, const at::Tensor& q_in,
                                                   const at::Tensor& k_in, const at::Tensor& v_in,
                                                   const at::Tensor& out_in, const at::Tensor& lse_in,
                                                   const std::optional<at::Tensor>& dlse_in,
                                                   double scale, bool is_causal, bool deterministic,
                                                   int64_t tier) {
  check_qkv(q_in, k_in, v_in);
  TORCH_CHECK(std::isfinite(scale), "flash_cuda: scale must be finite");
  const Tier t = resolve_tier(tier, dtype_of(q_in));
  TORCH_CHECK(dout_in.sizes() == q_in.sizes() && out_in.sizes() == q_in.sizes(),
              "flash_cuda: dout and out must have q's shape");
  TORCH_CHECK(dout_in.scalar_type() == q_in.scalar_type() && out_in.scalar_type() == q_in.scalar_type(),
              "flash_cuda: dout and out must have q's dtype");
  TORCH_CHECK(dout_in.device() == q_in.device() && out_in.device() == q_in.device() &&
                  lse_in.device() == q_in.device(),
              "flash_cuda: dout, out, lse must be on q's device");
  const int64_t B = q_in.size(0), Hq = q_in.size(1), Sq = q_in.size(2), Sk = k_in.size(2);
  TORCH_CHECK(lse_in.scalar_type() == at::kFloat && lse_in.dim() == 3 && lse_in.size(0) == B &&
                  lse_in.size(1) == Hq && lse_in.size(2) == Sq,
              "flash_cuda: lse must be float32 of shape (B, Hq, Sq)");

  // The fp32 tier's default backward adds dQ with float atomics straight into dq (fp32):
  // dq starts at zero. Every other path writes each gradient element exactly once.
  const bool dq_atomic = t == Tier::kSimt && !deterministic;
  at::Tensor dq = dq_atomic ? at::zeros_like(q_in) : at::empty_like(q_in);
  at::Tensor dk = at::empty_like(k_in);
  at::Tensor dv = at::empty_like(v_in);
  if (B == 0 || Hq == 0 || Sq == 0 || Sk == 0) {
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
  at::Tensor delta = at::empty({B, Hq, Sq}, q.options().dtype(at::kFloat));
  if (poison_outputs()) {
    if (!dq_atomic) dq.fill_(NAN);
    dk.fill_(NAN);
    dv.fill_(NAN);
    delta.fill_(NAN);
  }

  BwdParams p;
  fill_fwd(p, q, k, v, out, lse, scale, is_causal);
  p.softmax_lse = const_cast<float*>(lse.data_ptr<float>());
  p.dout = dout.data_ptr();
  p.do_batch_stride = dout.stride(0), p.do_head_stride = dout.stride(1), p.do_row_stride = dout.stride(2);
  p.dlse = dlse.defined() ? dlse.data_ptr<float>() : nullptr;
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dq_batch_stride = dq.stride(0), p.dq_head_stride = dq.stride(1), p.dq_row_stride = dq.stride(2);
  p.dk_batch_stride = dk.stride(0), p.dk_head_stride = dk.stride(1), p.dk_row_stride = dk.stride(2);
  p.dv_batch_stride = dv.stride(0), p.dv_head_stride = dv.stride(1), p.dv_row_stride = dv.stride(2);
  p.delta = delta.data_ptr<float>();
  p.dq_accum = nullptr;  // no kernel needs a separate dQ accumulator
  p.deterministic = deterministic;
  at::Tensor workspace;  // partial dK/dV of split key blocks (fp32 tier), if the plan splits
  if (t == Tier::kSimt) {
    int64_t floats = 0;
    switch (simt_bucket(p.d)) {
      case 32: floats = plan_bwd_simt<32>(p); break;
      case 64: floats = plan_bwd_simt<64>(p); break;
      case 128: floats = plan_bwd_simt<128>(p); break;
      default: floats = plan_bwd_simt<256>(p); break;
    }
    if (floats > 0) {
      workspace = at::empty({floats}, q.options().dtype(at::kFloat));
      p.dkv_accum = workspace.data_ptr<float>();
    }
  }
  dispatch_bwd(p, t, at::cuda::getCurrentCUDAStream().stream());
  if (negative_scale) dq.neg_();
  return {dq, dk, dv};
}

}  // namespace flash_cuda

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "flash_cuda kernels (use flash_cuda.attention, not this module)";
  m.def("fwd", &flash_cuda::fwd, "attention forward: (out, lse)", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("scale"), py::arg("is_causal"), py::arg("tier"));
  m.def("bwd", &flash_cuda::bwd, "attention backward: (dq, dk, dv)", py::arg("dout"), py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"), py::arg("dlse"), py::arg("scale"),
        py::arg("is_causal"), py::arg("deterministic"), py::arg("tier"));
}
