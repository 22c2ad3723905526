// Device helpers for the swap kernels: one warp copies one chunk of a block.
//
// Why this shape: KV blocks are scattered, so each (layer, role, block) piece
// is a separate contiguous copy of 16 B .. 512 KB. A warp per chunk, 16-byte
// vector accesses and 8 loads in flight per lane keep enough bytes in flight
// (4 KB per warp) to hide PCIe latency with only a handful of CTAs, leaving the
// rest of the GPU to compute.
//
// Tried and dropped (benchmarks/RESULTS.md): L2::128B/L2::256B prefetch hints
// and ld.global.nc on the loads, streaming/write-through stores, and Hopper
// bulk copies (cp.async.bulk) through shared memory: none moved the ~92% (host
// -> device) / ~94% (device -> host) of the copy engine that SM-issued PCIe
// traffic reaches on an H100.
#pragma once

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

// Copy nvec 16-byte vectors (nvec <= kWarpSize * kUnroll) with the whole warp:
// all loads are issued before the first store so 8 requests per lane are in flight.
__device__ __forceinline__ void warp_copy_chunk(const uint4* __restrict__ src,
                                                uint4* __restrict__ dst,
                                                int nvec, int lane) {
  uint4 buf[kUnroll];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int i = lane + k * kWarpSize;
    if (i < nvec) buf[k] = __ldcs(src + i);  // streamed: read once
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int i = lane + k * kWarpSize;
    if (i < nvec) dst[i] = buf[k];
  }
}

}  // namespace kvflow
