// fp32 SIMT forward, head-dim bucket 64 (every d <= 64, multiple of 8).
#include "../kernels/simt_fwd_outer.cuh"

namespace flash_cuda {
template int64_t plan_fwd_simt<64>(FwdParams&);
template void run_fwd_simt<64>(const FwdParams&, cudaStream_t);
}  // namespace flash_cuda
