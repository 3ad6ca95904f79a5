// fp32 SIMT backward (delta, dK/dV, dQ), head-dim bucket 128 (every d <= 128, multiple of 8).
#include "../kernels/simt_bwd.cuh"

namespace flash_cuda {
template int64_t plan_bwd_simt<128>(BwdParams&);
template void run_bwd_simt<128>(const BwdParams&, cudaStream_t);
}  // namespace flash_cuda
