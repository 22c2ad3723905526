// The fast executor's Hopper prefill attention kernel (issue 22; kernels/fast.py loads it
// with NVRTC for sm_90a, the `wg...` names of PREFILL_VARIANTS). Same job, inputs and
// output as fast.cu's prefill (paged, causal, GQA, bf16 in, fp32 softmax and accumulation),
// in the FlashAttention-3 design: warpgroup MMA (wgmma) instead of mma.sync, and producer /
// consumer warp specialisation over mbarriers.
//
// A CTA per (query head, work item of 128 rows) has three warpgroups. Warpgroup 0 is the
// producer: it walks the request's block table and copies BN-key K and V tiles into ST
// shared-memory stages with cp.async (a tile spans several KV blocks, so no tensor-map copy
// fits), each thread's copies completing on the stage's `full` mbarrier
// (cp.async.mbarrier.arrive.noinc), and refills a stage once the consumers have released it
// on its `empty` mbarrier. Warpgroups 1 and 2 each own 64 query rows: S = Q K^T by wgmma with
// both operands in shared memory, online softmax in registers (log2 domain, as fast.cu),
// then O += P V by wgmma with P as bf16 fragments in registers and V read N-major
// (transposed by the descriptor). Each consumer issues P V of tile j and Q K^T of tile j + 1
// back to back before it waits, so the tensor cores see no gap between them; the two
// consumers interleave on their own (one in softmax while the other multiplies).
// setmaxnreg gives the producer's registers to the consumers.
//
// Shared-memory operands use the 128-byte swizzle: a row (query or key) of HD bf16 is split
// into HD / 64 regions of 128 bytes; in region c, row r's 16-byte chunk q sits at
// r * 128 + ((q ^ (r % 8)) * 16), regions 1024-byte aligned. As a K-major operand
// (Q for A, K for B) a descriptor covers 8-row groups 1024 bytes apart (SBO) and steps 16
// dims by adding 32 bytes; V is the N-major B operand of P V: 8-key groups 1024 bytes apart
// (SBO), 64-dim regions a tile apart (LBO).
//
// The wgmma code is compiled only for sm_90a (__CUDA_ARCH_FEAT_SM90_ALL); built for any
// other target (the sm_90 PTX test of every source) the kernels trap.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

extern __shared__ __align__(1024) unsigned char kvflow_wg_smem[];

namespace {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

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

__device__ __forceinline__ u32 smem_u32(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// ------------------------------------------------------------------------ mbarriers
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n"
               :: "r"(bar) : "memory");
}
// Blocks until the phase of parity `parity` has completed. A wait that never ends is a bug
// in the pipeline: after ~16M polls the kernel traps (an error the host sees) instead of
// hanging the GPU. (In PTX: a C++ loop or a call around it costs the consumers registers
// and serialises their wgmma.)
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred done, late;\n.reg .u32 n;\n"
      "mov.u32 n, 0;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@done bra DONE_%=;\n"
      "add.u32 n, n, 1;\n"
      "setp.gt.u32 late, n, 16777216;\n"
      "@late trap;\n"
      "bra WAIT_%=;\n"
      "DONE_%=:\n}\n"
      :: "r"(bar), "r"(parity) : "memory");
}

// The barrier gets one arrival when all of this thread's earlier cp.async copies landed.
__device__ __forceinline__ void cp_async_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" :: "r"(bar) : "memory");
}

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
               :: "r"(dst), "l"(src), "r"(src_bytes) : "memory");
}

__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void named_sync(u32 id, u32 threads) {
  asm volatile("bar.sync %0, %1;\n" :: "r"(id), "r"(threads) : "memory");
}

// --------------------------------------------------------------------------- wgmma
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory");
}
// Keeps the compiler from moving reads or writes of accumulator registers across the
// asynchronous wgmma (which writes them after the issuing asm statement returns).
template <int N>
__device__ __forceinline__ void reg_fence(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle; byte offsets.
__device__ __forceinline__ u64 desc(u32 addr, u32 lbo, u32 sbo) {
  return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>(lbo >> 4) << 16) |
         (static_cast<u64>(sbo >> 4) << 32) | (1ull << 62);
}

// Byte offset of 16-byte chunk q (of a row of HD bf16) of row r, in a tile of R rows.
template <int R>
__device__ __forceinline__ u32 swz(int r, int q) {
  return static_cast<u32>((q >> 3) * (R * 128) + r * 128 + (((q & 7) ^ (r & 7)) << 4));
}

// D[64 x 64] (+)= A . B, A and B K-major in shared memory (descriptors); scale_d 0: D = A . B.
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[32], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(scale_d));
}

// D[64 x 64] += A . B, A (bf16 fragments) in registers, B MN-major in shared memory.
__device__ __forceinline__ void wgmma_rs_n64_mn(float (&d)[32], const u32 (&a)[4], u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}

// D[64 x 128] (+)= A . B, A and B K-major in shared memory (descriptors); scale_d 0: D = A . B.
__device__ __forceinline__ void wgmma_ss_n128(float (&d)[64], u64 da, u64 db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d));
}

// D[64 x 128] += A . B, A (bf16 fragments) in registers, B MN-major in shared memory.
__device__ __forceinline__ void wgmma_rs_n128_mn(float (&d)[64], const u32 (&a)[4], u64 db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}

// --------------------------------------------------------------------------- prefill
// CTA (query head, work item); work: int4 per item (row0, nrows <= 128, qpos0, table
// offset), as fast.cu. Threads 0-127 produce, 128-255 and 256-383 own rows 0-63 and 64-127.
template <int HD, int BN, int ST, bool OV>
__device__ __forceinline__ void prefill_wg(const u64 qkv_addr, const int ld, const u64 kc_addr,
                                           const u64 vc_addr, const i64 block_stride,
                                           const int bt, const int kv_heads, const int group,
                                           const u64 work_addr, const u64 tables_addr,
                                           const u64 out_addr, const float scale) {
  constexpr int KCH = HD / 8;                   // 16-byte chunks a row
  constexpr u32 Q_BYTES = 64 * HD * 2;          // a consumer's 64 rows of Q
  constexpr u32 T_BYTES = BN * HD * 2;          // one K or V tile
  constexpr int NS = BN / 2, NO = HD / 2;       // accumulator floats a thread: S, O
  static_assert(HD % 64 == 0 && BN % 64 == 0, "whole 128-byte swizzle regions");
  const u32 base = (smem_u32(kvflow_wg_smem) + 1023u) & ~1023u;
  const u32 q_s = base, k_s = q_s + 2 * Q_BYTES, v_s = k_s + ST * T_BYTES;
  const u32 full = v_s + ST * T_BYTES, empty = full + 8 * ST;  // mbarriers, 8 bytes each
  const int head = blockIdx.x;
  const int* wk = reinterpret_cast<const int*>(work_addr) + 4 * (gridDim.y - 1 - blockIdx.y);
  const int row0 = wk[0], nrows = wk[1], qpos0 = wk[2];
  const int* table = reinterpret_cast<const int*>(tables_addr) + wk[3];
  const int kvh = head / group, kv_dim = kv_heads * HD;
  const int last = qpos0 + nrows - 1, ntiles = last / BN + 1;
  // warpgroup index through a shuffle: the compiler then knows it is warp-uniform (else it
  // serialises the wgmma in branches on it, warning C7520)
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 7), 0);
  const int tid = threadIdx.x & 127;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < ST; ++s) {
      mbar_init(full + 8 * s, 128);  // every producer thread, when its copies landed
      mbar_init(empty + 8 * s, 8);   // every consumer warp, when its wgmma read the stage
    }
  }
  __syncthreads();
  if (wg == 0) {
    // ------------------------------------------------------------------ producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
    const u16* kc = reinterpret_cast<const u16*>(kc_addr);
    const u16* vc = reinterpret_cast<const u16*>(vc_addr);
    constexpr int RP = 128 / KCH;  // rows a pass
    const int ch = tid % KCH, rt = tid / KCH;
    const i64 col = static_cast<i64>(kvh) * HD + ch * 8;
    for (int j = 0; j < ntiles; ++j) {
      const int s = j % ST;
      if (j >= ST) mbar_wait(empty + 8 * s, ((j / ST) - 1) & 1);
      const u32 kd = k_s + s * T_BYTES, vd = v_s + s * T_BYTES;
#pragma unroll 4
      for (int i = 0; i < BN / RP; ++i) {
        const int r = rt + i * RP, key = j * BN + r;
        const bool ok = key <= last;
        const int src = ok ? key : last;  // keys past the last row: zero-filled
        const int blk = src / bt;
        const i64 off = static_cast<i64>(table[blk]) * block_stride +
                        static_cast<i64>(src - blk * bt) * kv_dim + col;
        const u32 o = swz<BN>(r, ch);
        cp_async16(kd + o, kc + off, ok ? 16 : 0);
        cp_async16(vd + o, vc + off, ok ? 16 : 0);
      }
      cp_async_arrive(full + 8 * s);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
  } else {
    // ------------------------------------------------------------------ consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");
    const int cw = wg - 1, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int r0 = 64 * cw;
    const u32 qw = q_s + cw * Q_BYTES;
    {  // this warpgroup's 64 rows of Q (padding rows repeat the last row)
      const u16* qkv = reinterpret_cast<const u16*>(qkv_addr);
      for (int c = tid; c < 64 * KCH; c += 128) {
        const int r = c / KCH, q = c % KCH;
        const int src = min(r0 + r, nrows - 1);
        const uint4 v = *reinterpret_cast<const uint4*>(
            qkv + static_cast<i64>(row0 + src) * ld + head * HD + q * 8);
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n"
                     :: "r"(qw + swz<64>(r, q)), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                     : "memory");
      }
      fence_async_smem();  // the wgmma (async proxy) reads what these stores wrote
      named_sync(1 + cw, 128);
    }
    const int rl = r0 + 16 * warp + g;
    const int pos_lo = qpos0 + min(rl, nrows - 1), pos_hi = qpos0 + min(rl + 8, nrows - 1);
    const int wg_first = qpos0 + min(r0, nrows - 1);
    const int wg_last = qpos0 + min(r0 + 63, nrows - 1);
    const int nt = wg_last / BN + 1;  // tiles this warpgroup needs (the rest it only releases)
    float o[NO], s[NS];
#pragma unroll
    for (int i = 0; i < NO; ++i) o[i] = 0.f;
#pragma unroll
    for (int i = 0; i < NS; ++i) s[i] = 0.f;
    u32 p[BN / 16][4];
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};

    auto issue_qk = [&](int j) {  // S = Q K^T (tile j)
      const u32 kb = k_s + (j % ST) * T_BYTES;
#pragma unroll
      for (int ks = 0; ks < HD / 16; ++ks) {
        const u64 da = desc(qw + (ks >> 2) * (64 * 128) + (ks & 3) * 32, 16, 1024);
        const u64 db = desc(kb + (ks >> 2) * (BN * 128) + (ks & 3) * 32, 16, 1024);
        if constexpr (BN == 128) {
          wgmma_ss_n128(s, da, db, ks);
        } else {
          wgmma_ss_n64(s, da, db, ks);
        }
      }
    };
    auto issue_pv = [&](int j, const u32 (&pf)[BN / 16][4]) {  // O += P V (tile j)
      const u32 vb = v_s + (j % ST) * T_BYTES;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        const u64 db = desc(vb + kk * 2048, BN * 128, 1024);
        if constexpr (HD == 128) {
          wgmma_rs_n128_mn(o, pf[kk], db);
        } else {
          wgmma_rs_n64_mn(o, pf[kk], db);
        }
      }
    };
    // S (tile j) -> P as bf16 fragments in `pf`; m and l updated; alpha: the factor O must
    // be rescaled by (left to the caller: O may still be in a wgmma's hands).
    auto softmax = [&](int j, u32 (&pf)[BN / 16][4], float (&alpha)[2]) {
      const int k0 = j * BN;
      if (k0 + BN - 1 > wg_first) {  // the tile crosses this warpgroup's diagonal: mask
#pragma unroll
        for (int i = 0; i < NS; ++i) {
          const int key = k0 + 8 * (i >> 2) + 2 * t + (i & 1);
          if (key > ((i & 2) ? pos_hi : pos_lo)) s[i] = neg_inf();
        }
      }
      float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
      for (int i = 0; i < NS; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
      float bias[2], sum[2] = {0.f, 0.f};
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        mx[hi] = fmaxf(mx[hi], __shfl_xor_sync(0xffffffffu, mx[hi], 1));
        mx[hi] = fmaxf(mx[hi], __shfl_xor_sync(0xffffffffu, mx[hi], 2));
        const float mn = fmaxf(m[hi], mx[hi] * scale);
        bias[hi] = (mn == neg_inf()) ? 0.f : mn;
        alpha[hi] = ex2(m[hi] - bias[hi]);
        m[hi] = mn;
      }
#pragma unroll
      for (int i = 0; i < NS; ++i) {
        s[i] = ex2(fmaf(s[i], scale, -bias[(i >> 1) & 1]));
        sum[(i >> 1) & 1] += s[i];
      }
      l[0] = l[0] * alpha[0] + sum[0];
      l[1] = l[1] * alpha[1] + sum[1];
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        pf[kk][0] = pack_bf16(s[8 * kk + 0], s[8 * kk + 1]);
        pf[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
        pf[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
        pf[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
      }
    };
    auto rescale = [&](const float (&alpha)[2]) {
#pragma unroll
      for (int i = 0; i < NO; ++i) o[i] *= alpha[(i >> 1) & 1];
    };
    auto release = [&](int j) {  // this warp is done with tile j's stage
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + 8 * (j % ST));
    };
    auto wait_tile = [&](int j) {
      mbar_wait(full + 8 * (j % ST), (j / ST) & 1);
      fence_async_smem();
    };

    float alpha[2];
    wait_tile(0);
    reg_fence(s);
    wg_fence();
    issue_qk(0);
    wg_commit();
    wg_wait<0>();
    reg_fence(s);
    softmax(0, p, alpha);  // O is zero: no rescale
    if constexpr (!OV) {
      // P V of tile j, then Q K^T of tile j + 1 right behind it; softmax after both.
      for (int j = 0; j < nt; ++j) {
        reg_fence(o);
        wg_fence();
        issue_pv(j, p);
        wg_commit();
        if (j + 1 < nt) {
          wait_tile(j + 1);
          wg_fence();  // softmax wrote S's registers since the last fence
          issue_qk(j + 1);
          wg_commit();
          wg_wait<1>();  // P V of tile j done (groups complete in order)
        } else {
          wg_wait<0>();
        }
        release(j);
        wg_wait<0>();
        reg_fence(o);
        reg_fence(s);
        if (j + 1 < nt) {
          softmax(j + 1, p, alpha);
          rescale(alpha);
        }
      }
    } else {
      // FlashAttention-3's intra-warpgroup overlap: Q K^T of tile j + 1 first, then P V of
      // tile j; the softmax of tile j + 1 runs while P V of tile j is on the tensor cores
      // (P double-buffered; O rescaled once P V is done).
      u32 pn[BN / 16][4];
      // P V of tile j reads pc; the softmax of tile j + 1 writes pnx (the loop runs two
      // tiles a turn, swapping them, so that no register copy sits in the pipeline). The
      // last tile is peeled: a Q K^T issued under a condition would leave ptxas unsure
      // which group wait_group 1 retires, and it would serialise the wgmma (C7514).
      auto step = [&](int j, const u32 (&pc)[BN / 16][4], u32 (&pnx)[BN / 16][4]) {
        wait_tile(j + 1);  // (j + 1 < nt)
        reg_fence(o);
        reg_fence(s);
        wg_fence();
        issue_qk(j + 1);
        wg_commit();
        issue_pv(j, pc);
        wg_commit();
        wg_wait<1>();  // Q K^T of tile j + 1 done; P V of tile j may still run
        reg_fence(s);
        softmax(j + 1, pnx, alpha);
        wg_wait<0>();
        reg_fence(o);
        release(j);
        rescale(alpha);
      };
      auto last_step = [&](int j, const u32 (&pc)[BN / 16][4]) {
        reg_fence(o);
        wg_fence();
        issue_pv(j, pc);
        wg_commit();
        wg_wait<0>();
        reg_fence(o);
        release(j);
      };
      int j = 0;
      for (; j + 2 < nt; j += 2) {
        step(j, p, pn);
        step(j + 1, pn, p);
      }
      if (j + 1 < nt) {
        step(j, p, pn);
        last_step(j + 1, pn);
      } else {
        last_step(j, p);
      }
    }
    for (int j = nt; j < ntiles; ++j) {  // tiles past this warpgroup's rows: release them
      mbar_wait(full + 8 * (j % ST), (j / ST) & 1);
      release(j);
    }
    u16* out = reinterpret_cast<u16*>(out_addr);
    const int qdim = kv_heads * group * HD;
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      float lt = l[hi];
      lt += __shfl_xor_sync(0xffffffffu, lt, 1);
      lt += __shfl_xor_sync(0xffffffffu, lt, 2);
      const float inv = 1.0f / lt;
      const int r = rl + 8 * hi;
      if (r >= nrows) continue;
      u16* dst = out + static_cast<i64>(row0 + r) * qdim + head * HD;
#pragma unroll
      for (int dn = 0; dn < HD / 8; ++dn) {
        *reinterpret_cast<u32*>(dst + dn * 8 + 2 * t) =
            pack_bf16(o[4 * dn + 2 * hi] * inv, o[4 * dn + 2 * hi + 1] * inv);
      }
    }
  }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

}  // namespace

// ---------------------------------------------------------------------- entry points
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KVFLOW_WG_BODY(HD, BN, ST, OV)                                                        \
  prefill_wg<HD, BN, ST, OV>(qkv, ld, kc, vc, block_stride, bt, kv_heads, group, work, tables, \
                             out, scale);
#else
#define KVFLOW_WG_BODY(HD, BN, ST, OV) __trap();
#endif

// (HD, keys a tile, stages, overlap): kernels/fast.py's WG_PREFILL_VARIANTS
#define KVFLOW_WG_PREFILL(HD, BN, ST, OV)                                                     \
  extern "C" __global__ void __launch_bounds__(384, 1)                                        \
      kvflow_wg_prefill_hd##HD##_n##BN##_s##ST##_v##OV(                                       \
          const u64 qkv, const int ld, const u64 kc, const u64 vc, const i64 block_stride,     \
          const int bt, const int kv_heads, const int group, const u64 work,                   \
          const u64 tables, const u64 out, const float scale) {                                \
    KVFLOW_WG_BODY(HD, BN, ST, OV)                                                             \
  }

#define KVFLOW_WG_PREFILL_ALL(HD)   \
  KVFLOW_WG_PREFILL(HD, 128, 2, 0)  \
  KVFLOW_WG_PREFILL(HD, 128, 3, 0)  \
  KVFLOW_WG_PREFILL(HD, 64, 3, 0)   \
  KVFLOW_WG_PREFILL(HD, 128, 3, 1)  \
  KVFLOW_WG_PREFILL(HD, 64, 3, 1)
KVFLOW_WG_PREFILL_ALL(64)
KVFLOW_WG_PREFILL_ALL(128)
