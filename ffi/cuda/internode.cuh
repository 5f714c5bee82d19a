// Device-side internode puts that another kernel issues inline (internode.h's step 5 fused into
// the op's own kernel): declared here, defined in internode.cu, the only file that calls NVSHMEM
// (the kernels are built with -rdc, so these link across files). They exist only in a build with
// NVSHMEM (JAXEP_HAVE_NVSHMEM): callers guard their calls with it.
#pragma once

#include <cstdint>

#include "team.cuh"

namespace jaxep::cuda::mr {

// Whole warp, uniform arguments: put row j (`bytes`) of my region n's out area to peer n (rank
// (n, my local index)), into the region I host for it, and add 1 to its rin_rows[my node] once
// the data is there. The warp's writes of the row must precede the call (it fences them).
__device__ void PutReturnRow(const Team& team, int n, int32_t j, int64_t bytes);

// Every thread of a kernel that called PutReturnRow, at its end: its puts complete (quiet).
__device__ void QuietPuts();

}  // namespace jaxep::cuda::mr
