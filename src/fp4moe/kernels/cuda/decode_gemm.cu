// fp4moe: the decode-size grouped GEMMs (FC1 with SwiGLU, FC2) of W4A16 in CUDA C++ for
// Hopper (sm_90a), with loop 3's bits (docs/architecture.md, kernels/gluon_decode.py).
//
// Why a CUDA kernel: at decode sizes the Triton/Gluon kernels spend most of their time in
// their skeleton (TMA descriptors and mbarriers, the split-K partials in HBM, the tile
// counter, the last program's sums; docs/perf-notes.md sessions 16 to 18). Here a weight
// is loaded straight from HBM into the registers that hold it for the MMA, and the K
// segments of a tile are the warps of one thread block, summed through shared memory.
//
// Numerics (the same as the Gluon kernels', so that every path gives the same bits):
//   - weights decoded to bf16 e2m1 * scale * 2^-8 (exact) with the same instructions as
//     gemm._CHUNK_DECODE_ASM; activations bf16 as given;
//   - the K order of loop 3's units (launch.k_order 64): element 16 q + 4 s + 2 a + b of a
//     64-element unit at position 16 s + 8 b + 2 q + a, so k16 step s holds the same
//     elements as the wgmma's;
//   - each 1024-element segment summed from zero by the tensor cores (k16 steps in
//     order), the segment sums added in order from zero, ((0 + P_0) + P_1) + ...;
//   - the epilogue of gluon_ws._tile_out with the same PTX operations (mul.f32, ex2.approx,
//     div.full, cvt.rn.bf16), so nothing is contracted or reordered (built with
//     --fmad=false, and the operations written as intrinsics or PTX).
//
// Work: a thread block takes (weight tile, row block) items of the sort's schedule in turn
// (a persistent grid, items of valid blocks only). Its warps are (row group, K segment)
// pairs: warp w takes segment w % S of row group w / S. A warp's rows are two 16-row
// m16n8k16 A tiles (FC1: 16 gate rows and their 16 up rows; FC2: 32 rows); the block's
// 8 (NT = 1) or 16 (NT = 2) rows are the MMA's N.

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#ifndef FP4MOE_L2NEXT  // experiment (a library of its own): 1 FC1 prefetches FC2's weights
#define FP4MOE_L2NEXT 0  // into L2 (Params nx_*); 2 also with L2 eviction priorities
#endif

namespace {

struct Params {
  const void* x;               // bf16 [rows, K]: FC1 tokens (gather: route // topk), FC2 sorted rows
  const int32_t* sorted_routes;  // int32 [T * topk]
  const uint8_t* codes;        // uint8 [E, W_ROWS, K / 2]
  const uint8_t* scales;       // e4m3 bytes [E, W_ROWS, K / 16]
  const int32_t* block_expert;  // int32 [blocks] (-1: empty)
  const int32_t* block_start;
  const int32_t* block_end;
  const int32_t* valid_blocks;  // int32 [1]: the valid blocks come first
  const float* w_global;       // fp32 [E] or [E, 2] (gated)
  const float* topk_w;         // fp32 [T * topk] (fused)
  void* out;                   // bf16 [rows, N] sorted rows, or fp32 [T, N] (fused)
  int n, k, topk, gather, fused, pdl, segs;
#if FP4MOE_L2NEXT  // (only there: a larger Params changes the other kernels' SASS)
  // FC1: FC2's codes [E, K, n / 2] and scales [E, K, n / 16], prefetched into L2 for the
  // experts of this kernel's items where its valid blocks are at most nx_max
  const uint8_t* nx_codes;
  const uint8_t* nx_scales;
  int nx_max;
#endif
};

#ifndef FP4MOE_RT  // experiment (a library of its own): 1, one 16-row A tile a warp (FC1: 8
#define FP4MOE_RT 2  // gate rows and their 8 up rows), half the registers and shared memory
#endif
constexpr int RT = FP4MOE_RT;  // 16-row A tiles a warp
static_assert(RT == 1 || RT == 2, "FP4MOE_RT: 1 or 2");
constexpr int UNITS = 16;      // 64-element units a 1024-element segment

__device__ __forceinline__ void pdl_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void pdl_release() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// Asynchronous copies global -> shared (LDGSTS): nothing of them is held in registers while
// in flight, and the compiler cannot move them next to their use (it does so with plain
// loads, which kept the loads ahead at one unit).
#if FP4MOE_L2NEXT
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes, uint64_t pol) {
  if constexpr (FP4MOE_L2NEXT == 2)
    asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(p),
                 "r"(bytes), "l"(pol) : "memory");
  else
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
#endif
__device__ __forceinline__ void cp_async16_pol(uint32_t dst, const void* src, uint64_t pol) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst),
               "l"(src), "l"(pol) : "memory");
}
#ifndef FP4MOE_DIAG  // timing only, wrong results (a library of its own): bit 0 leaves the
#define FP4MOE_DIAG 0  // decode out (the codes as the MMA's A), bit 1 the weights' copies
#endif
#ifndef FP4MOE_ROT  // experiment (a library of its own): 1, the codes in the rotated layout
#define FP4MOE_ROT 0  // (cuda_decode.rotated_codes), decoded by decode_rot
#endif
// 16 bytes, or zeros when !ok (src-size 0: nothing is read)
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool ok) {
  if constexpr ((FP4MOE_DIAG & 2) != 0) return;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ uint2 lds64(uint32_t a) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a));
  return v;
}

// e4m3 scale byte (non-negative) -> bf16x2 (scale * 2^118, both halves), exactly what
// (scale.to(fp32) * 2^118).to(bf16) gives: the byte's bits at 26..20 are an fp32 of
// value scale * 2^-120 (normal and subnormal alike), times 2^119 twice.
__device__ __forceinline__ uint32_t scale_pair(uint32_t byte) {
  float f = __uint_as_float(byte << 20);
  f = __fmul_rn(f, 6.64613997892457936e35f);  // 2^119
  f = __fmul_rn(f, 6.64613997892457936e35f);
  uint32_t b = __float_as_uint(f);
  uint32_t r;
  asm("prmt.b32 %0, %1, %1, 0x3232;" : "=r"(r) : "r"(b));
  return r;
}

// Two code bytes (bytes 2 j and 2 j + 1 of a row's 8-byte block piece, j = step) to the
// bf16 pairs of their low and high nibbles times the scale (gemm._CHUNK_DECODE_ASM).
template <int SEL>
__device__ __forceinline__ void decode_pair(uint32_t w, uint32_t s2, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b32 t, u, z;\nmov.b32 z, 0x80008000;\n"
      "prmt.b32 t, %2, 0, %4;\n"
      "and.b32 u, t, 0x000F000F;\nmul.lo.u32 u, u, 0x1040;\nand.b32 u, u, 0x81C081C0;\n"
      "fma.rn.bf16x2 %0, u, %3, z;\n"
      "and.b32 u, t, 0x00F000F0;\nmul.lo.u32 u, u, 0x104;\nand.b32 u, u, 0x81C081C0;\n"
      "fma.rn.bf16x2 %1, u, %3, z;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(w), "r"(s2), "n"(SEL));
}

// ROT: the two bf16 pair registers of a step (decode_pair's, the low and the high nibbles'
// registers of bytes 2 j and 2 j + 1 of today's layout; ODD: j = 1) from the code word in
// the rotated layout (cuda_decode.rotated_codes: a fixed permutation of each 32-bit word's
// bits), in the 15 instructions a word of docs/perf-notes.md session 23 item 1 (7 even, 8
// odd), against decode_pair's 18: rotations 1, 2, 3, 6 and 12; a register of one rotation
// and an AND, or of two rotations and two LOP3s; then the scale's fma each. The same
// registers as decode_pair's, so the same bits.
template <bool ODD>
__device__ __forceinline__ void decode_rot(uint32_t w, uint32_t s2, uint32_t& lo, uint32_t& hi) {
  if constexpr (!ODD) {
    asm("{\n.reg .b32 w1, w3, t, z;\nmov.b32 z, 0x80008000;\n"
        "and.b32 t, %2, 0x81C081C0;\nfma.rn.bf16x2 %0, t, %3, z;\n"
        "shf.l.wrap.b32 w1, %2, %2, 1;\nshf.l.wrap.b32 w3, %2, %2, 3;\n"
        "and.b32 t, w1, 0x80008000;\nlop3.b32 t, w3, 0x01C001C0, t, 0xEA;\n"
        "fma.rn.bf16x2 %1, t, %3, z;\n}"
        : "=r"(lo), "=r"(hi)
        : "r"(w), "r"(s2));
  } else {
    asm("{\n.reg .b32 w2, w6, w12, t, z;\nmov.b32 z, 0x80008000;\n"
        "shf.l.wrap.b32 w2, %2, %2, 2;\nshf.l.wrap.b32 w12, %2, %2, 12;\n"
        "and.b32 t, w2, 0x80008000;\nlop3.b32 t, w12, 0x01C001C0, t, 0xEA;\n"
        "fma.rn.bf16x2 %0, t, %3, z;\n"
        "shf.l.wrap.b32 w6, %2, %2, 6;\n"
        "and.b32 t, w6, 0x81C081C0;\nfma.rn.bf16x2 %1, t, %3, z;\n}"
        : "=r"(lo), "=r"(hi)
        : "r"(w), "r"(s2));
  }
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float div_full(float a, float b) {
  float y;
  asm("div.full.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

// A warp's shared memory: DG slots of a group of 4 units (the codes of its 32 weight rows,
// 128 bytes a row: one line each, copied 16 bytes a lane, four rows a warp instruction),
// the 16-byte chunks of a row at chunk ^ (row & 7) so that the fragments' 8-byte reads
// are conflict-free; then the segment's scales of its rows (64 bytes a row, 80 apart), in
// SB buffers (2 with CROSS: the next item's copied while this one's are read).
template <int DG, int SB = 1>
struct WarpSmem {
  static constexpr int GROUP = RT * 16 * 128;
  static constexpr int SCALES = DG * GROUP;
  static constexpr int SROW = 80;
  static constexpr int SBUF = RT * 16 * SROW;
  static constexpr int BYTES = SCALES + SB * SBUF;
};

__device__ __forceinline__ uint32_t lds_u8(uint32_t a) {
  uint16_t v;
  asm volatile("ld.shared.u8 %0, [%1];" : "=h"(v) : "r"(a));
  return v;
}
__device__ __forceinline__ uint4 ldg_x(const void* p, bool ok) {
  uint4 v = make_uint4(0, 0, 0, 0);
  if (ok)
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// One group's codes (4 units of the warp's 32 rows) into the slot at dst: lane l copies
// chunk l & 7 (16 bytes) of row 4 i + (l >> 3) of each tile's quads i, from cbase[a] (that
// row's chunk at unit 0 of the segment) plus i quads (quad bytes) and g groups.
__device__ __forceinline__ void copy_group(uint32_t dst, const uint8_t* const (&cbase)[2],
                                           size_t quad, int g, int cl, int chunk,
                                           uint64_t pol) {
#pragma unroll
  for (int a = 0; a < RT; ++a)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = 16 * a + 4 * i + cl;
      // RT 2: a base a tile (16 rows in a row); RT 1: a base a half (FC1's gate, up rows)
      const uint8_t* src = RT == 2 ? cbase[a] + i * quad : cbase[i >> 1] + (i & 1) * quad;
      if constexpr (FP4MOE_L2NEXT == 2 && (FP4MOE_DIAG & 2) == 0)
        cp_async16_pol(dst + r * 128 + ((chunk ^ (r & 7)) * 16), src + g * 128, pol);
      else
        cp_async16(dst + r * 128 + ((chunk ^ (r & 7)) * 16), src + g * 128, true);
    }
}

#ifndef FP4MOE_MIN_BLOCKS  // -DFP4MOE_MIN_BLOCKS=2: at most 64 registers a thread
#define FP4MOE_MIN_BLOCKS 1
#endif

// CROSS: a block's ring runs on from one item to the next: the next item's first DG groups
// (and its scales, into the other buffer) are copied as this item's last groups are read,
// so that no item starts with an empty ring (DG dividing 4).
template <bool GATED, int NT, int DG, bool CROSS>
__global__ void __launch_bounds__(512, FP4MOE_MIN_BLOCKS) decode_gemm_kernel(const Params p) {
  static_assert(!CROSS || 4 % DG == 0, "CROSS: the ring's slots divide an item's 4 groups");
  constexpr int SB = CROSS ? 2 : 1;
  using WS = WarpSmem<DG, SB>;
  constexpr int NV = RT * NT * 4;  // fp32 sums a thread
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  // [warps][NV][32] fp32 partials, then each warp's WarpSmem
  float* part = reinterpret_cast<float*>(smem);
  const uint32_t wsm =
      smem_addr(smem) + (uint32_t)(nwarps * NV * 32 * 4 + warp * WS::BYTES);
  const int S = p.segs;
  const int seg = warp % S, rg = warp / S;
  const int R = nwarps / S;
  const int gi = lane >> 2, q = lane & 3;
  constexpr int OUT_W = GATED ? 8 * RT : 16 * RT;  // outputs of a warp (row group)
  const int cta_out = R * OUT_W;
  const int N = p.n, K = p.k;
  const int ntiles = (N + cta_out - 1) / cta_out;
  const int w_rows = GATED ? 2 * N : N;
  const size_t crow = (size_t)K / 2, srow = (size_t)K / 16;

  if (p.pdl) pdl_wait();
  const int nvalid = *p.valid_blocks;
  const int total = ntiles * nvalid;
  const __nv_bfloat16* x = static_cast<const __nv_bfloat16*>(p.x);
  // The next kernel may launch once every thread block has released it: each does so as it
  // starts its last item (at once if it has none), so that the next kernel's blocks take
  // the slots of finished ones instead of waiting beside this kernel's (a release at the
  // start cost 6 us a call at 1 and 16 tokens: docs/perf-notes.md, session 21)
  if (p.pdl && (int)blockIdx.x >= total) pdl_release();
  int local = 0;     // CROSS: the block's items so far (the scales' buffer)
  bool pre = false;  // CROSS: this item's first groups were issued already
  // L2NEXT 2: FC1's own code copies leave L2 first, the prefetched FC2 weights last
  uint64_t pol_first = 0, pol_last = 0;
  if constexpr (FP4MOE_L2NEXT == 2) {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol_first));
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol_last));
  }
#if FP4MOE_L2NEXT
  const bool l2next = GATED && p.nx_codes != nullptr && nvalid <= p.nx_max && threadIdx.x == 0;
#endif
  // weight row of warp row r (0..31) of the item of expert e_ at outputs n0_: tile r / 16,
  // row r % 16 of it
  auto wrow = [&](int e_, int n0_, int r) -> size_t {
#if FP4MOE_RT == 2
    const int a = r >> 4, rr = r & 15;
    return (size_t)e_ * w_rows + (GATED ? a * N + n0_ + rr : n0_ + 16 * a + rr);
#else  // one tile: FC1's rows 0..7 gate, 8..15 up
    const int a = r >> 3, rr = r & 7;
    return (size_t)e_ * w_rows + (GATED ? a * N + n0_ + rr : n0_ + r);
#endif
  };
  // copies: lane l takes chunk l & 7 of row 4 i + (l >> 3) of each tile's quads i
  const int cl = lane >> 3, chunk = lane & 7;
  auto code_bases = [&](int e_, int n0_, const uint8_t* (&cb)[2]) {  // rows 16 a + cl (RT 2)
#pragma unroll
    for (int a = 0; a < 2; ++a)  // or 8 a + cl (RT 1)
      cb[a] = p.codes + wrow(e_, n0_, 8 * RT * a + cl) * crow + (size_t)seg * 512 + chunk * 16;
  };
  // the item's segment of scales into the buffer at offset so: 4 lanes a row, 8 rows an
  // instruction
  auto copy_scales = [&](int e_, int n0_, uint32_t so) {
#pragma unroll
    for (int i = 0; i < 2 * RT; ++i) {
      const int r = 8 * i + (lane >> 2), pc = lane & 3;
      cp_async16(wsm + WS::SCALES + so + r * WS::SROW + pc * 16,
                 p.scales + wrow(e_, n0_, r) * srow + (size_t)seg * 64 + pc * 16, true);
    }
  };

  for (int item = blockIdx.x; item < total; item += gridDim.x) {
    if (p.pdl && item + (int)gridDim.x >= total) pdl_release();
    const int b = item / ntiles, t = item - (item / ntiles) * ntiles;
    const int e = p.block_expert[b];
    const int start = p.block_start[b], end = p.block_end[b];
    const int n0 = t * cta_out + rg * OUT_W;
    const bool active = n0 < N;
#if FP4MOE_L2NEXT
    if (l2next) {  // this tile's share of its expert's FC2 weights (K rows of n / 2 codes)
      const size_t cb = (size_t)K * N / 2, sb = (size_t)K * N / 16;
      const size_t cs = (cb / ntiles + 15) / 16 * 16, ss = (sb / ntiles + 15) / 16 * 16;
      const size_t c0 = (size_t)t * cs, s0 = (size_t)t * ss;
      if (c0 < cb)
        prefetch_l2(p.nx_codes + (size_t)e * cb + c0, (uint32_t)(cb - c0 < cs ? cb - c0 : cs),
                    pol_last);
      if (s0 < sb)
        prefetch_l2(p.nx_scales + (size_t)e * sb + s0, (uint32_t)(sb - s0 < ss ? sb - s0 : ss),
                    pol_last);
    }
#endif
    uint32_t sbo = 0;  // its scales' buffer
    if constexpr (CROSS) sbo = (uint32_t)((local & 1) * WS::SBUF);
    // CROSS: the next item of the block, whose first groups this one issues
    const bool has_next = CROSS && item + (int)gridDim.x < total;
    int e2 = 0, n02 = 0;
    bool act2 = false;
    if (CROSS && has_next) {
      const int it2 = item + (int)gridDim.x;
      const int b2 = it2 / ntiles, t2 = it2 - (it2 / ntiles) * ntiles;
      e2 = p.block_expert[b2];
      n02 = t2 * cta_out + rg * OUT_W;
      act2 = n02 < N;
    }
    auto issue_next = [&](int g2) {  // the next item's group g2 (< DG) into slot g2 % DG
      if (act2) {
        const uint8_t* cb2[2];
        code_bases(e2, n02, cb2);
        copy_group(wsm + (uint32_t)((g2 % DG) * WS::GROUP), cb2, 4 * crow, g2, cl, chunk,
                   pol_first);
        if (g2 == 0)  // its scales into the other buffer
          copy_scales(e2, n02, (uint32_t)(((local + 1) & 1) * WS::SBUF));
      }
      cp_commit();
    };
    float acc[RT][NT][4] = {};

    if (active) {
      const uint8_t* cbase[2];
      code_bases(e, n0, cbase);
      const size_t quad = 4 * crow;
      auto issue = [&](int g) {  // group g (4 units) into slot g % DG; one commit group
        if (g < 4) {
          copy_group(wsm + (uint32_t)((g % DG) * WS::GROUP), cbase, quad, g, cl, chunk,
                     pol_first);
          if (g == 0) copy_scales(e, n0, sbo);  // the segment's scales
        }
        cp_commit();  // (empty past the segment: the waits count groups)
      };
      if (!CROSS || !pre) {
#pragma unroll
        for (int g = 0; g < DG; ++g) issue(g);
      }

      const __nv_bfloat16* xp[NT];
      bool xok[NT];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int m = start + 8 * j + gi;
        xok[j] = m < end;
        int src = m;
        if (p.gather) src = xok[j] ? p.sorted_routes[m] / p.topk : 0;
        xp[j] = x + (size_t)(xok[j] ? src : 0) * K + (size_t)seg * 1024 + q * 16;
      }
      uint4 xv[2][NT][2];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        xv[0][j][0] = ldg_x(xp[j], xok[j]);
        xv[0][j][1] = ldg_x(xp[j] + 8, xok[j]);
      }

#pragma unroll
      for (int u = 0; u < UNITS; ++u) {
        const int g = u >> 2, ug = u & 3;
        if (ug == 0) {
          cp_wait<DG - 1>();  // group g landed (this thread's copies) ...
          __syncwarp();       // ... and every lane's
        }
        if (u + 1 < UNITS) {
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            xv[(u + 1) & 1][j][0] = ldg_x(xp[j] + (u + 1) * 64, xok[j]);
            xv[(u + 1) & 1][j][1] = ldg_x(xp[j] + (u + 1) * 64 + 8, xok[j]);
          }
        }
        const uint32_t slot = wsm + (uint32_t)((g % DG) * WS::GROUP);
        uint2 cw[RT][2];
        uint32_t s2[RT][2];
#pragma unroll
        for (int a = 0; a < RT; ++a)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = 16 * a + 8 * h + gi;  // r & 7 == gi
            const int c = 2 * ug + (q >> 1);
            cw[a][h] = lds64(slot + r * 128 + ((c ^ gi) * 16) + (q & 1) * 8);
            s2[a][h] = scale_pair(
                lds_u8(wsm + WS::SCALES + sbo + r * WS::SROW + 4 * u + q));
          }
        uint32_t xw[NT][8];
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          const uint4 v0 = xv[u & 1][j][0], v1 = xv[u & 1][j][1];
          xw[j][0] = v0.x; xw[j][1] = v0.y; xw[j][2] = v0.z; xw[j][3] = v0.w;
          xw[j][4] = v1.x; xw[j][5] = v1.y; xw[j][6] = v1.z; xw[j][7] = v1.w;
        }
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          uint32_t bf[NT][2];
#pragma unroll
          for (int j = 0; j < NT; ++j) {  // positions 2q, 2q+1 | 2q+8, 2q+9 of step s
            asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(bf[j][0]) : "r"(xw[j][2 * s]), "r"(xw[j][2 * s + 1]));
            asm("prmt.b32 %0, %1, %2, 0x7632;" : "=r"(bf[j][1]) : "r"(xw[j][2 * s]), "r"(xw[j][2 * s + 1]));
          }
#pragma unroll
          for (int a = 0; a < RT; ++a) {
            uint32_t af[4];
            const uint32_t w0 = (s < 2) ? cw[a][0].x : cw[a][0].y;
            const uint32_t w1 = (s < 2) ? cw[a][1].x : cw[a][1].y;
            if constexpr ((FP4MOE_DIAG & 1) != 0) {
              af[0] = w0; af[1] = w1; af[2] = w0; af[3] = w1;
            } else if constexpr (FP4MOE_ROT != 0) {  // the rotated layout's words
              if (s % 2 == 0) {
                decode_rot<false>(w0, s2[a][0], af[0], af[2]);
                decode_rot<false>(w1, s2[a][1], af[1], af[3]);
              } else {
                decode_rot<true>(w0, s2[a][0], af[0], af[2]);
                decode_rot<true>(w1, s2[a][1], af[1], af[3]);
              }
            } else if (s % 2 == 0) {
              decode_pair<0x4140>(w0, s2[a][0], af[0], af[2]);
              decode_pair<0x4140>(w1, s2[a][1], af[1], af[3]);
            } else {
              decode_pair<0x4342>(w0, s2[a][0], af[0], af[2]);
              decode_pair<0x4342>(w1, s2[a][1], af[1], af[3]);
            }
#pragma unroll
            for (int j = 0; j < NT; ++j) mma_bf16(acc[a][j], af, bf[j][0], bf[j][1]);
          }
        }
        if (ug == 3) {
          __syncwarp();  // every lane's reads of the slot done
          if (CROSS && g + DG >= 4) {
            if (has_next)
              issue_next(g + DG - 4);
            else
              cp_commit();
          } else {
            issue(g + DG);
          }
        }
      }
      if (!CROSS || !has_next) cp_wait<0>();
      __syncwarp();  // the scales' slot is rewritten by the next item
    } else if (CROSS && has_next) {  // no rows here: the next item's first groups now
#pragma unroll
      for (int g2 = 0; g2 < DG; ++g2) issue_next(g2);
    }
    if constexpr (CROSS) {
      pre = has_next;
      ++local;
    }

    // the segments' sums of each row group, in order, by its segment-0 warp
    float* mine = part + (size_t)warp * NV * 32 + lane;
#pragma unroll
    for (int a = 0; a < RT; ++a)
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) mine[((a * NT + j) * 4 + c) * 32] = acc[a][j][c];
    __syncthreads();
    if (seg == 0 && active) {
      float tot[RT][NT][4] = {};
      for (int sg = 0; sg < S; ++sg) {
        const float* src = part + (size_t)(rg * S + sg) * NV * 32 + lane;
#pragma unroll
        for (int a = 0; a < RT; ++a)
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 4; ++c)
              tot[a][j][c] = __fadd_rn(tot[a][j][c], src[((a * NT + j) * 4 + c) * 32]);
      }
      // epilogue (gluon_ws._tile_out): element c of (tile a, n8 tile j) is weight row
      // gi + 8 (c >> 1) of the tile, block row 8 j + 2 q + (c & 1)
      float g0, g1 = 0.0f;
      if (GATED) {
        g0 = p.w_global[2 * e];
        g1 = p.w_global[2 * e + 1];
      } else {
        g0 = p.w_global[e];
      }
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int m = start + 8 * j + 2 * q + (c & 1);
          if (m >= end) continue;
          if (GATED && RT == 1 && c >= 2) continue;  // one tile: c + 2 is c's up row
#pragma unroll
          for (int a = 0; a < (GATED ? 1 : RT); ++a) {
            const int nn = n0 + (GATED ? 0 : 16 * a) + gi + (GATED && RT == 1 ? 0 : 8 * (c >> 1));
            float y;
            if (GATED) {
              const float h256 = __fmul_rn(tot[0][j][c], 256.0f);
              const float hg = __fmul_rn(h256, g0);
              const float up = RT == 1 ? tot[0][j][(c & 1) + 2] : tot[RT - 1][j][c];
              const float hu = __fmul_rn(__fmul_rn(up, 256.0f), g1);
              const float nh = __fmaf_rn(-h256, g0, 0.0f);
              const float ex = ex2_approx(__fmul_rn(nh, 1.44269502162933349609f));
              const float sg = div_full(hg, __fadd_rn(ex, 1.0f));
              y = __fmul_rn(hu, sg);
            } else {
              y = __fmul_rn(__fmul_rn(tot[a][j][c], 256.0f), g0);
            }
            const __nv_bfloat16 yb = __float2bfloat16_rn(y);
            if (p.fused) {
              const int route = p.sorted_routes[m];
              const float wt = p.topk_w[route];
              const size_t tok = (size_t)(route / p.topk);
              atomicAdd(static_cast<float*>(p.out) + tok * N + nn,
                        __fmul_rn(__bfloat162float(yb), wt));
            } else {
              static_cast<__nv_bfloat16*>(p.out)[(size_t)m * N + nn] = yb;
            }
          }
        }
    }
    __syncthreads();  // the partials read before the next item's are written
  }
}

template <bool GATED, int NT, int DG, bool CROSS = false>
cudaError_t launch_one(const Params& p, int rows_per_block, int num_blocks, int max_ctas,
                       cudaStream_t stream) {
  auto kern = decode_gemm_kernel<GATED, NT, DG, CROSS>;
  constexpr size_t SMEM_MAX = 227 * 1024;
  auto smem_of = [&](int rpb) {
    return (size_t)(p.segs * rpb) * (RT * NT * 4 * 32 * sizeof(float) + WarpSmem<DG, CROSS ? 2 : 1>::BYTES);
  };
  while (rows_per_block > 1 && smem_of(rows_per_block) > SMEM_MAX) --rows_per_block;
  const size_t smem = smem_of(rows_per_block);
  if (smem > SMEM_MAX) return cudaErrorInvalidConfiguration;
  const int threads = 32 * p.segs * rows_per_block;
  // Per device (a function's attributes are the current device's), asked once each: the
  // specialization's shared-memory limit, its thread blocks an SM by warps a block, the SMs
  constexpr int MAX_DEV = 64;
  static bool attr_set[MAX_DEV] = {};
  static int occ[MAX_DEV][17] = {};
  static int sm_count[MAX_DEV] = {};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < 0 || dev >= MAX_DEV) return cudaErrorInvalidDevice;
  if (!attr_set[dev]) {
    err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM_MAX);
    if (err != cudaSuccess) return err;
    err = cudaDeviceGetAttribute(&sm_count[dev], cudaDevAttrMultiProcessorCount, dev);
    if (err != cudaSuccess) return err;
    attr_set[dev] = true;
  }
  const int key = threads / 32;
  if (occ[dev][key] == 0) {
    int nb = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, kern, threads, smem);
    if (err != cudaSuccess) return err;
    occ[dev][key] = nb > 0 ? nb : 1;
  }
  const int sms = sm_count[dev];
  const int out_w = GATED ? 8 * RT : 16 * RT;
  const int cta_out = out_w * rows_per_block;
  const long long items = (long long)((p.n + cta_out - 1) / cta_out) * num_blocks;
  long long grid = (long long)occ[dev][key] * sms;
  if (max_ctas > 0 && grid > max_ctas) grid = max_ctas;
  if (grid > items) grid = items;
  if (grid < 1) grid = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)grid);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = p.pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kern, p);
}

template <bool GATED, int NT>
cudaError_t launch_depth(const Params& p, int rpb, int nb, int max_ctas, int depth, int cross,
                         cudaStream_t s) {
  if (cross)  // the ring across items: built for the default depth only
    return depth == 2 ? launch_one<GATED, NT, 2, true>(p, rpb, nb, max_ctas, s)
                      : cudaErrorInvalidValue;
  switch (depth) {
    case 1: return launch_one<GATED, NT, 1>(p, rpb, nb, max_ctas, s);
    case 2: return launch_one<GATED, NT, 2>(p, rpb, nb, max_ctas, s);
    case 3: return launch_one<GATED, NT, 3>(p, rpb, nb, max_ctas, s);
    case 4: return launch_one<GATED, NT, 4>(p, rpb, nb, max_ctas, s);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

extern "C" {

// The ABI version: fp4moe/kernels/cuda_decode.py checks it.
int fp4moe_cuda_abi() { return 4; }

// One grouped GEMM. gated: FC1 (SwiGLU, bf16 rows out); else FC2 (bf16 rows, or with
// fused the router-weighted atomic add into fp32 [T, N]). block_m 8 or 16 (the sort's
// rows a block); rows_per_block: row groups (warps of K segments) a thread block;
// depth: groups of 4 units (64 K each) in flight a warp, its ring's slots (1 to 4: 4 is the
// whole segment at once); cross_items: the ring runs on across a block's items (depth 2);
// max_ctas > 0 caps the grid; nx_codes, nx_scales (FC1, may be null): FC2's weights,
// prefetched into L2 where the valid blocks are at most nx_max (a library built with
// FP4MOE_L2NEXT only). Returns a cudaError_t (0: launched).
int fp4moe_decode_gemm(const void* x, const int32_t* sorted_routes, const uint8_t* codes,
                       const uint8_t* scales, const int32_t* block_expert,
                       const int32_t* block_start, const int32_t* block_end,
                       const int32_t* valid_blocks, const float* w_global, const float* topk_w,
                       void* out, int n, int k, int topk, int gated, int gather, int fused,
                       int block_m, int num_blocks, int rows_per_block, int depth,
                       int cross_items, int pdl, int max_ctas, const uint8_t* nx_codes,
                       const uint8_t* nx_scales, int nx_max, void* stream) {
  Params p;
  p.x = x;
  p.sorted_routes = sorted_routes;
  p.codes = codes;
  p.scales = scales;
  p.block_expert = block_expert;
  p.block_start = block_start;
  p.block_end = block_end;
  p.valid_blocks = valid_blocks;
  p.w_global = w_global;
  p.topk_w = topk_w;
  p.out = out;
  p.n = n;
  p.k = k;
  p.topk = topk;
  p.gather = gather;
  p.fused = fused;
  p.pdl = pdl;
  p.segs = k / 1024;
#if FP4MOE_L2NEXT
  p.nx_codes = nx_codes;
  p.nx_scales = nx_scales;
  p.nx_max = nx_max;
#else
  (void)nx_codes;
  (void)nx_scales;
  (void)nx_max;
#endif
  if (k % 1024 || p.segs * rows_per_block > 16 || rows_per_block < 1 ||
      (block_m != 8 && block_m != 16) || n % (gated ? 16 : 32))
    return (int)cudaErrorInvalidValue;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err;
  if (gated)
    err = block_m == 8 ? launch_depth<true, 1>(p, rows_per_block, num_blocks, max_ctas, depth,
                                               cross_items, s)
                       : launch_depth<true, 2>(p, rows_per_block, num_blocks, max_ctas, depth,
                                               cross_items, s);
  else
    err = block_m == 8 ? launch_depth<false, 1>(p, rows_per_block, num_blocks, max_ctas, depth,
                                                cross_items, s)
                       : launch_depth<false, 2>(p, rows_per_block, num_blocks, max_ctas, depth,
                                                cross_items, s);
  return (int)err;
}

const char* fp4moe_cuda_error(int code) { return cudaGetErrorString((cudaError_t)code); }

}  // extern "C"
