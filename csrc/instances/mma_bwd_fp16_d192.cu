// Instance: tensor-core backward, fp16, head-dim bucket 192.
#include "../kernels/mma_bwd.cuh"

namespace flash_cuda {
template void run_bwd_mma<static_cast<int>(DType::kFloat16), 192>(const BwdParams&, cudaStream_t);
}  // namespace flash_cuda
