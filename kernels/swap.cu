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
// (kernels/swap.py, "one launch per op"). Its warps do not take units
// grid-stride: each takes the next unit from a global atomic counter, in
// layer-major order, so the whole grid works on the earliest layers still open.
// (Grid-stride, each warp's share is fixed; warps drift apart over PCIe, and a
// layer was done only when its slowest warp passed it: on the H100 layer 23 of
// 32 landed at 0.93 of the op, against 0.75 with a launch per layer.)
// A warp counts the units it finished of its current layer and adds them to the
// layer's arrival counter when it moves on (its stores fenced first). A layer is
// complete when its counter reaches its units + 1; the + 1 is a token from the
// layer before, added once that one is signalled (layer 0's from the grid's
// first warp), so the words flip strictly in layer order even where a late unit
// of layer i finishes after all of layer i + 1. Whoever completes a layer resets
// its counter and writes the op's sequence number into the layer's progress word
// twice: in device memory, where a stream waits on it (cuStreamWaitValue32: the
// GPU polls its own memory, not PCIe, which the copy saturates), and in pinned
// host memory, where the host reads it without a CUDA call; then it passes the
// token on. The last warp to leave resets the unit counter: every counter is zero
// between launches (which are ordered: one copier's ops share a stream).
#include "swap_copy.cuh"

using namespace kvflow;

// u32 words ahead of the per-layer arrival counters in the signal kernel's
// counters: a u64 unit counter, the exited-warps count, one spare;
// kernels/progress.py SIGNAL_HEADER must match.
constexpr int kSignalHeader = 4;

__device__ __forceinline__ void load_roles(const u64 roles_addr, const int nroles,
                                           i64* s_bytes, i64* s_first) {
  const i64* __restrict__ roles = reinterpret_cast<const i64*>(roles_addr);
  if (threadIdx.x < nroles) {
    s_bytes[threadIdx.x] = roles[2 * threadIdx.x];
    s_first[threadIdx.x] = roles[2 * threadIdx.x + 1];
  }
  __syncthreads();
}

// Copy chunk c (running across the roles) of the block pair `pair` in absolute layer `layer`.
__device__ __forceinline__ void copy_unit(const u64* __restrict__ table, const int nroles,
                                          const i64* s_bytes, const i64* s_first,
                                          const i64 layer, const i64 c, const int2 pair,
                                          const int lane) {
  int r = 0;
#pragma unroll
  for (int k = 1; k < kMaxRoles; ++k) {
    if (k < nroles && c >= s_first[k]) r = k;
  }
  const i64 bytes = s_bytes[r];
  const i64 off = (c - s_first[r]) * kChunkBytes;
  const i64 len = min(static_cast<i64>(kChunkBytes), bytes - off);
  const u64* entry = table + (layer * nroles + r) * 4;
  const char* src = reinterpret_cast<const char*>(entry[0]) + pair.x * static_cast<i64>(entry[2])
                    + off;
  char* dst = reinterpret_cast<char*>(entry[1]) + pair.y * static_cast<i64>(entry[3]) + off;
  warp_copy_chunk(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst),
                  static_cast<int>(len / kVecBytes), lane);
}

// The plain kernel's body: warps take units grid-stride, layer-major.
__device__ __forceinline__ void swap_body(const u64 table_addr, const u64 roles_addr,
                                          const i64 num_roles, const i64 chunks_per_block,
                                          const i64 layer_begin, const i64 num_layers,
                                          const u64 ids_addr, const i64 num_blocks) {
  __shared__ i64 s_bytes[kMaxRoles];
  __shared__ i64 s_first[kMaxRoles];
  const u64* __restrict__ table = reinterpret_cast<const u64*>(table_addr);
  const int2* __restrict__ ids = reinterpret_cast<const int2*>(ids_addr);
  const int nroles = static_cast<int>(num_roles);
  load_roles(roles_addr, nroles, s_bytes, s_first);

  const int lane = threadIdx.x & (kWarpSize - 1);
  const i64 warps_per_cta = blockDim.x / kWarpSize;
  const i64 num_warps = warps_per_cta * gridDim.x;
  const i64 per_layer = num_blocks * chunks_per_block;
  const i64 total = per_layer * num_layers;

  i64 u = blockIdx.x * warps_per_cta + threadIdx.x / kWarpSize;
  int2 pair = make_int2(0, 0);
  if (u < total) pair = ids[(u % per_layer) / chunks_per_block];
  for (; u < total; u += num_warps) {
    // Fetch the next unit's ids now: their latency (PCIe) hides behind this copy.
    const i64 un = u + num_warps;
    int2 next = pair;
    if (un < total) next = ids[(un % per_layer) / chunks_per_block];
    const i64 layer = u / per_layer;
    copy_unit(table, nroles, s_bytes, s_first, layer_begin + layer,
              (u - layer * per_layer) % chunks_per_block, pair, lane);
    pair = next;
  }
}

// Lane 0 of a warp: add n arrivals to layer `layer`'s counter; whoever completes a
// layer signals it and passes the token on (possibly completing the next, and so on).
__device__ __forceinline__ void arrive(unsigned* arrivals, i64 layer, unsigned n,
                                       const unsigned target, const i64 num_layers,
                                       volatile unsigned* dev_flags, volatile unsigned* flags,
                                       const unsigned seq) {
  while (atomicAdd(arrivals + layer, n) + n == target) {
    arrivals[layer] = 0u;     // complete: nothing else arrives here in this launch
    __threadfence_system();   // every arrival's fenced stores before the words
    dev_flags[layer] = seq;
    flags[layer] = seq;
    __threadfence_system();   // this layer's words before the next layer's
    if (++layer == num_layers) break;
    n = 1u;                   // the token
  }
}

// The signalling kernel's body (see the header): units from a global counter.
__device__ __forceinline__ void swap_signal_body(
    const u64 table_addr, const u64 roles_addr, const i64 num_roles,
    const i64 chunks_per_block, const i64 layer_begin, const i64 num_layers,
    const u64 ids_addr, const i64 num_blocks, unsigned* __restrict__ counters,
    volatile unsigned* dev_flags, volatile unsigned* flags, const unsigned seq) {
  __shared__ i64 s_bytes[kMaxRoles];
  __shared__ i64 s_first[kMaxRoles];
  const u64* __restrict__ table = reinterpret_cast<const u64*>(table_addr);
  const int2* __restrict__ ids = reinterpret_cast<const int2*>(ids_addr);
  const int nroles = static_cast<int>(num_roles);
  load_roles(roles_addr, nroles, s_bytes, s_first);

  u64* next_unit = reinterpret_cast<u64*>(counters);  // units handed out
  unsigned* exited = counters + 2;                     // warps done
  unsigned* arrivals = counters + kSignalHeader;       // per layer
  const int lane = threadIdx.x & (kWarpSize - 1);
  const unsigned num_warps = (blockDim.x / kWarpSize) * gridDim.x;
  const i64 per_layer = num_blocks * chunks_per_block;
  const u64 total = static_cast<u64>(per_layer * num_layers);
  const unsigned target = static_cast<unsigned>(per_layer) + 1u;  // units + the token
  const unsigned full = 0xffffffffu;

  if (threadIdx.x == 0 && blockIdx.x == 0 && num_layers > 0) {  // layer 0's token
    arrive(arrivals, 0, 1u, target, num_layers, dev_flags, flags, seq);
  }
  u64 grabbed = 0;
  if (lane == 0) grabbed = atomicAdd(next_unit, 1ull);
  u64 u = __shfl_sync(full, grabbed, 0);
  int2 pair = make_int2(0, 0);
  if (u < total) pair = ids[(u % per_layer) / chunks_per_block];
  u64 un = total;
  if (u < total) {
    if (lane == 0) grabbed = atomicAdd(next_unit, 1ull);
    un = __shfl_sync(full, grabbed, 0);
  }
  unsigned done = 0;  // units of u's layer this warp has finished
  while (u < total) {
    // Two units ahead: un's ids and the unit after it are fetched behind this copy.
    int2 next = pair;
    if (un < total) {
      next = ids[(un % per_layer) / chunks_per_block];
      if (lane == 0) grabbed = atomicAdd(next_unit, 1ull);
    }
    const i64 layer = static_cast<i64>(u / per_layer);
    copy_unit(table, nroles, s_bytes, s_first, layer_begin + layer,
              (static_cast<i64>(u) - layer * per_layer) % chunks_per_block, pair, lane);
    ++done;
    u64 unn = total;
    if (un < total) unn = __shfl_sync(full, grabbed, 0);
    if (un >= total || static_cast<i64>(un / per_layer) != layer) {  // leaving the layer
      __threadfence();  // this lane's stores before the arrival
      __syncwarp();
      if (lane == 0) arrive(arrivals, layer, done, target, num_layers, dev_flags, flags, seq);
      done = 0;
    }
    u = un;
    un = unn;
    pair = next;
  }
  // Every grab of this warp is done; the last warp out resets the unit counter.
  __threadfence();
  if (lane == 0 && atomicAdd(exited, 1u) == num_warps - 1u) {
    *next_unit = 0ull;
    *exited = 0u;
  }
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
  swap_body(table_addr, roles_addr, num_roles, chunks_per_block, layer_begin, num_layers,
            ids_addr, num_blocks);
}

// As kvflow_swap_blocks, then layer i (of this launch) done: dev_flags[i] = flags[i] = seq.
extern "C" __global__ void __launch_bounds__(1024, 1)
kvflow_swap_blocks_signal(const u64 table_addr, const u64 roles_addr, const i64 num_roles,
                          const i64 chunks_per_block, const i64 layer_begin,
                          const i64 num_layers, const u64 ids_addr, const i64 num_blocks,
                          const u64 counters_addr,  // u32 [kSignalHeader + num_layers],
                                                    //   device, 8-byte aligned, zero between
                                                    //   launches (the kernel leaves it so)
                          const u64 dev_flags_addr, // u32 [num_layers], device
                          const u64 flags_addr,     // u32 [num_layers], pinned host
                          const u64 seq) {
  swap_signal_body(table_addr, roles_addr, num_roles, chunks_per_block, layer_begin,
                   num_layers, ids_addr, num_blocks, reinterpret_cast<unsigned*>(counters_addr),
                   reinterpret_cast<volatile unsigned*>(dev_flags_addr),
                   reinterpret_cast<volatile unsigned*>(flags_addr),
                   static_cast<unsigned>(seq));
}
