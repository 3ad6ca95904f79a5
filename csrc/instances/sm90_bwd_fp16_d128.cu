// Instance: Hopper (wgmma) backward, fp16, head dim 128.
#include "../kernels/sm90_bwd.cuh"

namespace flash_cuda {
template bool run_bwd_sm90<static_cast<int>(DType::kFloat16), 128>(const BwdParams&, cudaStream_t);
}  // namespace flash_cuda
