// Experimental swap kernel on Hopper's bulk-copy engine (TMA, cp.async.bulk).
//
// Same contract and unit decomposition as swap.cu (one unit = a chunk of
// kChunkBytes of one role of one block of one layer), but each unit moves as
// one bulk load into a shared-memory slot and one bulk store out of it, so
// the SM's copy engine, not 16-byte loads, talks to PCIe. Why try it: loads
// issued by threads reach host memory as 128-byte reads, which caps host ->
// device at ~92% of the copy engine; bulk copies may use larger requests.
// One thread per slot; slots per CTA = blockDim.x; dynamic shared memory =
// blockDim.x * kChunkBytes.
#include "swap_copy.cuh"

using namespace kvflow;

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

extern "C" __global__ void __launch_bounds__(64, 1)
kvflow_swap_blocks_bulk(const u64 table_addr, const u64 roles_addr, const i64 num_roles,
                        const i64 chunks_per_block, const i64 layer_begin,
                        const i64 num_layers, const u64 ids_addr, const i64 num_blocks) {
  extern __shared__ __align__(128) unsigned char slots[];
  __shared__ __align__(8) unsigned long long bars[64];
  __shared__ i64 s_bytes[kMaxRoles];
  __shared__ i64 s_first[kMaxRoles];
  const u64* __restrict__ table = reinterpret_cast<const u64*>(table_addr);
  const i64* __restrict__ roles = reinterpret_cast<const i64*>(roles_addr);
  const int2* __restrict__ ids = reinterpret_cast<const int2*>(ids_addr);
  const int nroles = static_cast<int>(num_roles);
  const int t = threadIdx.x;
  if (t < nroles) {
    s_bytes[t] = roles[2 * t];
    s_first[t] = roles[2 * t + 1];
  }
  const unsigned slot = smem_addr(slots + static_cast<size_t>(t) * kChunkBytes);
  const unsigned bar = smem_addr(&bars[t]);
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncthreads();

  const i64 per_layer = num_blocks * chunks_per_block;
  const i64 total = per_layer * num_layers;
  const i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
  unsigned phase = 0;
  for (i64 u = static_cast<i64>(blockIdx.x) * blockDim.x + t; u < total; u += stride) {
    const i64 layer = u / per_layer;
    const i64 v = u - layer * per_layer;
    const i64 j = v / chunks_per_block;
    const i64 c = v - j * chunks_per_block;
    int r = 0;
#pragma unroll
    for (int k = 1; k < kMaxRoles; ++k) {
      if (k < nroles && c >= s_first[k]) r = k;
    }
    const i64 bytes = s_bytes[r];
    const i64 off = (c - s_first[r]) * kChunkBytes;
    const unsigned len = static_cast<unsigned>(min(static_cast<i64>(kChunkBytes), bytes - off));
    const u64* entry = table + ((layer_begin + layer) * nroles + r) * 2;
    const int2 pair = ids[j];
    const char* src = reinterpret_cast<const char*>(entry[0]) + pair.x * bytes + off;
    char* dst = reinterpret_cast<char*>(entry[1]) + pair.y * bytes + off;
    // The slot is free once the previous bulk store has read it.
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 ::"r"(bar), "r"(len) : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(slot), "l"(src), "r"(len), "r"(bar) : "memory");
    unsigned done = 0;
    do {
      asm volatile(
          "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
          " selp.u32 %0, 1, 0, p;\n}"
          : "=r"(done) : "r"(bar), "r"(phase) : "memory");
    } while (!done);
    phase ^= 1;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"(dst), "r"(slot), "r"(len) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
  // Stores must complete (not just have read shared memory) before the CTA exits.
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
