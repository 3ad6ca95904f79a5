// Instance: tensor-core forward, fp16, head-dim bucket 96.
#include "../kernels/mma_fwd.cuh"

namespace flash_cuda {
template void run_fwd_mma<static_cast<int>(DType::kFloat16), 96>(const FwdParams&, cudaStream_t);
}  // namespace flash_cuda
