// Instance: Hopper (wgmma) forward, fp16, head dim 128.
#include "../kernels/sm90_fwd.cuh"

namespace flash_cuda {
template bool run_fwd_sm90<static_cast<int>(DType::kFloat16), 128>(const FwdParams&, cudaStream_t);
}  // namespace flash_cuda
