// fp32 SIMT backward (delta, dK/dV, dQ), head-dim bucket 256 (every d <= 256, multiple of 8).
#include "../kernels/simt_bwd.cuh"

namespace flash_cuda {
template int64_t plan_bwd_simt<256>(BwdParams&);
template void run_bwd_simt<256>(const BwdParams&, cudaStream_t);
}  // namespace flash_cuda
