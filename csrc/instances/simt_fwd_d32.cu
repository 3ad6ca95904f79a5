// fp32 SIMT forward, head-dim bucket 32 (every d <= 32, multiple of 8).
#include "../kernels/simt_fwd_outer.cuh"

namespace flash_cuda {
template int64_t plan_fwd_simt<32>(FwdParams&);
template void run_fwd_simt<32>(const FwdParams&, cudaStream_t);
}  // namespace flash_cuda
