// Grid sizing shared by the row-moving kernels of every op (plain C++, host side).
//
// Config.num_sms reaches the handlers as the `num_sms` attribute. It caps the grid of each
// row-moving kernel (row gathers, pulls, staging copies, combines) at num_sms * kBlocksPerSm
// blocks of 256 threads: the blocks a launch would keep resident on num_sms SMs at 4 blocks per SM.
// The hardware may still spread them over more SMs; the cap bounds the threads (and so the memory
// parallelism) the op brings, which is what the sweep measures. 0 means no cap: as many blocks as
// the work needs (each kernel's own maximum).
#pragma once

#include <algorithm>
#include <cstdint>

namespace jaxep::cuda {

constexpr int64_t kBlocksPerSm = 4;

// The block budget of a call for `num_sms` (0 = no cap).
inline int64_t MaxBlocksForSms(int64_t num_sms) { return num_sms > 0 ? num_sms * kBlocksPerSm : 0; }

// `blocks` clamped to [1, max_blocks] when max_blocks > 0, else to at least 1.
inline int64_t CapBlocks(int64_t blocks, int64_t max_blocks) {
  blocks = std::max<int64_t>(blocks, 1);
  return max_blocks > 0 ? std::min(blocks, max_blocks) : blocks;
}

}  // namespace jaxep::cuda
