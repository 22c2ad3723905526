// PD copy kernel: one layer of a run of KV blocks from one place to another,
// every cache role, in one launch (kernels/pd_copy.py launches it).
//
// Why: prefill/decode disaggregation moves a request's KV layer by layer. As
// CuPy ops a frame was an id upload, a gather into a temporary and a scatter
// per role (~250 us of host work a frame, ~2% of a contiguous copy's rate).
// Here each side is described per role by a base address (index 0 of layer
// 0), a layer stride and a stride (bytes from one index to the next), and by
// an optional int32 index table on the device (null: index = position in the
// frame). Only ``layer`` changes from one layer of a chunk to the next, so the
// host packs a chunk's arguments once and patches the layer per launch:
//
//   cache -> cache  (two engines' pools, one GPU or peers): both sides tables;
//   cache -> rows   (gather into pinned staging, wire order): base = staging +
//                   the role's offset in a row, stride = the row's bytes;
//   rows  -> cache  (scatter from pinned staging): the other way round.
//
// Work is split like the swap kernel's (swap.cu): units of (block, chunk),
// chunks running across the roles of a block, one warp per unit grid-stride,
// 16-byte vectors with 8 loads in flight per lane (swap_copy.cuh). Host rows
// in pinned memory are dereferenced directly (UVA), as the swap kernel does.
#include "swap_copy.cuh"

using namespace kvflow;

// Passed by value (kernel parameter space): no table upload per frame.
// Layout must match kernels/pd_copy.py (pack_args).
struct PdCopyArgs {
  u64 src_base[kMaxRoles];
  u64 dst_base[kMaxRoles];
  i64 src_layer_stride[kMaxRoles];
  i64 dst_layer_stride[kMaxRoles];
  i64 src_stride[kMaxRoles];
  i64 dst_stride[kMaxRoles];
  i64 bytes[kMaxRoles];        // bytes of the role per block (multiple of 16)
  i64 first[kMaxRoles];        // the role's first chunk within a block's chunks
  u64 src_ids;                 // int32 [num_blocks] on the device, or 0: position
  u64 dst_ids;                 // likewise
  i64 num_roles;
  i64 chunks_per_block;
  i64 num_blocks;
  i64 layer;                   // last: patched per launch
};
// kernels/pd_copy.py ARGS_BYTES (tests/test_pd_copy_plan.py reads it); every member is
// 8 bytes, so ``layer`` is at ARGS_BYTES - 8, where the launcher patches it. (No
// offsetof: NVRTC, which compiles this at run time, has neither it nor the builtin.)
static_assert(sizeof(PdCopyArgs) == 560, "PdCopyArgs size");

constexpr int kPdThreads = 256;

extern "C" __global__ void __launch_bounds__(kPdThreads)
kvflow_pd_copy(const __grid_constant__ PdCopyArgs a) {
  __shared__ u64 s_src[kMaxRoles];
  __shared__ u64 s_dst[kMaxRoles];
  __shared__ i64 s_sstride[kMaxRoles];
  __shared__ i64 s_dstride[kMaxRoles];
  __shared__ i64 s_bytes[kMaxRoles];
  __shared__ i64 s_first[kMaxRoles];
  const int nroles = static_cast<int>(a.num_roles);
  if (threadIdx.x < nroles) {
    const int r = threadIdx.x;
    s_src[r] = a.src_base[r] + a.layer * a.src_layer_stride[r];
    s_dst[r] = a.dst_base[r] + a.layer * a.dst_layer_stride[r];
    s_sstride[r] = a.src_stride[r];
    s_dstride[r] = a.dst_stride[r];
    s_bytes[r] = a.bytes[r];
    s_first[r] = a.first[r];
  }
  __syncthreads();

  const int* __restrict__ src_ids = reinterpret_cast<const int*>(a.src_ids);
  const int* __restrict__ dst_ids = reinterpret_cast<const int*>(a.dst_ids);
  const int lane = threadIdx.x & (kWarpSize - 1);
  const i64 warps_per_cta = blockDim.x / kWarpSize;
  const i64 num_warps = warps_per_cta * gridDim.x;
  const i64 cpb = a.chunks_per_block;
  const i64 total = a.num_blocks * cpb;

  for (i64 u = blockIdx.x * warps_per_cta + threadIdx.x / kWarpSize; u < total;
       u += num_warps) {
    const i64 i = u / cpb;
    const i64 c = u - i * cpb;
    int r = 0;
#pragma unroll
    for (int k = 1; k < kMaxRoles; ++k) {
      if (k < nroles && c >= s_first[k]) r = k;
    }
    const i64 si = src_ids ? static_cast<i64>(src_ids[i]) : i;
    const i64 di = dst_ids ? static_cast<i64>(dst_ids[i]) : i;
    const i64 off = (c - s_first[r]) * kChunkBytes;
    const i64 len = min(static_cast<i64>(kChunkBytes), s_bytes[r] - off);
    const char* src = reinterpret_cast<const char*>(s_src[r]) + si * s_sstride[r] + off;
    char* dst = reinterpret_cast<char*>(s_dst[r]) + di * s_dstride[r] + off;
    warp_copy_chunk(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst),
                    static_cast<int>(len / kVecBytes), lane);
  }
}
