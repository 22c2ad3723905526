// Device helpers for the swap kernels: one warp copies one chunk of a block.
//
// Why this shape: KV blocks are scattered, so each (layer, role, block) piece
// is a separate contiguous copy of 16 B .. 512 KB. A warp per chunk, 16-byte
// vector accesses and 8 loads in flight per lane keep enough bytes in flight
// (4 KB per warp) to hide PCIe latency with only a handful of CTAs, leaving the
// rest of the GPU to compute.
#pragma once

// How source vectors are loaded (a compile-time choice the benchmark compares):
// 0: ld.global.cs (streaming); 1: + L2::128B prefetch; 2: + L2::256B prefetch;
// 3: ld.global.nc + L2::256B. A larger L2 prefetch asks for more bytes per
// PCIe read request when the source is pinned host memory.
#ifndef KVFLOW_LOAD_VARIANT
#define KVFLOW_LOAD_VARIANT 0
#endif
// How destination vectors are stored: 0: default (write-back); 1: st.global.cs
// (streaming); 2: st.global.wt (write-through). Matters when the destination is
// host memory, where the L2 decides how writes leave for PCIe.
#ifndef KVFLOW_STORE_VARIANT
#define KVFLOW_STORE_VARIANT 0
#endif

namespace kvflow {

typedef unsigned long long u64;
typedef long long i64;

constexpr int kWarpSize = 32;
constexpr int kVecBytes = 16;
constexpr int kUnroll = 8;
// Bytes one warp moves per step; kernels/plan.py CHUNK_BYTES must match.
constexpr int kChunkBytes = kWarpSize * kVecBytes * kUnroll;
// Roles per layer (K, V, scales, indexer...); kernels/plan.py MAX_ROLES must match.
constexpr int kMaxRoles = 8;

__device__ __forceinline__ uint4 load_vec(const uint4* p) {
#if KVFLOW_LOAD_VARIANT == 0
  return __ldcs(p);
#else
  uint4 v;
#if KVFLOW_LOAD_VARIANT == 1
  asm("ld.global.cs.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
#elif KVFLOW_LOAD_VARIANT == 2
  asm("ld.global.cs.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
#else
  asm("ld.global.nc.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
#endif
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
#endif
}

__device__ __forceinline__ void store_vec(uint4* p, const uint4& v) {
#if KVFLOW_STORE_VARIANT == 0
  *p = v;
#elif KVFLOW_STORE_VARIANT == 1
  __stcs(p, v);
#else
  __stwt(p, v);
#endif
}

// Copy nvec 16-byte vectors (nvec <= kWarpSize * kUnroll) with the whole warp:
// all loads are issued before the first store so 8 requests per lane are in flight.
__device__ __forceinline__ void warp_copy_chunk(const uint4* __restrict__ src,
                                                uint4* __restrict__ dst,
                                                int nvec, int lane) {
  uint4 buf[kUnroll];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int i = lane + k * kWarpSize;
    if (i < nvec) buf[k] = load_vec(src + i);
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int i = lane + k * kWarpSize;
    if (i < nvec) store_vec(dst + i, buf[k]);
  }
}

}  // namespace kvflow
