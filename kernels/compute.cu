// The GPU executor's model: a transformer layer over paged KV, in bf16 with fp32
// accumulation, written so that every output row is bit-identical whatever batch
// it ran in. That is what lets a test compare a run whose KV stayed on the device
// with one whose KV went to host and back, or was evicted and recomputed: the
// scheduler changes which tokens share a step, never the numbers.
//
// Batch invariance, kernel by kernel:
//   * GEMM (mma.sync m16n8k16, bf16 in, fp32 accumulate): one output element is
//     always the same sequence of mma instructions over K (no split-K, K tiles in
//     order), whatever M, the row's place in the tile or the CTA shape.
//   * RMSNorm / final: one warp per row, fixed per-lane order and shuffle tree.
//   * Prefill attention: a CTA per (16 query tokens, kv head), one warp per query
//     head; keys in KT-key tiles (KT = 16 or 32, one per build) at absolute positions
//     0, KT, 2 KT..., online softmax in that order. A tile that is fully masked for a row leaves the row exactly
//     as it was (scale exp2(0) = 1, p = 0), masked keys get p = 0 and keys past the
//     CTA's last query are zero-filled, so a row's result does not depend on which
//     other rows share its CTA (that is, on how its prompt was chunked).
//   * Decode attention: split over keys in fixed-size splits (flash-decoding),
//     merged in split order. Decode rows never feed a cached block (decode KV goes
//     to the request's own tail), so prefill and decode may differ; each is
//     deterministic on its own.
// No atomics anywhere; every output element has exactly one writer.
//
// Layouts: activations are row-major [tokens, width]; weights are [N, K] (the
// GEMM computes A[M,K] . W[N,K]^T); a KV block of one layer and role is
// [block_tokens, kv_heads, head_dim] bf16 at block * block_stride elements. All
// pointers travel as 64-bit integers (u64), counts as 32-bit ints.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

namespace {

constexpr float kEps = 1e-6f;    // RMSNorm epsilon

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float(static_cast<u32>(h) << 16); }

// float -> bf16, round to nearest even (finite inputs).
__device__ __forceinline__ u32 f2bf(float f) {
  u32 u = __float_as_uint(f);
  u += 0x7fffu + ((u >> 16) & 1u);
  return u >> 16;
}

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) { return f2bf(lo) | (f2bf(hi) << 16); }

__device__ __forceinline__ u32 ld32(const u16* p) { return *reinterpret_cast<const u32*>(p); }

// D = A . B + D, m16n8k16, A row-major bf16, B column-major bf16, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u64 a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return static_cast<u32>(a);
}

// 16-byte async copy global -> shared; bytes past src_bytes are zero-filled.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

__device__ __forceinline__ u32 hash32(u32 x) {  // lowbias32
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// A uniform value in [-1, 1) with 24 bits, exactly representable in fp32.
__device__ __forceinline__ float unit(u32 h) {
  return static_cast<float>(h >> 8) * (1.0f / 8388608.0f) - 1.0f;
}

// ---------------------------------------------------------------------------- GEMM
constexpr int kBN = 64;
constexpr int kBK = 32;
constexpr int kLds = kBK + 8;    // padded smem row (halves): conflict-free fragment reads
constexpr int kStages = 3;

// C[M,N] (+)= A[M,K] . W[N,K]^T. mode 0: C is bf16, stored; mode 1: C is fp32, added to.
// Needs N % 64 == 0, K % 32 == 0. BM/32 x 2 warps, each a 32x32 tile.
template <int BM>
__device__ __forceinline__ void gemm(const u64 a_addr, const u64 w_addr, const u64 c_addr,
                                     const int M, const int N, const int K, const int mode) {
  __shared__ __align__(16) u16 As[kStages][BM][kLds];
  __shared__ __align__(16) u16 Ws[kStages][kBN][kLds];
  const u16* __restrict__ A = reinterpret_cast<const u16*>(a_addr);
  const u16* __restrict__ W = reinterpret_cast<const u16*>(w_addr);
  constexpr int kThreads = BM * 2;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wm = warp >> 1, wn = warp & 1;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * kBN;
  const int KT = K / kBK;

  float acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[i][j][k] = 0.f;

  auto load = [&](int stage, int kt) {
    const int k0 = kt * kBK;
    for (int c = tid; c < BM * 4; c += kThreads) {
      const int r = c >> 2, kc = (c & 3) * 8;
      const int gr = m0 + r;
      const u16* src = A + static_cast<i64>(gr < M ? gr : M - 1) * K + k0 + kc;
      cp_async16(&As[stage][r][kc], src, gr < M ? 16 : 0);
    }
    for (int c = tid; c < kBN * 4; c += kThreads) {
      const int r = c >> 2, kc = (c & 3) * 8;
      cp_async16(&Ws[stage][r][kc], W + static_cast<i64>(n0 + r) * K + k0 + kc, 16);
    }
  };

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile kt landed for everyone; stage (kt-1) % kStages is free
    const int nk = kt + kStages - 1;
    if (nk < KT) load(nk % kStages, nk);
    cp_async_commit();
    const int st = kt % kStages;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      u32 a[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        const int r = wm * 32 + mi * 16 + g;
        a[mi][0] = ld32(&As[st][r][kk + 2 * t]);
        a[mi][1] = ld32(&As[st][r + 8][kk + 2 * t]);
        a[mi][2] = ld32(&As[st][r][kk + 2 * t + 8]);
        a[mi][3] = ld32(&As[st][r + 8][kk + 2 * t + 8]);
      }
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const int n = wn * 32 + ni * 8 + g;
        const u32 b0 = ld32(&Ws[st][n][kk + 2 * t]);
        const u32 b1 = ld32(&Ws[st][n][kk + 2 * t + 8]);
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) mma_bf16(acc[mi][ni], a[mi], b0, b1);
      }
    }
  }
  cp_async_wait<0>();

#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int col = n0 + wn * 32 + ni * 8 + 2 * t;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = m0 + wm * 32 + mi * 16 + g + 8 * half;
        if (row >= M) continue;
        const float v0 = acc[mi][ni][2 * half], v1 = acc[mi][ni][2 * half + 1];
        const i64 off = static_cast<i64>(row) * N + col;
        if (mode == 0) {
          *reinterpret_cast<u32*>(reinterpret_cast<u16*>(c_addr) + off) = pack_bf16(v0, v1);
        } else {
          float2* p = reinterpret_cast<float2*>(reinterpret_cast<float*>(c_addr) + off);
          float2 o = *p;
          o.x += v0;
          o.y += v1;
          *p = o;
        }
      }
    }
  }
}

// Skinny GEMM for few rows (decode): 16 x 32 tiles, one warp, 64-deep K tiles, 4 stages,
// so that many small CTAs keep enough weight bytes in flight to stream them near HBM
// speed. Every output element is the same mma sequence as in gemm<BM> (k16 chunks in
// order into one fp32 accumulator): rows come out bit-identical whichever kernel ran.
constexpr int kSkBK = 64;
constexpr int kSkLds = kSkBK + 8;
constexpr int kSkStages = 4;

__device__ __forceinline__ void gemm_skinny(const u64 a_addr, const u64 w_addr, const u64 c_addr,
                                            const int M, const int N, const int K,
                                            const int mode) {
  __shared__ __align__(16) u16 As[kSkStages][16][kSkLds];
  __shared__ __align__(16) u16 Ws[kSkStages][32][kSkLds];
  const u16* __restrict__ A = reinterpret_cast<const u16*>(a_addr);
  const u16* __restrict__ W = reinterpret_cast<const u16*>(w_addr);
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.y * 16, n0 = blockIdx.x * 32;
  const int KT = K / kSkBK;
  constexpr int kCh = kSkBK / 8;
  float acc[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) acc[j][k] = 0.f;

  auto load = [&](int stage, int kt) {
    const int k0 = kt * kSkBK;
#pragma unroll
    for (int c = lane; c < 16 * kCh; c += 32) {
      const int r = c / kCh, kc = (c % kCh) * 8;
      const int gr = m0 + r;
      const u16* src = A + static_cast<i64>(gr < M ? gr : M - 1) * K + k0 + kc;
      cp_async16(&As[stage][r][kc], src, gr < M ? 16 : 0);
    }
#pragma unroll
    for (int c = lane; c < 32 * kCh; c += 32) {
      const int r = c / kCh, kc = (c % kCh) * 8;
      cp_async16(&Ws[stage][r][kc], W + static_cast<i64>(n0 + r) * K + k0 + kc, 16);
    }
  };

#pragma unroll
  for (int s = 0; s < kSkStages - 1; ++s) {
    if (s < KT) load(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kSkStages - 2>();
    __syncthreads();
    const int nk = kt + kSkStages - 1;
    if (nk < KT) load(nk % kSkStages, nk);
    cp_async_commit();
    const int st = kt % kSkStages;
#pragma unroll
    for (int kk = 0; kk < kSkBK; kk += 16) {
      u32 a[4];
      a[0] = ld32(&As[st][g][kk + 2 * t]);
      a[1] = ld32(&As[st][g + 8][kk + 2 * t]);
      a[2] = ld32(&As[st][g][kk + 2 * t + 8]);
      a[3] = ld32(&As[st][g + 8][kk + 2 * t + 8]);
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        const u32 b0 = ld32(&Ws[st][ni * 8 + g][kk + 2 * t]);
        const u32 b1 = ld32(&Ws[st][ni * 8 + g][kk + 2 * t + 8]);
        mma_bf16(acc[ni], a, b0, b1);
      }
    }
  }
  cp_async_wait<0>();
#pragma unroll
  for (int ni = 0; ni < 4; ++ni) {
    const int col = n0 + ni * 8 + 2 * t;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m0 + g + 8 * half;
      if (row >= M) continue;
      const float v0 = acc[ni][2 * half], v1 = acc[ni][2 * half + 1];
      const i64 off = static_cast<i64>(row) * N + col;
      if (mode == 0) {
        *reinterpret_cast<u32*>(reinterpret_cast<u16*>(c_addr) + off) = pack_bf16(v0, v1);
      } else {
        float2* p = reinterpret_cast<float2*>(reinterpret_cast<float*>(c_addr) + off);
        float2 o = *p;
        o.x += v0;
        o.y += v1;
        *p = o;
      }
    }
  }
}

// ------------------------------------------------------------------------ attention
// Copy keys [k0, k0 + KT) of one kv head into Ks/Vs with cp.async, zero-filling keys past
// `last`; each key finds its block through the table (a tile may span blocks). The
// caller commits and waits, so the next tile streams in while this one is computed.
template <int HD, int KT>
__device__ __forceinline__ void load_kv_tile_async(u16 (&Ks)[KT][HD + 8], u16 (&Vs)[KT][HD + 8],
                                                   const u16* __restrict__ kc,
                                                   const u16* __restrict__ vc,
                                                   const int* __restrict__ table, const int k0,
                                                   const int last, const int bt,
                                                   const i64 block_stride, const int kv_dim,
                                                   const int kvh) {
  constexpr int kChunks = HD / 8;
  for (int c = threadIdx.x; c < 2 * KT * kChunks; c += blockDim.x) {
    const int which = c / (KT * kChunks);
    const int rc = c % (KT * kChunks);
    const int r = rc / kChunks, ch = rc % kChunks;
    const int key = k0 + r;
    const int src_key = key <= last ? key : last;  // a valid address; no bytes read past last
    const i64 off = static_cast<i64>(table[src_key / bt]) * block_stride +
                    static_cast<i64>(src_key % bt) * kv_dim + static_cast<i64>(kvh) * HD + ch * 8;
    cp_async16(which ? &Vs[r][ch * 8] : &Ks[r][ch * 8], (which ? vc : kc) + off,
               key <= last ? 16 : 0);
  }
}

// One warp's 16 rows against one KT-key tile at absolute key k0: scores, masking
// (key <= the row's position), online softmax, O += P.V.
// Rows g and g+8 of the warp are this lane's "lo" and "hi" rows.
template <int HD, int KT>
__device__ __forceinline__ void attend_tile(const u32 (&qf)[HD / 16][4],
                                            const u16 (&Ks)[KT][HD + 8],
                                            const u16 (&Vs)[KT][HD + 8], const int k0,
                                            const int pos_lo, const int pos_hi, const float scale,
                                            float (&m)[2], float (&l)[2], float (&o)[HD / 8][4]) {
  constexpr int NT = KT / 8;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float s[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll
    for (int c = 0; c < HD / 16; ++c) {
      const u32 b0 = ld32(&Ks[nt * 8 + g][c * 16 + 2 * t]);
      const u32 b1 = ld32(&Ks[nt * 8 + g][c * 16 + 2 * t + 8]);
      mma_bf16(s[nt], qf[c], b0, b1);
    }
  }
  float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = k0 + nt * 8 + 2 * t + (e & 1);
      const int hi = e >> 1;
      const bool ok = key <= (hi ? pos_hi : pos_lo);
      const float v = ok ? s[nt][e] * scale : neg_inf();
      s[nt][e] = v;
      mx[hi] = fmaxf(mx[hi], v);
    }
  }
  float alpha[2], base[2];
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    mx[hi] = fmaxf(mx[hi], __shfl_xor_sync(0xffffffffu, mx[hi], 1));
    mx[hi] = fmaxf(mx[hi], __shfl_xor_sync(0xffffffffu, mx[hi], 2));
    const float mn = fmaxf(m[hi], mx[hi]);
    base[hi] = (mn == neg_inf()) ? 0.f : mn;
    alpha[hi] = exp2f(m[hi] - base[hi]);
    m[hi] = mn;
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nt][e] = exp2f(s[nt][e] - base[e >> 1]);  // now p
      sum[e >> 1] += s[nt][e];
    }
  }
  l[0] = l[0] * alpha[0] + sum[0];
  l[1] = l[1] * alpha[1] + sum[1];
#pragma unroll
  for (int dn = 0; dn < HD / 8; ++dn) {
    o[dn][0] *= alpha[0];
    o[dn][1] *= alpha[0];
    o[dn][2] *= alpha[1];
    o[dn][3] *= alpha[1];
  }
#pragma unroll
  for (int kc = 0; kc < KT / 16; ++kc) {
    u32 a[4];
    a[0] = pack_bf16(s[2 * kc][0], s[2 * kc][1]);
    a[1] = pack_bf16(s[2 * kc][2], s[2 * kc][3]);
    a[2] = pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]);
    a[3] = pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3]);
    const int k = kc * 16 + 2 * t;
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn) {
      const int d = dn * 8 + g;
      const u32 b0 = static_cast<u32>(Vs[k][d]) | (static_cast<u32>(Vs[k + 1][d]) << 16);
      const u32 b1 = static_cast<u32>(Vs[k + 8][d]) | (static_cast<u32>(Vs[k + 9][d]) << 16);
      mma_bf16(o[dn], a, b0, b1);
    }
  }
}

// Q fragments of one warp: rows row_lo / row_hi of qkv, columns [col, col + HD).
template <int HD>
__device__ __forceinline__ void load_q(u32 (&qf)[HD / 16][4], const u16* __restrict__ qkv,
                                       const int ld, const int row_lo, const int row_hi,
                                       const int col) {
  const int lane = threadIdx.x & 31, t = lane & 3;
  const u16* lo = qkv + static_cast<i64>(row_lo) * ld + col;
  const u16* hi = qkv + static_cast<i64>(row_hi) * ld + col;
#pragma unroll
  for (int c = 0; c < HD / 16; ++c) {
    qf[c][0] = ld32(lo + c * 16 + 2 * t);
    qf[c][1] = ld32(hi + c * 16 + 2 * t);
    qf[c][2] = ld32(lo + c * 16 + 2 * t + 8);
    qf[c][3] = ld32(hi + c * 16 + 2 * t + 8);
  }
}

template <int HD>
__device__ __forceinline__ void zero_state(float (&m)[2], float (&l)[2], float (&o)[HD / 8][4]) {
  m[0] = m[1] = neg_inf();
  l[0] = l[1] = 0.f;
#pragma unroll
  for (int dn = 0; dn < HD / 8; ++dn)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[dn][e] = 0.f;
}

// Prefill: CTA (work item, kv head), one warp per query head of the group.
// work: int4 per item (row0, nrows, qpos0, table offset).
template <int HD, int KT>
__device__ __forceinline__ void attn_prefill(const u64 qkv_addr, const int ld, const u64 kc_addr,
                                             const u64 vc_addr, const i64 block_stride,
                                             const int bt, const int kv_heads, const int group,
                                             const u64 work_addr, const u64 tables_addr,
                                             const u64 out_addr, const float scale) {
  __shared__ __align__(16) u16 Ks[2][KT][HD + 8];
  __shared__ __align__(16) u16 Vs[2][KT][HD + 8];
  const int* wk = reinterpret_cast<const int*>(work_addr) + 4 * blockIdx.x;
  const int row0 = wk[0], nrows = wk[1], qpos0 = wk[2];
  const int* table = reinterpret_cast<const int*>(tables_addr) + wk[3];
  const u16* qkv = reinterpret_cast<const u16*>(qkv_addr);
  const u16* kc = reinterpret_cast<const u16*>(kc_addr);
  const u16* vc = reinterpret_cast<const u16*>(vc_addr);
  const int kvh = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int head = kvh * group + warp;
  const int kv_dim = kv_heads * HD;
  // Padding rows repeat the last real row: finite, and never stored.
  const int r_lo = min(g, nrows - 1), r_hi = min(g + 8, nrows - 1);
  u32 qf[HD / 16][4];
  load_q<HD>(qf, qkv, ld, row0 + r_lo, row0 + r_hi, head * HD);
  const int pos_lo = qpos0 + r_lo, pos_hi = qpos0 + r_hi;
  const int last = qpos0 + nrows - 1;
  float m[2], l[2], o[HD / 8][4];
  zero_state<HD>(m, l, o);
  // Double-buffered: tile i+1 is in flight while tile i is computed.
  load_kv_tile_async<HD, KT>(Ks[0], Vs[0], kc, vc, table, 0, last, bt, block_stride, kv_dim,
                             kvh);
  cp_async_commit();
  for (int k0 = 0, i = 0; k0 <= last; k0 += KT, ++i) {
    if (k0 + KT <= last) {
      load_kv_tile_async<HD, KT>(Ks[(i + 1) & 1], Vs[(i + 1) & 1], kc, vc, table, k0 + KT, last,
                                 bt, block_stride, kv_dim, kvh);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    attend_tile<HD, KT>(qf, Ks[i & 1], Vs[i & 1], k0, pos_lo, pos_hi, scale, m, l, o);
    __syncthreads();  // everyone is done with this buffer before it is refilled
  }
  cp_async_wait<0>();
  u16* out = reinterpret_cast<u16*>(out_addr);
  const int qdim = kv_heads * group * HD;
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    float lt = l[hi];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    const float inv = 1.0f / lt;
    const int r = g + 8 * hi;
    if (r >= nrows) continue;
    u16* dst = out + static_cast<i64>(row0 + r) * qdim + head * HD;
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn) {
      *reinterpret_cast<u32*>(dst + dn * 8 + 2 * t) =
          pack_bf16(o[dn][2 * hi] * inv, o[dn][2 * hi + 1] * inv);
    }
  }
}

// Decode: CTA = one warp per (split, kv head); its rows are the group's query heads
// of one token. work: 5 ints per split (row, key begin, key end, table offset,
// partial index). Writes the unnormalised partial O and (max, sum) per head.
template <int HD, int KT>
__device__ __forceinline__ void attn_decode(const u64 qkv_addr, const int ld, const u64 kc_addr,
                                            const u64 vc_addr, const i64 block_stride,
                                            const int bt, const int kv_heads, const int group,
                                            const u64 work_addr, const u64 tables_addr,
                                            const u64 part_o_addr, const u64 part_ml_addr,
                                            const float scale) {
  __shared__ __align__(16) u16 Ks[2][KT][HD + 8];
  __shared__ __align__(16) u16 Vs[2][KT][HD + 8];
  const int* wk = reinterpret_cast<const int*>(work_addr) + 5 * blockIdx.x;
  const int row = wk[0], kbeg = wk[1], kend = wk[2], pidx = wk[4];
  const int* table = reinterpret_cast<const int*>(tables_addr) + wk[3];
  const u16* qkv = reinterpret_cast<const u16*>(qkv_addr);
  const u16* kc = reinterpret_cast<const u16*>(kc_addr);
  const u16* vc = reinterpret_cast<const u16*>(vc_addr);
  const int kvh = blockIdx.y, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int h_lo = min(g, group - 1), h_hi = min(g + 8, group - 1);
  u32 qf[HD / 16][4];
  {
    // Rows are heads: fragment rows g / g+8 read head columns of the same token row.
    const u16* lo = reinterpret_cast<const u16*>(qkv) + static_cast<i64>(row) * ld +
                    (kvh * group + h_lo) * HD;
    const u16* hi = reinterpret_cast<const u16*>(qkv) + static_cast<i64>(row) * ld +
                    (kvh * group + h_hi) * HD;
#pragma unroll
    for (int c = 0; c < HD / 16; ++c) {
      qf[c][0] = ld32(lo + c * 16 + 2 * t);
      qf[c][1] = ld32(hi + c * 16 + 2 * t);
      qf[c][2] = ld32(lo + c * 16 + 2 * t + 8);
      qf[c][3] = ld32(hi + c * 16 + 2 * t + 8);
    }
  }
  const int last = kend - 1;
  const int kv_dim = kv_heads * HD;
  float m[2], l[2], o[HD / 8][4];
  zero_state<HD>(m, l, o);
  load_kv_tile_async<HD, KT>(Ks[0], Vs[0], kc, vc, table, kbeg, last, bt, block_stride, kv_dim,
                             kvh);
  cp_async_commit();
  for (int k0 = kbeg, i = 0; k0 <= last; k0 += KT, ++i) {
    if (k0 + KT <= last) {
      load_kv_tile_async<HD, KT>(Ks[(i + 1) & 1], Vs[(i + 1) & 1], kc, vc, table, k0 + KT, last,
                                 bt, block_stride, kv_dim, kvh);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    attend_tile<HD, KT>(qf, Ks[i & 1], Vs[i & 1], k0, last, last, scale, m, l, o);
    __syncthreads();
  }
  cp_async_wait<0>();
  const int heads = kv_heads * group;
  float* po = reinterpret_cast<float*>(part_o_addr);
  float* pml = reinterpret_cast<float*>(part_ml_addr);
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    float lt = l[hi];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    const int r = g + 8 * hi;
    if (r >= group) continue;
    const i64 ph = static_cast<i64>(pidx) * heads + kvh * group + r;
    if (t == 0) {
      pml[2 * ph] = m[hi];
      pml[2 * ph + 1] = lt;
    }
    float* dst = po + ph * HD;
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn) {
      *reinterpret_cast<float2*>(dst + dn * 8 + 2 * t) = make_float2(o[dn][2 * hi], o[dn][2 * hi + 1]);
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------- entry points
extern "C" __global__ void __launch_bounds__(128)
kvflow_gemm_bm64(const u64 a, const u64 w, const u64 c, const int M, const int N, const int K,
                 const int mode) {
  gemm<64>(a, w, c, M, N, K, mode);
}

extern "C" __global__ void __launch_bounds__(32)
kvflow_gemm_skinny(const u64 a, const u64 w, const u64 c, const int M, const int N, const int K,
                   const int mode) {
  gemm_skinny(a, w, c, M, N, K, mode);
}

extern "C" __global__ void __launch_bounds__(256)
kvflow_gemm_bm128(const u64 a, const u64 w, const u64 c, const int M, const int N, const int K,
                  const int mode) {
  gemm<128>(a, w, c, M, N, K, mode);
}

#define KVFLOW_ATTN(HD, KT)                                                                      \
  extern "C" __global__ void __launch_bounds__(256) kvflow_attn_prefill_hd##HD##_k##KT(          \
      const u64 qkv, const int ld, const u64 kc, const u64 vc, const i64 block_stride,           \
      const int bt, const int kv_heads, const int group, const u64 work, const u64 tables,       \
      const u64 out, const float scale) {                                                        \
    attn_prefill<HD, KT>(qkv, ld, kc, vc, block_stride, bt, kv_heads, group, work, tables, out,  \
                         scale);                                                                 \
  }                                                                                              \
  extern "C" __global__ void __launch_bounds__(32) kvflow_attn_decode_hd##HD##_k##KT(            \
      const u64 qkv, const int ld, const u64 kc, const u64 vc, const i64 block_stride,           \
      const int bt, const int kv_heads, const int group, const u64 work, const u64 tables,       \
      const u64 part_o, const u64 part_ml, const float scale) {                                  \
    attn_decode<HD, KT>(qkv, ld, kc, vc, block_stride, bt, kv_heads, group, work, tables,        \
                        part_o, part_ml, scale);                                                 \
  }

KVFLOW_ATTN(64, 16)
KVFLOW_ATTN(64, 32)
KVFLOW_ATTN(128, 16)
KVFLOW_ATTN(128, 32)

// Merge decode splits in split order: one warp per (decode item, query head).
// comb: 3 ints per item (row, first partial, splits). out: bf16 [tokens, heads * hd].
extern "C" __global__ void __launch_bounds__(32)
kvflow_attn_combine(const u64 comb_addr, const u64 part_o_addr, const u64 part_ml_addr,
                    const u64 out_addr, const int heads, const int hd) {
  const int* cb = reinterpret_cast<const int*>(comb_addr) + 3 * blockIdx.x;
  const int row = cb[0], p0 = cb[1], ns = cb[2];
  const int h = blockIdx.y, lane = threadIdx.x;
  const float* po = reinterpret_cast<const float*>(part_o_addr);
  const float* pml = reinterpret_cast<const float*>(part_ml_addr);
  float mmax = neg_inf();
  for (int s = 0; s < ns; ++s) mmax = fmaxf(mmax, pml[2 * (static_cast<i64>(p0 + s) * heads + h)]);
  float den = 0.f;
  for (int s = 0; s < ns; ++s) {
    const i64 ph = static_cast<i64>(p0 + s) * heads + h;
    den += exp2f(pml[2 * ph] - mmax) * pml[2 * ph + 1];
  }
  const float inv = 1.0f / den;
  u16* out = reinterpret_cast<u16*>(out_addr) + static_cast<i64>(row) * heads * hd + h * hd;
  for (int d = 2 * lane; d < hd; d += 64) {
    float n0 = 0.f, n1 = 0.f;
    for (int s = 0; s < ns; ++s) {
      const i64 ph = static_cast<i64>(p0 + s) * heads + h;
      const float w = exp2f(pml[2 * ph] - mmax);
      const float2 v = *reinterpret_cast<const float2*>(po + ph * hd + d);
      n0 += w * v.x;
      n1 += w * v.y;
    }
    *reinterpret_cast<u32*>(out + d) = pack_bf16(n0 * inv, n1 * inv);
  }
}

// h[t, :] = embedding of (token, position), from integer hashes (no table).
extern "C" __global__ void __launch_bounds__(256)
kvflow_embed(const u64 tokens_addr, const u64 pos_addr, const u64 h_addr, const int hidden) {
  const int row = blockIdx.x;
  const u32 tok = static_cast<u32>(reinterpret_cast<const int*>(tokens_addr)[row]);
  const u32 pos = static_cast<u32>(reinterpret_cast<const int*>(pos_addr)[row]);
  float* h = reinterpret_cast<float*>(h_addr) + static_cast<i64>(row) * hidden;
  for (int d = threadIdx.x; d < hidden; d += blockDim.x) {
    const u32 ud = static_cast<u32>(d);
    const float a = unit(hash32(tok * 0x9e3779b1u + ud * 0x85ebca77u));
    const float b = unit(hash32((pos + 0x632be5abu) * 0xc2b2ae3du ^ (ud * 0x27d4eb2fu)));
    h[d] = a + 0.25f * b;
  }
}

// x = bf16(h / rms(h)); one warp per row, 8 rows per CTA.
extern "C" __global__ void __launch_bounds__(256)
kvflow_rmsnorm(const u64 h_addr, const u64 x_addr, const int rows, const int hidden) {
  const int row = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= rows) return;
  const float* h = reinterpret_cast<const float*>(h_addr) + static_cast<i64>(row) * hidden;
  float ss = 0.f;
  for (int d = 2 * lane; d < hidden; d += 64) {
    const float2 v = *reinterpret_cast<const float2*>(h + d);
    ss += v.x * v.x;
    ss += v.y * v.y;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float r = rsqrtf(ss / static_cast<float>(hidden) + kEps);
  u16* x = reinterpret_cast<u16*>(x_addr) + static_cast<i64>(row) * hidden;
  for (int d = 2 * lane; d < hidden; d += 64) {
    const float2 v = *reinterpret_cast<const float2*>(h + d);
    *reinterpret_cast<u32*>(x + d) = pack_bf16(v.x * r, v.y * r);
  }
}

// Copy each token's K and V (from the qkv GEMM's output) into its paged slot.
// slots: i64 element offset of the token's [kv_heads, hd] in a layer's K (and V) cache.
extern "C" __global__ void __launch_bounds__(128)
kvflow_kv_write(const u64 qkv_addr, const int ld, const int q_dim, const int kv_dim,
                const u64 slots_addr, const u64 kc_addr, const u64 vc_addr) {
  const int row = blockIdx.x;
  const i64 slot = reinterpret_cast<const i64*>(slots_addr)[row];
  const u16* src = reinterpret_cast<const u16*>(qkv_addr) + static_cast<i64>(row) * ld + q_dim;
  u16* kc = reinterpret_cast<u16*>(kc_addr) + slot;
  u16* vc = reinterpret_cast<u16*>(vc_addr) + slot;
  for (int c = threadIdx.x; c < kv_dim / 8; c += blockDim.x) {
    *reinterpret_cast<uint4*>(kc + 8 * c) = *reinterpret_cast<const uint4*>(src + 8 * c);
    *reinterpret_cast<uint4*>(vc + 8 * c) = *reinterpret_cast<const uint4*>(src + kv_dim + 8 * c);
  }
}

// act[t, i] = silu(gu[t, i]) * gu[t, inter + i], bf16.
extern "C" __global__ void __launch_bounds__(256)
kvflow_silu_mul(const u64 gu_addr, const u64 act_addr, const int rows, const int inter) {
  const i64 pairs = static_cast<i64>(rows) * (inter / 2);
  const u16* gu = reinterpret_cast<const u16*>(gu_addr);
  u16* act = reinterpret_cast<u16*>(act_addr);
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < pairs;
       i += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 row = i / (inter / 2);
    const int c = static_cast<int>(i % (inter / 2)) * 2;
    const u16* gr = gu + row * 2 * inter;
    const u32 gg = ld32(gr + c), uu = ld32(gr + inter + c);
    float r[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float gv = bf2f(static_cast<u16>(gg >> (16 * e)));
      const float uv = bf2f(static_cast<u16>(uu >> (16 * e)));
      r[e] = gv / (1.0f + exp2f(-gv * 1.4426950408889634f)) * uv;
    }
    *reinterpret_cast<u32*>(act + row * inter + c) = pack_bf16(r[0], r[1]);
  }
}

// For each emitted row: y = h / rms(h) in fp32; out[2e] = argmax (first on ties),
// out[2e+1] = sum over d of bits(y_d) * (2d+1) mod 2^32 (order-free: integer sum).
// rows_out (optional, 0 for none): y as fp32 [emitted, hidden]. One warp per row.
extern "C" __global__ void __launch_bounds__(32)
kvflow_final(const u64 h_addr, const u64 rows_addr, const int hidden, const u64 out_addr,
             const u64 rows_out_addr) {
  const int e = blockIdx.x, lane = threadIdx.x;
  const int row = reinterpret_cast<const int*>(rows_addr)[e];
  const float* h = reinterpret_cast<const float*>(h_addr) + static_cast<i64>(row) * hidden;
  float ss = 0.f;
  for (int d = 2 * lane; d < hidden; d += 64) {
    const float2 v = *reinterpret_cast<const float2*>(h + d);
    ss += v.x * v.x;
    ss += v.y * v.y;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  const float r = rsqrtf(ss / static_cast<float>(hidden) + kEps);
  float best = neg_inf();
  int arg = 0x7fffffff;
  u32 sum = 0u;
  float* yo = rows_out_addr ? reinterpret_cast<float*>(rows_out_addr) + static_cast<i64>(e) * hidden
                            : nullptr;
  for (int d = 2 * lane; d < hidden; d += 64) {
    const float2 v = *reinterpret_cast<const float2*>(h + d);
    const float y0 = v.x * r, y1 = v.y * r;
    if (y0 > best) { best = y0; arg = d; }
    if (y1 > best) { best = y1; arg = d + 1; }
    sum += __float_as_uint(y0) * static_cast<u32>(2 * d + 1);
    sum += __float_as_uint(y1) * static_cast<u32>(2 * d + 3);
    if (yo) *reinterpret_cast<float2*>(yo + d) = make_float2(y0, y1);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffffu, best, o);
    const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
    if (ob > best || (ob == best && oa < arg)) { best = ob; arg = oa; }
    sum += __shfl_xor_sync(0xffffffffu, sum, o);
  }
  if (lane == 0) {
    u32* out = reinterpret_cast<u32*>(out_addr);
    out[2 * e] = static_cast<u32>(arg);
    out[2 * e + 1] = sum;
  }
}

// The step's packed metadata, host -> device, read by the SMs straight from pinned host
// memory (mapped: unified addressing) instead of a cudaMemcpyAsync. Measured on an H100
// (benchmarks/upload_under_load.py, results/gpu_overlap_fast.md): behind a 1 GiB
// layer-wise load of batched memcpys, a memcpy of 32 KiB or more (or a second one of
// 8 KiB) finished only when the whole load had, ~20 ms later, whatever the stream
// priority, even with most of the load's layers enqueued after it; this kernel finished
// within 1 ms. SM reads of a few tens of KB share the link with the load instead.
// n16: 16-byte words (the packed buffer is 16-byte aligned and sized). Loads are .cv
// (fetched again every time, never a cached line): the host rewrites the buffer each step.
extern "C" __global__ void __launch_bounds__(256)
kvflow_upload16(const u64 src_addr, const u64 dst_addr, const i64 n16) {
  const uint4* src = reinterpret_cast<const uint4*>(src_addr);
  uint4* dst = reinterpret_cast<uint4*>(dst_addr);
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n16;
       i += static_cast<i64>(gridDim.x) * blockDim.x) {
    dst[i] = __ldcv(src + i);
  }
}
