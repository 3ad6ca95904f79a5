// fp32 SIMT backward (delta, dK/dV, dQ), head-dim bucket 32 (every d <= 32, multiple of 8).
#include "../kernels/simt_bwd.cuh"

namespace flash_cuda {
template int64_t plan_bwd_simt<32>(BwdParams&);
template void run_bwd_simt<32>(const BwdParams&, cudaStream_t);
}  // namespace flash_cuda
