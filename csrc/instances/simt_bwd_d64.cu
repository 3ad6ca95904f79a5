// fp32 SIMT backward (delta, dK/dV, dQ), head-dim bucket 64 (every d <= 64, multiple of 8).
#include "../kernels/simt_bwd.cuh"

namespace flash_cuda {
template void run_bwd_simt<64>(const BwdParams&, cudaStream_t);
}  // namespace flash_cuda
