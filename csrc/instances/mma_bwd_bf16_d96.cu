// Instance: tensor-core backward, bf16, head-dim bucket 96.
#include "../kernels/mma_bwd.cuh"

namespace flash_cuda {
template void run_bwd_mma<static_cast<int>(DType::kBFloat16), 96>(const BwdParams&, cudaStream_t);
}  // namespace flash_cuda
