// Swap kernel: copy a list of KV blocks between device caches and pinned
// (mapped) host buffers, for a range of layers and every cache role.
//
// One kernel serves both directions and both launch shapes: the caller passes
// a device table of per-(layer, role) base pointers and block strides for one
// direction and a layer range (one layer: the per-layer launch; all layers: one
// launch). The strides differ from the role's bytes where one side is a host
// layout's staging buffer (kernels/layout_copy.py: a block's layers together),
// so the same kernel scatters staged pieces into the device's per-layer caches.
// Host memory from cudaHostAlloc is mapped on UVA systems, so its host address
// is dereferenced directly; the SMs pull/push over PCIe. The id pairs are read
// straight from the caller's pinned staging buffer (no upload, no device
// allocation per op); each warp fetches its next pair while copying.
//
// Work is split into units of (layer, block, chunk), chunks running across the
// roles of a block; warps take units grid-stride, layer-major, so with several
// layers in one launch the early layers finish first.
//
// kvflow_swap_blocks_signal does the same and reports each layer as it lands,
// so one launch can carry a whole op and still give per-layer completion
// (kernels/swap.py, "one launch per op"): every warp arrives on a per-layer
// counter once it is past that layer (its stores fenced first); the last of
// the grid's warps resets the counter and writes the op's sequence number into
// the layer's progress word twice: in device memory, where a stream waits on it
// (cuStreamWaitValue32: the GPU polls its own memory, not PCIe, which the copy
// saturates), and in pinned host memory, where the host reads it without a CUDA call.
#include "swap_copy.cuh"

using namespace kvflow;

// The shared body: Signal=true adds the per-layer arrivals (see the header).
template <bool Signal>
__device__ __forceinline__ void swap_body(const u64 table_addr, const u64 roles_addr,
                                          const i64 num_roles, const i64 chunks_per_block,
                                          const i64 layer_begin, const i64 num_layers,
                                          const u64 ids_addr, const i64 num_blocks,
                                          unsigned* __restrict__ counters,
                                          volatile unsigned* dev_flags,
                                          volatile unsigned* flags, const unsigned seq) {
  __shared__ i64 s_bytes[kMaxRoles];
  __shared__ i64 s_first[kMaxRoles];
  const u64* __restrict__ table = reinterpret_cast<const u64*>(table_addr);
  const i64* __restrict__ roles = reinterpret_cast<const i64*>(roles_addr);
  const int2* __restrict__ ids = reinterpret_cast<const int2*>(ids_addr);
  const int nroles = static_cast<int>(num_roles);
  if (threadIdx.x < nroles) {
    s_bytes[threadIdx.x] = roles[2 * threadIdx.x];
    s_first[threadIdx.x] = roles[2 * threadIdx.x + 1];
  }
  __syncthreads();

  const int lane = threadIdx.x & (kWarpSize - 1);
  const i64 warps_per_cta = blockDim.x / kWarpSize;
  const i64 num_warps = warps_per_cta * gridDim.x;
  const i64 per_layer = num_blocks * chunks_per_block;
  const i64 total = per_layer * num_layers;
  // Signal: layers [0, arrived) of this launch are counted for this warp.
  i64 arrived = 0;
  auto arrive = [&](i64 upto) {
    if (arrived >= upto) return;
    __threadfence();  // this lane's stores before the arrival
    __syncwarp();
    if (lane == 0) {
      for (; arrived < upto; ++arrived) {
        const unsigned old = atomicAdd(counters + arrived, 1u);
        if (old == static_cast<unsigned>(num_warps - 1)) {  // the grid's last warp
          counters[arrived] = 0u;  // the next launch (stream-ordered) starts from 0
          __threadfence_system();
          dev_flags[arrived] = seq;
          flags[arrived] = seq;
        }
      }
    }
    arrived = upto;
  };

  i64 u = blockIdx.x * warps_per_cta + threadIdx.x / kWarpSize;
  int2 pair = make_int2(0, 0);
  if (u < total) pair = ids[(u % per_layer) / chunks_per_block];
  for (; u < total; u += num_warps) {
    // Fetch the next unit's ids now: their latency (PCIe) hides behind this copy.
    const i64 un = u + num_warps;
    int2 next = pair;
    if (un < total) next = ids[(un % per_layer) / chunks_per_block];

    const i64 layer = u / per_layer;
    if (Signal) arrive(layer);  // past every earlier layer
    const i64 c = (u - layer * per_layer) % chunks_per_block;
    int r = 0;
#pragma unroll
    for (int k = 1; k < kMaxRoles; ++k) {
      if (k < nroles && c >= s_first[k]) r = k;
    }
    const i64 bytes = s_bytes[r];
    const i64 off = (c - s_first[r]) * kChunkBytes;
    const i64 len = min(static_cast<i64>(kChunkBytes), bytes - off);
    const u64* entry = table + ((layer_begin + layer) * nroles + r) * 4;
    const char* src = reinterpret_cast<const char*>(entry[0]) + pair.x * static_cast<i64>(entry[2])
                      + off;
    char* dst = reinterpret_cast<char*>(entry[1]) + pair.y * static_cast<i64>(entry[3]) + off;
    warp_copy_chunk(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst),
                    static_cast<int>(len / kVecBytes), lane);
    pair = next;
  }
  if (Signal) arrive(num_layers);
}

extern "C" __global__ void __launch_bounds__(1024, 1)
kvflow_swap_blocks(const u64 table_addr,   // u64 [layers][num_roles][4]: src base, dst base,
                                           //   src block stride, dst block stride (bytes)
                   const u64 roles_addr,   // i64 [num_roles][2]: bytes per block, first chunk
                   const i64 num_roles,
                   const i64 chunks_per_block,
                   const i64 layer_begin,
                   const i64 num_layers,
                   const u64 ids_addr,     // int2 [num_blocks]: (src id, dst id)
                   const i64 num_blocks) {
  swap_body<false>(table_addr, roles_addr, num_roles, chunks_per_block, layer_begin, num_layers,
                   ids_addr, num_blocks, nullptr, nullptr, nullptr, 0u);
}

// As kvflow_swap_blocks, then layer i (of this launch) done: dev_flags[i] = flags[i] = seq.
extern "C" __global__ void __launch_bounds__(1024, 1)
kvflow_swap_blocks_signal(const u64 table_addr, const u64 roles_addr, const i64 num_roles,
                          const i64 chunks_per_block, const i64 layer_begin,
                          const i64 num_layers, const u64 ids_addr, const i64 num_blocks,
                          const u64 counters_addr,  // u32 [num_layers], device, zero between
                                                    //   launches (the kernel leaves it so)
                          const u64 dev_flags_addr, // u32 [num_layers], device
                          const u64 flags_addr,     // u32 [num_layers], pinned host
                          const u64 seq) {
  swap_body<true>(table_addr, roles_addr, num_roles, chunks_per_block, layer_begin, num_layers,
                  ids_addr, num_blocks, reinterpret_cast<unsigned*>(counters_addr),
                  reinterpret_cast<volatile unsigned*>(dev_flags_addr),
                  reinterpret_cast<volatile unsigned*>(flags_addr),
                  static_cast<unsigned>(seq));
}
