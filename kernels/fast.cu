// The fast executor's attention kernels (kernels/fast.py): paged, causal, GQA, bf16 in,
// fp32 softmax and accumulation, on tensor cores (mma.sync m16n8k16, operands through
// ldmatrix). Unlike compute.cu they are not batch-invariant: the tiles a row meets depend
// on where it sits in the step, so outputs match the exact executor to bf16 rounding,
// not bit for bit. They exist to measure kvflow's loads against compute as fast as a
// serving engine's (issue 22); the weight GEMMs of that executor are cuBLAS.
//
// Prefill (FlashAttention-2 style): a CTA per (work item of 16 MT W query rows, query
// head); warp w owns MT m-tiles of 16 rows with their Q fragments in registers (each K/V
// fragment read from shared memory serves all of them). Keys come in BN-key tiles, each
// key found through the request's block table (a tile may span blocks), K and V copied
// to shared memory with cp.async, ST stages so later tiles stream in while one is
// computed; online softmax in the log2 domain (the scale carries log2 e). Tiles past a
// warp's last row are skipped, the mask is applied only on tiles that cross the warp's
// diagonal. Work items run longest first (the grid's y runs backwards over them) so the
// long causal rows do not make the tail.
//
// Decode (flash-decoding): a CTA per (split of one sequence's keys, kv head), the group's
// query heads as the mma's rows; W warps share each BN-key tile, warp w taking keys
// 16w..16w+15 of it, STAGES tiles in flight; the warps merge in shared memory and write
// the split's unnormalised O and (max, sum) in compute.cu's partial format, which its
// kvflow_attn_combine merges across splits.
//
// Layouts as compute.cu: qkv row-major [tokens, ld]; a KV block of one layer and role is
// [block_tokens, kv_heads, head_dim] bf16 at block * block_stride elements; pointers as
// 64-bit integers. Shared memory is dynamic (more than 48 KB: the launcher raises the
// limit, see kernels/fast.py).

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

extern __shared__ __align__(16) unsigned char kvflow_fast_smem[];

namespace {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Two floats -> packed bf16x2 (lo in the low half), round to nearest even.
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

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
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lane L gives the address of row L % 8 of matrix L / 8.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const u16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const u16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

// 16-byte async copy global -> shared; bytes past src_bytes are zero-filled.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// Keys [k0, k0 + BN) of kv head kvh into Ks/Vs ([BN][HD + 8] each), through the block
// table; keys past `last` are zero-filled (finite: a masked p = 0 times V stays 0).
template <int HD, int BN, int THREADS>
__device__ __forceinline__ void load_kv(u16* Ks, u16* Vs, const u16* __restrict__ kc,
                                        const u16* __restrict__ vc,
                                        const int* __restrict__ table, const int k0,
                                        const int last, const int bt, const i64 block_stride,
                                        const int kv_dim, const int kvh) {
  constexpr int kCh = HD / 8;  // 16-byte chunks per key row
  constexpr int LDS = HD + 8;
#pragma unroll
  for (int c = threadIdx.x; c < BN * kCh; c += THREADS) {
    const int r = c / kCh, ch = c % kCh;
    const int key = k0 + r;
    const int src = key <= last ? key : last;
    const i64 off = static_cast<i64>(table[src / bt]) * block_stride +
                    static_cast<i64>(src % bt) * kv_dim + kvh * HD + ch * 8;
    const int n = key <= last ? 16 : 0;
    cp_async16(Ks + r * LDS + ch * 8, kc + off, n);
    cp_async16(Vs + r * LDS + ch * 8, vc + off, n);
  }
}

// load_kv with one division per tile instead of one per chunk: a thread's chunks are keys
// kb, kb + RS, kb + 2 RS... (RS = THREADS / (HD / 8)) of one column, so it walks the block
// table from kb's (block, offset). Keys past `last` read last's slot, zero-filled.
template <int HD, int BN, int THREADS>
__device__ __forceinline__ void load_kv_walk(u16* Ks, u16* Vs, const u16* __restrict__ kc,
                                             const u16* __restrict__ vc,
                                             const int* __restrict__ table, const int k0,
                                             const int last, const int bt,
                                             const i64 block_stride, const int kv_dim,
                                             const int kvh) {
  constexpr int kCh = HD / 8, LDS = HD + 8, RS = THREADS / kCh;
  static_assert(THREADS % kCh == 0 && (BN * kCh) % THREADS == 0, "whole rows per pass");
  const int ch = threadIdx.x % kCh;
  int r = threadIdx.x / kCh;
  int key = k0 + r;
  int blk = key / bt, off = key - blk * bt;
  const int lblk = last / bt, loff = last - lblk * bt;
  const i64 col = static_cast<i64>(kvh) * HD + ch * 8;
#pragma unroll
  for (int i = 0; i < BN * kCh / THREADS; ++i) {
    const bool ok = key <= last;
    const i64 src = static_cast<i64>(table[ok ? blk : lblk]) * block_stride +
                    static_cast<i64>(ok ? off : loff) * kv_dim + col;
    cp_async16(Ks + r * LDS + ch * 8, kc + src, ok ? 16 : 0);
    cp_async16(Vs + r * LDS + ch * 8, vc + src, ok ? 16 : 0);
    r += RS;
    key += RS;
    off += RS;
    while (off >= bt) {
      off -= bt;
      ++blk;
    }
  }
}

// Q fragments (mma A operand) of rows lo / hi, columns [col, col + HD).
template <int HD>
__device__ __forceinline__ void load_q(u32 (&qf)[HD / 16][4], const u16* __restrict__ lo,
                                       const u16* __restrict__ hi) {
  const int t = threadIdx.x & 3;
#pragma unroll
  for (int c = 0; c < HD / 16; ++c) {
    qf[c][0] = ld32(lo + c * 16 + 2 * t);
    qf[c][1] = ld32(hi + c * 16 + 2 * t);
    qf[c][2] = ld32(lo + c * 16 + 2 * t + 8);
    qf[c][3] = ld32(hi + c * 16 + 2 * t + 8);
  }
}

// S = Q K^T for keys [kb, kb + 8 NT) of the tile in Ks, for MT m-tiles of 16 rows (each
// K fragment loaded once serves all of them).
template <int HD, int NT, int MT>
__device__ __forceinline__ void qk(float (&s)[MT][NT][4], const u32 (&qf)[MT][HD / 16][4],
                                   const u16* Ks, const int kb) {
  constexpr int LDS = HD + 8;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
  // matrix L/8: keys +8 * (L/16), dims +8 * ((L/8) & 1)
  const u16* base = Ks + (kb + ((lane >> 4) & 1) * 8 + (lane & 7)) * LDS + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int c = 0; c < HD / 16; ++c) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      u32 b[4];
      ldmatrix_x4(b, base + np * 16 * LDS + c * 16);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_bf16(s[mt][2 * np], qf[mt][c], b[0], b[1]);
        mma_bf16(s[mt][2 * np + 1], qf[mt][c], b[2], b[3]);
      }
    }
  }
}

// qk with the Q fragments read from shared memory (Qw: the warp's 16 MT rows, [.][HD + 8])
// instead of held in registers: 64 registers fewer at head dim 128 and two m-tiles, which
// lets a warp hold S for 64-key tiles (half the per-tile softmax and barrier overhead).
template <int HD, int NT, int MT>
__device__ __forceinline__ void qk_smem(float (&s)[MT][NT][4], const u16* Qw, const u16* Ks,
                                        const int kb) {
  constexpr int LDS = HD + 8;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
  const u16* base = Ks + (kb + ((lane >> 4) & 1) * 8 + (lane & 7)) * LDS + ((lane >> 3) & 1) * 8;
  // A operand: matrix L/8 is rows +8 * ((L/8) & 1), dims +8 * (L/16): lane L gives row L % 16
  const u16* qbase = Qw + (lane & 15) * LDS + (lane >> 4) * 8;
#pragma unroll
  for (int c = 0; c < HD / 16; ++c) {
    u32 a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], qbase + mt * 16 * LDS + c * 16);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      u32 b[4];
      ldmatrix_x4(b, base + np * 16 * LDS + c * 16);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_bf16(s[mt][2 * np], a[mt], b[0], b[1]);
        mma_bf16(s[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// Online softmax on S (raw scores, masked ones -inf): updates m (scaled max), l (this
// lane's partial sums), rescales o, and turns S into P.
template <int HD, int NT, bool LAZY = false>
__device__ __forceinline__ void softmax_step(float (&s)[NT][4], const float scale,
                                             float (&m)[2], float (&l)[2],
                                             float (&o)[HD / 8][4]) {
  float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    mx[0] = fmaxf(mx[0], fmaxf(s[nt][0], s[nt][1]));
    mx[1] = fmaxf(mx[1], fmaxf(s[nt][2], s[nt][3]));
  }
  float base[2], alpha[2];
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    mx[hi] = fmaxf(mx[hi], __shfl_xor_sync(0xffffffffu, mx[hi], 1));
    mx[hi] = fmaxf(mx[hi], __shfl_xor_sync(0xffffffffu, mx[hi], 2));
    const float mn = fmaxf(m[hi], mx[hi] * scale);
    base[hi] = (mn == neg_inf()) ? 0.f : mn;
    alpha[hi] = ex2(m[hi] - base[hi]);
    m[hi] = mn;
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nt][e] = ex2(fmaf(s[nt][e], scale, -base[e >> 1]));
      sum[e >> 1] += s[nt][e];
    }
  }
  l[0] = l[0] * alpha[0] + sum[0];
  l[1] = l[1] * alpha[1] + sum[1];
  // LAZY: skip rescaling O when no row of the warp got a new max (alpha = 1 exactly);
  // callers run this warp-uniformly.
  if (LAZY && !__any_sync(0xffffffffu, (alpha[0] != 1.f) | (alpha[1] != 1.f))) return;
#pragma unroll
  for (int dn = 0; dn < HD / 8; ++dn) {
    o[dn][0] *= alpha[0];
    o[dn][1] *= alpha[0];
    o[dn][2] *= alpha[1];
    o[dn][3] *= alpha[1];
  }
}

// O += P V for keys [kb, kb + 8 NT) of the tile in Vs, for MT m-tiles.
template <int HD, int NT, int MT>
__device__ __forceinline__ void pv(float (&o)[MT][HD / 8][4], const float (&p)[MT][NT][4],
                                   const u16* Vs, const int kb) {
  constexpr int LDS = HD + 8;
  const int lane = threadIdx.x & 31;
  // matrix L/8: keys +8 * ((L/8) & 1), dims +8 * (L/16)
  const u16* base = Vs + (kb + ((lane >> 3) & 1) * 8 + (lane & 7)) * LDS + ((lane >> 4) & 1) * 8;
#pragma unroll
  for (int kc = 0; kc < NT / 2; ++kc) {
    u32 a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      a[mt][0] = pack_bf16(p[mt][2 * kc][0], p[mt][2 * kc][1]);
      a[mt][1] = pack_bf16(p[mt][2 * kc][2], p[mt][2 * kc][3]);
      a[mt][2] = pack_bf16(p[mt][2 * kc + 1][0], p[mt][2 * kc + 1][1]);
      a[mt][3] = pack_bf16(p[mt][2 * kc + 1][2], p[mt][2 * kc + 1][3]);
    }
#pragma unroll
    for (int dp = 0; dp < HD / 16; ++dp) {
      u32 b[4];
      ldmatrix_x4_trans(b, base + kc * 16 * LDS + dp * 16);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_bf16(o[mt][2 * dp], a[mt], b[0], b[1]);
        mma_bf16(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
      }
    }
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

// ------------------------------------------------------------------------------ prefill
// CTA (query head, work item); work: int4 per item (row0, nrows <= 16 MT W, qpos0, table
// offset). Warp w owns rows 16 MT w .. 16 MT (w + 1) - 1 as MT m-tiles. Shared: K and V,
// ST stages of [BN][HD + 8] each (ST - 1 tiles in flight while one is computed). OPT bit 0:
// the walking loader and lazy rescaling; bit 1: Q in shared memory ([16 MT W][HD + 8] before
// the K/V stages), read by ldmatrix for each tile (qk_smem) instead of held in registers.
template <int HD, int W, int BN, int MT, int ST, int OPT>
__device__ __forceinline__ void prefill(const u64 qkv_addr, const int ld, const u64 kc_addr,
                                        const u64 vc_addr, const i64 block_stride, const int bt,
                                        const int kv_heads, const int group, const u64 work_addr,
                                        const u64 tables_addr, const u64 out_addr,
                                        const float scale) {
  constexpr int LDS = HD + 8, NT = BN / 8, TILE = BN * LDS, WR = 16 * MT;
  constexpr bool WALK = (OPT & 1) != 0, QS = (OPT & 2) != 0;
  u16* Qs = reinterpret_cast<u16*>(kvflow_fast_smem);
  u16* Ks = Qs + (QS ? W * WR * LDS : 0);
  u16* Vs = Ks + ST * TILE;
  const int head = blockIdx.x;
  const int* wk = reinterpret_cast<const int*>(work_addr) + 4 * (gridDim.y - 1 - blockIdx.y);
  const int row0 = wk[0], nrows = wk[1], qpos0 = wk[2];
  const int* table = reinterpret_cast<const int*>(tables_addr) + wk[3];
  const u16* qkv = reinterpret_cast<const u16*>(qkv_addr);
  const u16* kc = reinterpret_cast<const u16*>(kc_addr);
  const u16* vc = reinterpret_cast<const u16*>(vc_addr);
  const int kvh = head / group, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int kv_dim = kv_heads * HD;
  const int r0 = warp * WR;
  const bool active = r0 < nrows;
  const int w_first = qpos0 + min(r0, nrows - 1), w_last = qpos0 + min(r0 + WR - 1, nrows - 1);
  const int last = qpos0 + nrows - 1;
  u32 qf[QS ? 1 : MT][HD / 16][4];
  int pos[MT][2];  // positions of this lane's rows (padding rows repeat the last real row)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int r_lo = min(r0 + 16 * mt + g, nrows - 1), r_hi = min(r0 + 16 * mt + g + 8, nrows - 1);
    pos[mt][0] = qpos0 + r_lo;
    pos[mt][1] = qpos0 + r_hi;
    if constexpr (!QS) {
      load_q<HD>(qf[mt], qkv + static_cast<i64>(row0 + r_lo) * ld + head * HD,
                 qkv + static_cast<i64>(row0 + r_hi) * ld + head * HD);
    }
  }
  if constexpr (QS) {  // the CTA's rows into Qs (16-byte chunks; padding rows repeat the last)
    constexpr int kCh = HD / 8;
    for (int c = threadIdx.x; c < W * WR * kCh; c += 32 * W) {
      const int r = c / kCh, ch = c % kCh;
      const int src = min(r, nrows - 1);
      *reinterpret_cast<uint4*>(Qs + r * LDS + ch * 8) = *reinterpret_cast<const uint4*>(
          qkv + static_cast<i64>(row0 + src) * ld + head * HD + ch * 8);
    }
  }  // (the main loop's first barrier comes before any warp reads them)
  float m[MT][2], l[MT][2], o[MT][HD / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) zero_state<HD>(m[mt], l[mt], o[mt]);
  const int ntiles = last / BN + 1;
  auto load = [&](int stage, int k0) {
    if constexpr (WALK) {
      load_kv_walk<HD, BN, 32 * W>(Ks + stage * TILE, Vs + stage * TILE, kc, vc, table, k0, last,
                                   bt, block_stride, kv_dim, kvh);
    } else {
      load_kv<HD, BN, 32 * W>(Ks + stage * TILE, Vs + stage * TILE, kc, vc, table, k0, last, bt,
                              block_stride, kv_dim, kvh);
    }
  };
#pragma unroll
  for (int i = 0; i < ST - 1; ++i) {
    if (i < ntiles) load(i, i * BN);
    cp_async_commit();
  }
  for (int j = 0; j < ntiles; ++j) {
    cp_async_wait<ST - 2>();
    __syncthreads();  // tile j landed for all; everyone is done with tile j - 1's stage
    const int nj = j + ST - 1;
    if (nj < ntiles) load(nj % ST, nj * BN);
    cp_async_commit();
    const int k0 = j * BN;
    const int cur = (j % ST) * TILE;
    if (active && k0 <= w_last) {
      float s[MT][NT][4];
      if constexpr (QS) {
        qk_smem<HD, NT, MT>(s, Qs + r0 * LDS, Ks + cur, 0);
      } else {
        qk<HD, NT, MT>(s, qf, Ks + cur, 0);
      }
      if (k0 + BN - 1 > w_first) {  // the tile crosses this warp's diagonal: mask
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (k0 + nt * 8 + 2 * t + (e & 1) > pos[mt][e >> 1]) s[mt][nt][e] = neg_inf();
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        softmax_step<HD, NT, WALK>(s[mt], scale, m[mt], l[mt], o[mt]);
      }
      pv<HD, NT, MT>(o, s, Vs + cur, 0);
    }
  }
  cp_async_wait<0>();
  if (!active) return;
  u16* out = reinterpret_cast<u16*>(out_addr);
  const int qdim = kv_heads * group * HD;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      float lt = l[mt][hi];
      lt += __shfl_xor_sync(0xffffffffu, lt, 1);
      lt += __shfl_xor_sync(0xffffffffu, lt, 2);
      const float inv = 1.0f / lt;
      const int r = r0 + 16 * mt + g + 8 * hi;
      if (r >= nrows) continue;
      u16* dst = out + static_cast<i64>(row0 + r) * qdim + head * HD;
#pragma unroll
      for (int dn = 0; dn < HD / 8; ++dn) {
        *reinterpret_cast<u32*>(dst + dn * 8 + 2 * t) =
            pack_bf16(o[mt][dn][2 * hi] * inv, o[mt][dn][2 * hi + 1] * inv);
      }
    }
  }
}

// ------------------------------------------------------------------------------- decode
// CTA (kv head, split); work: 5 ints per split (row, key begin, key end, table offset,
// partial index). BN = 16 W keys a tile, STAGES tiles in flight; rows = the group's heads.
template <int HD, int W, int STAGES>
__device__ __forceinline__ void decode(const u64 qkv_addr, const int ld, const u64 kc_addr,
                                       const u64 vc_addr, const i64 block_stride, const int bt,
                                       const int kv_heads, const int group, const u64 work_addr,
                                       const u64 tables_addr, const u64 part_o_addr,
                                       const u64 part_ml_addr, const float scale) {
  constexpr int BN = 16 * W, LDS = HD + 8, TILE = BN * LDS;
  u16* Ks = reinterpret_cast<u16*>(kvflow_fast_smem);
  u16* Vs = Ks + STAGES * TILE;
  const int* wk = reinterpret_cast<const int*>(work_addr) + 5 * blockIdx.y;
  const int row = wk[0], kbeg = wk[1], kend = wk[2], pidx = wk[4];
  const int* table = reinterpret_cast<const int*>(tables_addr) + wk[3];
  const u16* qkv = reinterpret_cast<const u16*>(qkv_addr);
  const u16* kc = reinterpret_cast<const u16*>(kc_addr);
  const u16* vc = reinterpret_cast<const u16*>(vc_addr);
  const int kvh = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int kv_dim = kv_heads * HD;
  const int h_lo = min(g, group - 1), h_hi = min(g + 8, group - 1);
  u32 qf[1][HD / 16][4];
  const u16* q = qkv + static_cast<i64>(row) * ld + kvh * group * HD;
  load_q<HD>(qf[0], q + h_lo * HD, q + h_hi * HD);
  float m[2], l[2], o[1][HD / 8][4];
  zero_state<HD>(m, l, o[0]);
  const int last = kend - 1;
  const int ntiles = (kend - kbeg + BN - 1) / BN;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ntiles) {
      load_kv<HD, BN, 32 * W>(Ks + s * TILE, Vs + s * TILE, kc, vc, table, kbeg + s * BN, last,
                              bt, block_stride, kv_dim, kvh);
    }
    cp_async_commit();
  }
  for (int j = 0; j < ntiles; ++j) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();
    const int nj = j + STAGES - 1;
    if (nj < ntiles) {
      const int st = nj % STAGES;
      load_kv<HD, BN, 32 * W>(Ks + st * TILE, Vs + st * TILE, kc, vc, table, kbeg + nj * BN,
                              last, bt, block_stride, kv_dim, kvh);
    }
    cp_async_commit();
    const int kw = kbeg + j * BN + warp * 16;  // this warp's 16 keys
    if (kw <= last) {
      const int st = j % STAGES;
      float s[1][2][4];
      qk<HD, 2, 1>(s, qf, Ks + st * TILE, warp * 16);
      if (kw + 15 > last) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (kw + nt * 8 + 2 * t + (e & 1) > last) s[0][nt][e] = neg_inf();
      }
      softmax_step<HD, 2>(s[0], scale, m, l, o[0]);
      pv<HD, 2, 1>(o, s, Vs + st * TILE, warp * 16);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the stages are free: reuse them to merge the warps
  // Per warp: m, l per row (16), o [16][HD] in fp32.
  float* sm_ml = reinterpret_cast<float*>(kvflow_fast_smem);       // [W][16][2]
  float* sm_o = sm_ml + W * 32;                                      // [W][16][HD]
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    float lt = l[hi];
    lt += __shfl_xor_sync(0xffffffffu, lt, 1);
    lt += __shfl_xor_sync(0xffffffffu, lt, 2);
    const int r = g + 8 * hi;
    if (t == 0) {
      sm_ml[(warp * 16 + r) * 2] = m[hi];
      sm_ml[(warp * 16 + r) * 2 + 1] = lt;
    }
    float* dst = sm_o + (warp * 16 + r) * HD;
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn) {
      *reinterpret_cast<float2*>(dst + dn * 8 + 2 * t) =
          make_float2(o[0][dn][2 * hi], o[0][dn][2 * hi + 1]);
    }
  }
  __syncthreads();
  const int heads = kv_heads * group;
  float* po = reinterpret_cast<float*>(part_o_addr);
  float* pml = reinterpret_cast<float*>(part_ml_addr);
  for (int i = threadIdx.x; i < group * HD; i += 32 * W) {
    const int r = i / HD, d = i % HD;
    float mm = neg_inf();
#pragma unroll
    for (int w = 0; w < W; ++w) mm = fmaxf(mm, sm_ml[(w * 16 + r) * 2]);
    float acc = 0.f, den = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float mw = sm_ml[(w * 16 + r) * 2];
      const float f = (mw == neg_inf()) ? 0.f : ex2(mw - mm);
      acc += f * sm_o[(w * 16 + r) * HD + d];
      den += f * sm_ml[(w * 16 + r) * 2 + 1];
    }
    const i64 ph = static_cast<i64>(pidx) * heads + kvh * group + r;
    po[ph * HD + d] = acc;
    if (d == 0) {
      pml[2 * ph] = mm;
      pml[2 * ph + 1] = den;
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------- entry points
#define KVFLOW_FAST_PREFILL(HD, W, BN, MT, ST, OPT)                                              \
  extern "C" __global__ void __launch_bounds__(32 * W)                                           \
      kvflow_fast_prefill_hd##HD##_w##W##_m##MT##_n##BN##_s##ST##_o##OPT(                        \
          const u64 qkv, const int ld, const u64 kc, const u64 vc, const i64 block_stride,       \
          const int bt, const int kv_heads, const int group, const u64 work, const u64 tables,   \
          const u64 out, const float scale) {                                                    \
    prefill<HD, W, BN, MT, ST, OPT>(qkv, ld, kc, vc, block_stride, bt, kv_heads, group, work,    \
                                    tables, out, scale);                                         \
  }

#define KVFLOW_FAST_DECODE(HD, W, ST)                                                            \
  extern "C" __global__ void __launch_bounds__(32 * W) kvflow_fast_decode_hd##HD##_w##W(        \
      const u64 qkv, const int ld, const u64 kc, const u64 vc, const i64 block_stride,           \
      const int bt, const int kv_heads, const int group, const u64 work, const u64 tables,       \
      const u64 part_o, const u64 part_ml, const float scale) {                                  \
    decode<HD, W, ST>(qkv, ld, kc, vc, block_stride, bt, kv_heads, group, work, tables, part_o,  \
                      part_ml, scale);                                                           \
  }

// (HD, warps, keys a tile, m-tiles a warp, stages, opt): kernels/fast.py's PREFILL_VARIANTS.
#define KVFLOW_FAST_PREFILL_ALL(HD)          \
  KVFLOW_FAST_PREFILL(HD, 8, 64, 1, 2, 0)    \
  KVFLOW_FAST_PREFILL(HD, 4, 64, 1, 2, 0)    \
  KVFLOW_FAST_PREFILL(HD, 4, 32, 2, 2, 0)    \
  KVFLOW_FAST_PREFILL(HD, 4, 64, 2, 2, 0)    \
  KVFLOW_FAST_PREFILL(HD, 4, 32, 2, 3, 0)    \
  KVFLOW_FAST_PREFILL(HD, 8, 32, 2, 2, 0)    \
  KVFLOW_FAST_PREFILL(HD, 4, 32, 2, 2, 1)    \
  KVFLOW_FAST_PREFILL(HD, 4, 32, 2, 3, 1)    \
  KVFLOW_FAST_PREFILL(HD, 4, 64, 2, 2, 3)    \
  KVFLOW_FAST_PREFILL(HD, 4, 32, 2, 2, 3)    \
  KVFLOW_FAST_PREFILL(HD, 8, 64, 2, 2, 3)
KVFLOW_FAST_PREFILL_ALL(64)
KVFLOW_FAST_PREFILL_ALL(128)
KVFLOW_FAST_DECODE(64, 4, 3)
KVFLOW_FAST_DECODE(128, 4, 3)
