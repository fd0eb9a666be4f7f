// attnzero's CPU attention kernel: the online softmax of docs/MATH.md and its backward, in C++
// against ATen, built on first use by attnzero/cpu_kernel.py (torch.utils.cpp_extension) as a
// Python module of three functions: forward, backward, keep_mask.
//
// Letters: B batch, Hq / Hkv query / key-value heads, G = Hq / Hkv, Lq / Lk query / key length,
// D head dim of q and k, Dv head dim of v. bm / bn: query rows / key columns per block.
//
// Layout of the work. A task is one key-value head of one batch and one block of bm query rows:
// the G query heads that read that K/V head are stacked into one block of R = G·bm rows (row
// r = g·ni + ii is query head hkv·G + g, query i0 + ii), so each K/V block is read once for the
// whole group (GQA without copying K/V). The forward runs one parallel region (run_tasks) over
// (batch, kv head, query block); the backward one over (batch, kv head), each task owning its
// dK / dV rows and its query heads' dQ rows (no races). Scores, probabilities and accumulators are
// float32 whatever the input dtype (float32, bfloat16, float16); the products are tiles held in
// vector registers (`product`; MKL's sgemm for tasks of a few rows and in the scalar build), the row
// math at::vec (exp) and fast_math.h (tanh).
//
// What blocks are computed. Per (query block, key block) the kind is SKIP (nothing kept: not
// computed), FULL (everything kept: no masking) or PARTIAL (masked element by element). It is the
// meet of the band of causal / window (computed here, bottom-right aligned: query i sits at
// p = i + Lk - Lq and keeps p - left <= j <= p + right) and, for an az.masks.Mask, of a table the
// Python side fills from the Mask's own structure (`table`, with the PARTIAL tiles evaluated into
// `tiles`). A dense bool mask makes every block PARTIAL and is read through its (broadcast) strides.
// Inside a PARTIAL block the band's right edge crosses (causal's diagonal), the register tiles stop
// at the last key each group of six rows keeps (`by_groups`): about the block's triangle is computed.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/core/CPUAllocator.h>
#include <omp.h>
#include <torch/extension.h>

#include "fast_math.h"  // azm::tanh: float32, vectorised by the compiler (softcap)

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

extern "C" {
// MKL's sgemm (column-major, LP64), exported by libtorch_cpu; the same routine at::mm calls. Inside
// the kernel's parallel region it runs on the calling thread (OneMklThread).
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
int MKL_Set_Num_Threads_Local(int nt);  // MKL's C entry (the lowercase name is the Fortran one)
}

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t UNBOUNDED = std::numeric_limits<int64_t>::min();  // ops.UNBOUNDED: a side without a bound

// C (m×n, row-major, ldc) = alpha · op(A) · op(B) + beta · C, with op(A) m×k and op(B) k×n, all
// row-major: the column-major sgemm computes Cᵀ = op(B)ᵀ · op(A)ᵀ on the same memory.
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  if (k == 0) {  // nothing to multiply: C = beta · C
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) C[i * ldc + j] = beta == 0.f ? 0.f : beta * C[i * ldc + j];
    return;
  }
  sgemm_(tb ? "T" : "N", ta ? "T" : "N", &M, &N, &K, &alpha, B, &la, A, &lb, &beta, C, &lc);
}

// Products without sgemm's copies. sgemm packs both operands into a layout of its own on every call:
// in the causal forward at L = 2048 those copies took a sixth of the time (perf). Here a product
// C = α·A·B is computed a tile of C at a time, reading A one element at a time (broadcast to a
// vector, any strides: Aᵀ costs nothing) and B one row of the tile at a time (rows of unit stride).
// So P V, dO, Q, K, dS and their transposes are read where they are; only a right operand that is
// a transpose (Kᵀ in S = Q Kᵀ, Vᵀ in dP = dO Vᵀ) is copied, into `panels`, once per head or key
// block instead of once per product. Where at::vec has no vector registers (its scalar fallback),
// sgemm stays.
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool TILED = true;
#else
constexpr bool TILED = false;
#endif
constexpr int64_t W = Vec::size();  // floats per vector: 16 (AVX-512), 8 (AVX2)
constexpr int MR = W == 16 ? 6 : 4;  // a tile is MR rows × NV vectors of C, held in registers
constexpr int NV = W == 16 ? 4 : 3;  // (AVX-512: 24 of the 32; AVX2: 12 of the 16)
constexpr int64_t PANEL = NV * W;    // columns per tile, and rows per panel: 64 / 24

// C (m × n, ldc) = alpha · A (m × K) · B (K × n, ldb), or C += that when `add`. A_rk is at
// A[r·ar + k·ak] (A as stored: ar = lda, ak = 1; Aᵀ: ar = 1, ak = lda).
struct Product {
  int64_t m, n, K;
  const float* A;
  int64_t ar, ak;
  const float* B;
  int64_t ldb;
  float* C;
  int64_t ldc;
  float alpha;
  bool add;
};

// The first n (< W) floats at p, zeros after them.
inline Vec load_part(const float* p, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
#else
  return Vec::loadu(p, n);
#endif
}

// One tile of x: rows [i, i + M), columns [j, j + (N − 1)·W + last), 0 < last <= W (FULL: last = W).
// C_rc = alpha · Σ_k A_rk B_kc, the M × N vectors of sums kept in registers over the whole k loop.
// A narrow last vector (not FULL) is read whole from B's rows but the last: what lies past a row's
// end is the next row's memory when rows are at least a vector apart, and its lanes are never
// stored. (Masked loads inside the k loop made GCC 12 store every sum to the stack on every k: the
// 5-key edge of S = Q Kᵀ at L = 197 ran at half speed.) Only the last rows, whose whole vector would
// reach past the last row's end, are read masked: one row when rows are a vector apart or more,
// ⌈(W − last) / ldb⌉ when they are closer (a head dim below 16 in P V).
// Every loop over r and v is unrolled (`GCC unroll`): one left rolled kept the sums in an array on
// the stack, written before the k loop and read back after it (the causal forward at L = 2048 ran
// 5 % slower).
template <int M, int N, bool FULL>
void tile(const Product& x, int64_t i, int64_t j, int64_t last) {
  const int64_t ar = x.ar, ak = x.ak, ldb = x.ldb;
  const float* a = x.A + i * ar;  // A_rk at a[r·ar]: a moves on by ak per k
  const float* bk = x.B + j;      // B_k·, the tile's columns: moves on by ldb per k
  const int64_t masked = FULL ? 0 : std::min<int64_t>(x.K, (W - last + ldb - 1) / ldb);  // B's last rows, read masked
  Vec c[M][N];
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < N; ++v) c[r][v] = Vec(0.f);
  const auto step = [&](bool masked_row) {  // c_r· += A_rk B_k·, then on to k + 1
    Vec b[N];
#pragma GCC unroll 8
    for (int v = 0; v < N; ++v) b[v] = masked_row && v + 1 == N ? load_part(bk + v * W, last) : Vec::loadu(bk + v * W);
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r) {
      const Vec a_rk(a[r * ar]);  // A_rk in every lane
#pragma GCC unroll 8
      for (int v = 0; v < N; ++v) c[r][v] = at::vec::fmadd(a_rk, b[v], c[r][v]);
    }
    a += ak, bk += ldb;
  };
  for (int64_t n = x.K - masked; n > 0; --n) step(false);  // B's rows read whole, then
  for (int64_t n = masked; n > 0; --n) step(true);          // its last `masked` rows, read masked
  if (x.alpha != 1.f) {
    const Vec alpha(x.alpha);
#pragma GCC unroll 8
    for (int r = 0; r < M; ++r)
#pragma GCC unroll 8
      for (int v = 0; v < N; ++v) c[r][v] = c[r][v] * alpha;
  }
#pragma GCC unroll 8
  for (int r = 0; r < M; ++r)
#pragma GCC unroll 8
    for (int v = 0; v < N; ++v) {
      float* cr = x.C + (i + r) * x.ldc + j + v * W;
      const int64_t n = FULL || v + 1 < N ? W : last;
      (x.add ? c[r][v] + Vec::loadu(cr, n) : c[r][v]).store(cr, n);
    }
}

// tile<M, N> for M = m rows (1..MR) and N = nv vectors (1..NV), chosen at run time.
template <int M, int N = 1>
void tile_cols(const Product& x, int64_t i, int64_t j, int64_t nv, int64_t last) {
  if constexpr (N < NV)
    if (nv > N) return tile_cols<M, N + 1>(x, i, j, nv, last);
  if (last == W)
    tile<M, N, true>(x, i, j, last);
  else
    tile<M, N, false>(x, i, j, last);
}
template <int M = 1>
void tile_rows(const Product& x, int64_t i, int64_t j, int64_t m, int64_t nv, int64_t last) {
  if constexpr (M < MR)
    if (m > M) return tile_rows<M + 1>(x, i, j, m, nv, last);
  tile_cols<M>(x, i, j, nv, last);
}

// Terms of the sum over k per pass of a tile: C takes a partial sum every KC terms. One chain of 512
// float32 terms (D = 512) was up to 3× farther from the float64 golden than sgemm's blocked sums
// (30 seeds; passes of 256: still 3×; of 64: 1.4×), for no time measurable at D = 64.
constexpr int64_t KC = 64;

// The whole product, column tiles outside and row tiles inside (a tile's K × PANEL piece of B is
// read from cache by every row tile), in passes of KC terms of the sum.
void product(const Product& x) {
  if (x.m <= 0 || x.n <= 0) return;
  int64_t k0 = 0;
  do {  // (at least one pass: K = 0 still writes C = 0, or leaves C when adding)
    Product part = x;
    part.K = std::min(KC, x.K - k0);
    part.A = x.A + k0 * x.ak, part.B = x.B + k0 * x.ldb;
    part.add = x.add || k0 > 0;  // the passes after the first add to it
    for (int64_t j = 0; j < x.n; j += PANEL) {
      const int64_t w = std::min(PANEL, x.n - j), nv = (w + W - 1) / W, last = w - (nv - 1) * W;
      for (int64_t i = 0; i < x.m; i += MR) tile_rows(part, i, j, std::min<int64_t>(MR, x.m - i), nv, last);
    }
    k0 += KC;
  } while (k0 < x.K);
}

// Rows [j0, j0 + n) (n <= PANEL) of X (any dtype, strides sj, sd; D columns) transposed into one
// panel: `panel` is D × PANEL row-major, panel_dc = X_{j0+c, d}.
template <typename T>
void to_panel(float* panel, const T* X, int64_t j0, int64_t n, int64_t D, int64_t sj, int64_t sd) {
  if constexpr (std::is_same_v<T, float>) {
    if (sd == 1) {  // at::vec's transpose: 16 × 16 blocks in registers (AVX-512)
      at::vec::transpose_mxn<float>(X + j0 * sj, sj, panel, PANEL, static_cast<int>(n), static_cast<int>(D));
      return;
    }
  }
  for (int64_t c = 0; c < n; ++c) {
    const T* row = X + (j0 + c) * sj;
    for (int64_t d = 0; d < D; ++d) panel[d * PANEL + c] = static_cast<float>(row[d * sd]);
  }
}

// C (m × nc, ldc) = alpha · A (m × D, lda) · Xᵀ for rows [c0, c0 + nc) of X, whose transpose is in
// `panels` (panel p: rows [p·PANEL, p·PANEL + PANEL) as to_panel lays them out): a product per panel.
void product_t(int64_t m, int64_t c0, int64_t nc, int64_t D, const float* A, int64_t lda, const float* panels,
               float* C, int64_t ldc, float alpha) {
  for (int64_t col = c0; col < c0 + nc;) {
    const int64_t p = col / PANEL, end = std::min(c0 + nc, (p + 1) * PANEL);
    const float* xt = panels + p * PANEL * D + (col - p * PANEL);
    product({m, end - col, D, A, lda, 1, xt, PANEL, C + (col - c0), ldc, alpha, false});
    col = end;
  }
}

// dropout.py's counter-based hash, bit for bit: lowbias32 applied to the low then the high 32 bits
// of counter = ((b·Hq + h)·Lq + i)·Lk + j, each xor-ed with the seed's half; kept iff x >= threshold.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

inline bool dropout_kept(uint64_t counter, uint64_t seed, uint64_t threshold) {
  uint32_t x = static_cast<uint32_t>(counter) ^ static_cast<uint32_t>(seed);
  x = mix32(x);
  x ^= static_cast<uint32_t>((counter >> 32) ^ (seed >> 32));
  x = mix32(x);
  return static_cast<uint64_t>(x) >= threshold;
}

// MKL on one thread inside each task (the parallelism is the tasks'), restored afterwards: MKL
// would otherwise start threads of its own in every product. Only where the tasks call sgemm (not
// `tiled`): the register tiles never call MKL, and need not touch its settings.
struct OneMklThread {
  int before = -1;
  explicit OneMklThread(bool needed) {
    if (needed) before = MKL_Set_Num_Threads_Local(1);
  }
  ~OneMklThread() {
    if (before >= 0) MKL_Set_Num_Threads_Local(before);
  }
};

enum Kind : int { SKIP = 0, FULL = 1, PARTIAL = 2 };

// A score_mod as C++ generated from the user's Python function (attnzero/cpu_mods.py), built into a
// library of its own and handed over as two function pointers, for one row's keys [j0, j0 + n) of
// query i in batch b, query head h. ModFwd: s_j = score_mod(s_j, b, h, i, j0 + j) in place. ModBwd:
// g_j = g_j · ∂score_mod/∂score at the input x_j, and each captured tensor's share g_j · ∂score_mod/∂θ
// added into `grad` (this thread's copy, float64: it sums over every pair); `tmp` is scratch.
// `cap`: the captured tensors' data. ModFwd returns non-zero where an index into one was out of
// range (it read 0 there; the call then raises IndexError, as torch's indexing would).
using ModFwd = int32_t (*)(float* s, int64_t n, int64_t b, int64_t h, int64_t i, int64_t j0,
                           const void* const* cap);
using ModBwd = void (*)(const float* x, float* g, int64_t n, int64_t b, int64_t h, int64_t i, int64_t j0,
                        const void* const* cap, double* grad, float* tmp);

// One (query block, key block) pair as a task computes it: query rows [i0, i0 + ni) and key columns
// [j0, j0 + nc), the columns trimmed to those the band can keep in some row of the block (a causal
// diagonal block computes no column past its last row's position). jj0: j0's column in the block's
// evaluated tile. kind: what the columns need (FULL: nothing masked; PARTIAL: masked per row).
struct Block {
  int64_t i0, ni, j0, nc, jj0;
  Kind kind;
  int64_t tile;  // the Mask's evaluated tile (-1: none)
};

// Everything a task reads besides its own scratch: sizes, the score options and the inputs' strides.
struct Problem {
  int64_t B, Hq, Hkv, G, Lq, Lk, D, Dv, bm, bn, nqb, nkb;
  int64_t left, right;  // the band p - left <= j <= p + right; UNBOUNDED = no bound on that side
  float scale, cap;     // cap 0: no softcap
  bool dropout;
  uint64_t seed, threshold;
  float keep_scale;  // 1 / (1 - dropout_p)
  const uint8_t* mask = nullptr;  // dense bool mask, strides ms (0 where it broadcasts)
  int64_t ms[4] = {0, 0, 0, 0};
  const float* bias = nullptr;  // float32 bias, strides bs (0 where it broadcasts)
  int64_t bs[4] = {0, 0, 0, 0};
  at::Tensor bias_values;  // what `bias` points into, alive with the problem (a negative view's copy)
  const int32_t* table = nullptr;  // (tb, nqb, nkb): 0 SKIP, 1 FULL, 2 + t PARTIAL with tile t
  int64_t tb = 1;
  const uint8_t* tiles = nullptr;  // (n, tiles_b, tiles_h, bm, bn) bool
  int64_t tiles_b = 1, tiles_h = 1;
  ModFwd mod_fwd = nullptr;  // a generated score_mod (nullptr: none)
  ModBwd mod_bwd = nullptr;
  std::atomic<int32_t>* mod_oob = nullptr;  // set when the forward's mod read out of range
  const void* const* caps = nullptr;  // what the mod reads
  double* mod_grad = nullptr;         // its captured tensors' gradients, one flat copy per thread
  int64_t mod_grad_stride = 0, mod_tmp = 0;  // doubles per copy; scratch floats per key for ModBwd

  // The band's kind on query rows [i0, i1) × key columns [j0, j1) (geometry.classify): d = j - p
  // spans [j0 - p_last, j1 - 1 - p_first] on the block.
  Kind band_kind(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    if (left == UNBOUNDED && right == UNBOUNDED) return FULL;
    const int64_t off = Lk - Lq;
    const int64_t d_min = j0 - (i1 - 1 + off), d_max = (j1 - 1) - (i0 + off);
    const bool has_lo = left != UNBOUNDED, has_hi = right != UNBOUNDED;
    if ((has_lo && d_max < -left) || (has_hi && d_min > right) || (has_lo && has_hi && right < -left)) return SKIP;
    if ((!has_lo || d_min >= -left) && (!has_hi || d_max <= right)) return FULL;
    return PARTIAL;
  }

  // The keys [lo, hi) of [j0, j0 + n) that the band keeps for a query at position p (clamped to the
  // range; hi <= lo: none).
  void band_cols(int64_t p, int64_t j0, int64_t n, int64_t* lo, int64_t* hi) const {
    *lo = left == UNBOUNDED ? 0 : std::clamp<int64_t>(p - left - j0, 0, n);
    *hi = right == UNBOUNDED ? n : std::clamp<int64_t>(p + right + 1 - j0, 0, n);
  }

  // Whether the register tiles trim a block — PARTIAL, the band's right edge bounding it (causal's
  // diagonal) — and then the columns each group of MR stacked rows needs: out[r / MR] = the most any
  // of its rows keeps, counted from the block's first column (rows r = g·ni + ii, ii < ni, of the
  // query heads g stacked). A causal diagonal block then computes about its triangle, not its square:
  // the columns past a group's reach are blocked in all its rows.
  bool reach(const Block& blk, int64_t R, int64_t ni, int64_t* out) const {
    if (!tiled() || blk.kind != PARTIAL || right == UNBOUNDED) return false;
    for (int64_t r0 = 0; r0 < R; r0 += MR) {
      int64_t most = 0;
      for (int64_t r = r0; r < std::min(R, r0 + MR); ++r) {
        int64_t lo, hi;
        band_cols(blk.i0 + r % ni + Lk - Lq, blk.j0, blk.nc, &lo, &hi);
        most = std::max(most, hi);
      }
      out[r0 / MR] = most;
    }
    return true;
  }

  // Query block ib × key block jb of batch b (rows ni, columns nc): false when nothing in it is kept
  // (SKIP: not computed). Its kind is the meet of the band (on the trimmed columns), the Mask's
  // table and a dense mask.
  bool block(int64_t b, int64_t ib, int64_t jb, int64_t ni, int64_t nc, Block* blk) const {
    const int64_t i0 = ib * bm, jstart = jb * bn, off = Lk - Lq;
    if (band_kind(i0, i0 + ni, jstart, jstart + nc) == SKIP) return false;
    int64_t c0, c1, unused;  // the columns kept by the first row's band start, the last row's end
    band_cols(i0 + off, jstart, nc, &c0, &unused);
    band_cols(i0 + ni - 1 + off, jstart, nc, &unused, &c1);
    if (c1 <= c0) return false;
    *blk = Block{i0, ni, jstart + c0, c1 - c0, c0, band_kind(i0, i0 + ni, jstart + c0, jstart + c1), -1};
    if (table != nullptr) {
      const int32_t t = table[((tb > 1 ? b : 0) * nqb + ib) * nkb + jb];
      if (t == 0) return false;
      if (t >= 2) {
        blk->tile = t - 2;
        blk->kind = PARTIAL;
      }
    }
    if (mask != nullptr) blk->kind = PARTIAL;
    return true;
  }

  // Whether (b, h, i, j) is kept by the dense mask and the block's tile (the band aside).
  bool kept(int64_t b, int64_t h, int64_t i, int64_t j, int64_t tile, int64_t ii, int64_t jj) const {
    if (mask != nullptr && !mask[b * ms[0] + h * ms[1] + i * ms[2] + j * ms[3]]) return false;
    if (tile >= 0) {
      const int64_t at = ((tile * tiles_b + (tiles_b > 1 ? b : 0)) * tiles_h + (tiles_h > 1 ? h : 0)) * bm + ii;
      if (!tiles[at * bn + jj]) return false;
    }
    return true;
  }

  // The scores of row ii of a block, in place: x = q_i · k_j (from the matmul) becomes
  // s_ij = scale · x, through the score_mod, capped (softcap · tanh(s / softcap)), plus the bias b_ij,
  // and −inf where blocked (PARTIAL blocks only). `t` (may be null): tanh of the capped scores, for
  // the backward; `x` (may be null): the score_mod's input scale · x_ij, for the backward.
  void scores(float* s, float* t, float* x, const Block& blk, int64_t b, int64_t h, int64_t ii) const {
    const int64_t n = blk.nc, step = Vec::size(), i = blk.i0 + ii, j0 = blk.j0;
    int64_t j = 0;
    float scl = scale;  // what still multiplies s below: scale, or 1 once the score_mod has it
    if (mod_fwd != nullptr) {  // s_ij = score_mod(scale · x_ij, b, h, i, j)
      const Vec f(scale);
      for (; j + step <= n; j += step) (Vec::loadu(s + j) * f).store(s + j);
      for (; j < n; ++j) s[j] *= scale;
      if (x != nullptr) std::copy(s, s + n, x);
      if (mod_fwd(s, n, b, h, i, j0, caps) != 0 && mod_oob != nullptr) mod_oob->store(1, std::memory_order_relaxed);
      scl = 1.f;
      j = 0;
    }
    if (cap > 0.f) {  // s = cap · tanh(scl · x / cap); the tanh kept in t for d(cap · tanh)/dx = 1 − t²
      const float f = scl / cap, c = cap;
      if (t != nullptr) {
#pragma omp simd
        for (int64_t jj = 0; jj < n; ++jj) {
          const float th = azm::tanh(s[jj] * f);
          t[jj] = th;
          s[jj] = c * th;
        }
      } else {
#pragma omp simd
        for (int64_t jj = 0; jj < n; ++jj) s[jj] = c * azm::tanh(s[jj] * f);
      }
    } else if (scl != 1.f) {
      const Vec f(scl);
      for (; j + step <= n; j += step) (Vec::loadu(s + j) * f).store(s + j);
      for (; j < n; ++j) s[j] *= scl;
    }
    if (bias != nullptr) {  // s_ij += b_ij
      const float* br = bias + b * bs[0] + h * bs[1] + i * bs[2] + j0 * bs[3];
      if (bs[3] == 1) {
        for (j = 0; j + step <= n; j += step) (Vec::loadu(s + j) + Vec::loadu(br + j)).store(s + j);
        for (; j < n; ++j) s[j] += br[j];
      } else {
        for (j = 0; j < n; ++j) s[j] += br[j * bs[3]];
      }
    }
    if (blk.kind == PARTIAL) {  // s_ij = −inf where the pair is blocked: outside the band's [lo, hi), then by the masks
      int64_t lo, hi;
      band_cols(i + Lk - Lq, j0, n, &lo, &hi);
      hi = std::max(hi, lo);
      std::fill(s, s + lo, NEG_INF);
      std::fill(s + hi, s + n, NEG_INF);
      if (mask != nullptr || blk.tile >= 0)
        for (j = lo; j < hi; ++j)
          if (!kept(b, h, i, j0 + j, blk.tile, ii, blk.jj0 + j)) s[j] = NEG_INF;
    }
  }

  // Whether the tasks multiply with the register tiles: rows enough to pay for transposing K (a
  // decode step's few rows do not), and a build with vector registers; sgemm otherwise.
  bool tiled() const { return TILED && G * bm >= 16; }

  // Whether a block's scores are just scale · x (no cap, no bias, nothing masked): then the scale
  // rides in the max and the exp (max_j scale·x_ij = scale · max_j x_ij for scale > 0) and the
  // scores are never written out.
  bool plain(Kind k) const {
    return k == FULL && cap == 0.f && bias == nullptr && mod_fwd == nullptr && scale > 0.f;
  }

  // Z / (1 − dropout_p) of one row of a block: multiplies p in place (0 where dropped).
  void drop(float* p, int64_t nc, int64_t b, int64_t h, int64_t i, int64_t j0) const {
    const uint64_t start = static_cast<uint64_t>(((b * Hq + h) * Lq + i) * Lk + j0);
    for (int64_t j = 0; j < nc; ++j) p[j] = dropout_kept(start + j, seed, threshold) ? p[j] * keep_scale : 0.f;
  }
};

// v as computed, in a register the compiler may not fuse into the next operation (gcc makes
// x · y − z one fused multiply-add, which skips rounding x · y). The scalar build has no fma.
inline Vec rounded(Vec v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r = v;
  asm("" : "+v"(r));
  return r;
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 r = v;
  asm("" : "+x"(r));
  return r;
#else
  return v;
#endif
}

// Σ of a vector's lanes.
inline float sum_lanes(const Vec& v) {
  float lanes[Vec::size()];
  v.store(lanes);
  return std::accumulate(lanes, lanes + Vec::size(), 0.f);
}

// max(a, b) in every lane, b where either is NaN (AVX-512 and AVX2: one instruction, where
// at::vec::maximum spends a second on giving NaN; the scalar build's at::vec::maximum gives NaN). The
// row max may pass over a NaN score: its exp makes the row sum l NaN, and with it the row's O and lse.
inline Vec max_lanes(const Vec& a, const Vec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_max_ps(a, b);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_max_ps(a, b);
#else
  return at::vec::maximum(a, b);
#endif
}

float row_max(const float* x, int64_t n) {
  const int64_t step = Vec::size();
  int64_t j = 0;
  Vec mv(NEG_INF);
  for (; j + step <= n; j += step) mv = max_lanes(Vec::loadu(x + j), mv);
  float lanes[Vec::size()];
  mv.store(lanes);
  float m = *std::max_element(lanes, lanes + Vec::size());
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// e^x in every lane, as inline AVX-512 (MATH.md's p_ij = exp(s_ij − m_i)): e^x = 2^t with t = x · log2 e
// = n + f (n the nearest integer, |f| <= 1/2; the product's rounding error and log2 e's low part go
// into f), 2^f by fast_math.h's degree-6 polynomial, 2^n by vscalefps, which also rounds a subnormal
// result once and gives 0 below 2^-150 and inf above 2^128. x is clamped below at −110 first (e^−110
// is 0 in float32; −inf gives 0, NaN stays NaN). Not above: any finite x past 88.72 gives inf, and so
// does +inf, whose f = inf − inf is NaN but vscalefps(NaN, +inf) = +inf (the instruction's table of
// special cases) — bit for bit the results of a clamp at 100, over every float32 x.
// Within 1 ulp of e^x (at::vec's exp_u20, which torch's CPU flash attention uses: ~3 ulp, and 20 %
// slower per element on the EPYC VM). Without AVX-512: exp_u20, NaN kept NaN.
inline Vec exp_vec(Vec v) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 x = _mm512_max_ps(_mm512_set1_ps(-110.f), v);  // (NaN: the 2nd operand)
  const __m512 log2e = _mm512_set1_ps(1.44269502f);
  const __m512 t = _mm512_mul_ps(x, log2e);
  const __m512 lo = _mm512_fmadd_ps(x, _mm512_set1_ps(1.925963e-8f), _mm512_fmsub_ps(x, log2e, t));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_add_ps(_mm512_sub_ps(t, n), lo);
  __m512 p = _mm512_set1_ps(1.5353362e-4f);  // azm::pow2_reduced's coefficients, 2^f for |f| <= 1/2
  for (const float c : {1.3398874e-3f, 9.6184375e-3f, 5.5503324e-2f, 2.4022648e-1f, 6.9314720e-1f, 1.f})
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);  // p · 2^n
#else
  return Vec::blendv(v.exp_u20(), v, v.isnan());  // (exp_u20 of a NaN is not NaN)
#endif
}

// x_j = exp(f · x_j − shift) in place, returning Σ_j x_j (f = 1 on finished scores; f = scale on a
// raw product q_i · k_j, the scale folded into the exp's argument instead of a pass of its own).
// f · x_j is rounded before the shift is taken off (`rounded`), as the row max (the shift) was taken
// of rounded products: the fused multiply-add gcc made of them kept the exact product, and at
// |s| ~ 1e8 its difference from the rounded max (half a unit in the last place of s) put exp's
// argument tens above 0 (1e10: inf, NaN).
// The exp is `exp_vec` above.
float exp_sum(float* x, int64_t n, float f, float shift) {
  const int64_t step = Vec::size();
  int64_t j = 0;
  const Vec fv(f), sv(shift);
  Vec acc(0.f);
  for (; j + step <= n; j += step) {
    Vec e = exp_vec(rounded(Vec::loadu(x + j) * fv) - sv);
    e.store(x + j);
    acc = acc + e;
  }
  if (j < n) {  // the last n − j < step entries (5 of ViT's 197 keys): one masked vector, not scalar exps
    const int64_t rest = n - j;
    const Vec e = exp_vec(rounded(Vec::loadu(x + j, rest) * fv) - sv);
    e.store(x + j, rest);
    acc = acc + Vec::set(Vec(0.f), e, rest);  // the lanes past n add nothing
  }
  return sum_lanes(acc);
}

// Σ_d a_d · b_d for n floats a and n entries of b (any dtype, stride sb).
template <typename T>
float dot(const float* a, const T* b, int64_t n, int64_t sb) {
  float sum = 0.f;
  int64_t d = 0;
  if constexpr (std::is_same_v<T, float>) {
    if (sb == 1) {
      Vec acc(0.f);
      for (; d + W <= n; d += W) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
      sum = sum_lanes(acc);
    }
  }
  for (; d < n; ++d) sum += a[d] * static_cast<float>(b[d * sb]);
  return sum;
}

// rows × cols of a (possibly strided, any-dtype) matrix into dense float32 (ld = cols).
template <typename T>
void load_rows(float* dst, const T* src, int64_t rows, int64_t cols, int64_t row_stride, int64_t col_stride) {
  if (col_stride == 1) {  // rows of unit stride (the usual case, permuted views included): a loop the compiler vectorises
    for (int64_t r = 0; r < rows; ++r) {
      const T* from = src + r * row_stride;
      float* to = dst + r * cols;
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(to, from, sizeof(float) * cols);
      } else {
        for (int64_t c = 0; c < cols; ++c) to[c] = static_cast<float>(from[c]);
      }
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = static_cast<float>(src[r * row_stride + c * col_stride]);
}

// A block of K or V rows [j0, j0 + nc) as float32 (ld returned): the tensor itself for float32,
// else converted into `buf`.
template <typename T>
const float* kv_block(const at::Tensor& x, int64_t b, int64_t h, int64_t j0, int64_t nc, float* buf, int64_t* ld) {
  const T* base = x.data_ptr<T>() + b * x.stride(0) + h * x.stride(1) + j0 * x.stride(2);
  if constexpr (std::is_same_v<T, float>) {
    *ld = x.stride(2);
    return base;
  } else {
    load_rows(buf, base, nc, x.size(3), x.stride(2), x.stride(3));
    *ld = x.size(3);
    return buf;
  }
}

// K or V as the kernel reads them: rows of unit stride, at least a row apart (the float32 path hands
// them to sgemm as they are, whose leading dimension must be at least a row). A copy with fresh
// strides otherwise: `contiguous()` keeps a tensor that torch calls contiguous as it is, and with one
// key (Lk = 1) torch ignores that dimension's stride — (B, H, D, 1).transpose(2, 3) has stride 1
// there, and sgemm refused it, leaving the output unwritten.
at::Tensor unit_rows(const at::Tensor& x) {
  return x.stride(3) == 1 && x.stride(2) >= x.size(3) ? x : x.clone(at::MemoryFormat::Contiguous);
}

// x with its values in memory: a view with torch's negative bit (torch._neg_view, z.conj().imag)
// shares the storage of its negation, which the loops below read directly.
at::Tensor values(const at::Tensor& x) { return x.is_neg() ? x.resolve_neg() : x; }

// Whether the register tiles read x's rows (q, or dO) where they lie, at their row stride: float32
// rows of unit stride, one query head per group (so a task's rows are one head's, evenly spaced),
// rows apart (a row stride of 0 — one query expanded over L, or dO of out.sum(dim=2) — is a B of
// the backward's products whose tile divides by it). Else a task copies them, the group's heads
// stacked, into dense float32.
template <typename T>
bool rows_in_place(const Problem& P, const at::Tensor& x) {
  return std::is_same_v<T, float> && P.tiled() && P.G == 1 && x.stride(3) == 1 && x.stride(2) > 0;
}

// Kᵀ of one head in panels (to_panel), the B of S = Q Kᵀ in the forward. A thread keeps the panels
// of the head it works on and transposes a panel the first time one of its blocks needs it, so K is
// transposed about once per head and thread (sgemm packed it once per query block and key block).
// `data` is n_panels · PANEL · D floats of the thread's work memory (run_tasks).
struct KPanels {
  float* data = nullptr;
  std::vector<uint8_t> ready;  // panel p transposed yet, for `head` (b·Hkv + hkv)
  int64_t head = -1;

  explicit KPanels(int64_t n_panels) : ready(n_panels, 0) {}
  void start(int64_t h) {
    if (h == head) return;
    head = h;
    std::fill(ready.begin(), ready.end(), 0);
  }

  // S (m × nc, lds) = Q (m × D, ldq) · Kᵀ for keys [j0, j0 + nc) of the head whose K starts at `k`
  // (strides sj, sd; Lk keys), transposing the panels those keys need first.
  template <typename T>
  void scores(int64_t m, int64_t j0, int64_t nc, const float* Q, int64_t ldq, float* S, int64_t lds, const T* k,
              int64_t Lk, int64_t D, int64_t sj, int64_t sd) {
    for (int64_t p = j0 / PANEL; p * PANEL < j0 + nc; ++p)
      if (!ready[p]) {
        to_panel(data + p * PANEL * D, k, p * PANEL, std::min(PANEL, Lk - p * PANEL), D, sj, sd);
        ready[p] = 1;
      }
    product_t(m, j0, nc, D, Q, ldq, data, S, lds, 1.f);
  }
};

// A new (B, H, L, E) tensor laid out in x's memory order, as torch's CPU attention gives its
// gradients: x laid out (B, L, H, ·) — one projection split into heads — gives (B, L, H, E), so that
// the projection's gradient from dQ, dK, dV needs no transposing copy; else (B, H, L, E).
at::Tensor empty_in_order_of(const at::Tensor& x, int64_t E, at::ScalarType dtype) {
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2);
  const auto options = x.options().dtype(dtype);
  return x.stride(1) < x.stride(2) && H > 1 ? at::empty({B, L, H, E}, options).transpose(1, 2)
                                            : at::empty({B, H, L, E}, options);
}
at::Tensor empty_in_order_of(const at::Tensor& x, int64_t E) { return empty_in_order_of(x, E, x.scalar_type()); }

// The output (B, Hq, Lq, Dv) in the memory order torch's SDPA gives it on CPU, which code after it
// may rely on (`out.permute(2, 0, 1, 3).view(L·B, H·D)` after a sequence-first projection): where
// torch's flash kernel runs — no dropout, Dv = D, rows of q, k, v of unit stride — torch.empty_like(q)
// (q's strides when it is dense, else dense in q's order: (B, L, H, D) for q, k, v split from one
// projection, whose `out.transpose(1, 2).reshape(B, L, H·D)` is then a view); elsewhere (torch's math
// path) contiguous.
at::Tensor empty_output(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::ScalarType dtype,
                        bool dropout) {
  const auto unit = [](const at::Tensor& x) { return x.stride(3) == 1; };  // (torch asks it of a head dim of 1 too)
  const int64_t Dv = v.size(3);
  const auto options = q.options().dtype(dtype);
  if (!q.is_contiguous() && !dropout && Dv == q.size(3) && unit(q) && unit(k) && unit(v))
    return at::empty_like(q, options);
  return at::empty({q.size(0), q.size(1), q.size(2), Dv}, options);  // (a contiguous q: empty_like's layout)
}

Problem make_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& bias,
                     const std::optional<at::Tensor>& table, const std::optional<at::Tensor>& tiles, int64_t left,
                     int64_t right, double scale, double softcap, double dropout_p, int64_t seed, int64_t block_q,
                     int64_t block_k) {
  Problem P;
  P.B = q.size(0), P.Hq = q.size(1), P.Lq = q.size(2), P.D = q.size(3);
  P.Hkv = k.size(1), P.Lk = k.size(2), P.Dv = v.size(3);
  P.G = P.Hq / P.Hkv;
  P.bm = std::max<int64_t>(1, std::min(block_q, P.Lq));
  P.bn = std::max<int64_t>(1, block_k);
  P.nqb = (P.Lq + P.bm - 1) / P.bm, P.nkb = (P.Lk + P.bn - 1) / P.bn;
  // A bound beyond Lq + Lk acts as that bound (keeps every key, or none): clamped so the band's
  // arithmetic cannot overflow.
  const int64_t far = P.Lq + P.Lk + 1;
  P.left = left == UNBOUNDED ? UNBOUNDED : std::clamp<int64_t>(left, -far, far);
  P.right = right == UNBOUNDED ? UNBOUNDED : std::clamp<int64_t>(right, -far, far);
  P.scale = static_cast<float>(scale), P.cap = static_cast<float>(softcap);
  P.dropout = dropout_p > 0.0;
  P.seed = static_cast<uint64_t>(seed);
  const double th = std::min(std::nearbyint(dropout_p * 4294967296.0), 4294967296.0);
  P.threshold = static_cast<uint64_t>(th);
  P.keep_scale = P.dropout ? static_cast<float>(1.0 / (1.0 - dropout_p)) : 1.f;
  const std::vector<int64_t> full = {P.B, P.Hq, P.Lq, P.Lk};
  if (mask.has_value()) {
    const at::Tensor m = mask->expand(full);
    P.mask = reinterpret_cast<const uint8_t*>(m.data_ptr<bool>());
    for (int d = 0; d < 4; ++d) P.ms[d] = m.stride(d);
  }
  if (bias.has_value()) {
    P.bias_values = values(*bias).expand(full);
    P.bias = P.bias_values.data_ptr<float>();
    for (int d = 0; d < 4; ++d) P.bs[d] = P.bias_values.stride(d);
  }
  if (table.has_value()) {
    P.table = table->data_ptr<int32_t>();
    P.tb = table->size(0);
    TORCH_CHECK(table->size(1) == P.nqb && table->size(2) == P.nkb, "attnzero_cpu: table of the wrong shape");
    if (tiles.has_value() && tiles->numel() > 0) {
      P.tiles = reinterpret_cast<const uint8_t*>(tiles->data_ptr<bool>());
      P.tiles_b = tiles->size(1), P.tiles_h = tiles->size(2);
    }
  }
  return P;
}

// The generated score_mod of a call (mod_fwd 0: none): its functions' addresses, the captured tensors'
// data pointers (int64), and for the backward the gradient copies (threads, doubles) and the scratch
// floats per key its backward needs.
void set_mod(Problem& P, int64_t mod_fwd, int64_t mod_bwd, const std::optional<at::Tensor>& caps,
             const std::optional<at::Tensor>& mod_grad, int64_t mod_tmp) {
  if (mod_fwd == 0) return;
  P.mod_fwd = reinterpret_cast<ModFwd>(static_cast<intptr_t>(mod_fwd));
  P.mod_bwd = mod_bwd == 0 ? nullptr : reinterpret_cast<ModBwd>(static_cast<intptr_t>(mod_bwd));
  if (caps.has_value() && caps->numel() > 0) P.caps = reinterpret_cast<const void* const*>(caps->data_ptr<int64_t>());
  if (mod_grad.has_value() && mod_grad->numel() > 0) {
    TORCH_CHECK(mod_grad->size(0) >= at::get_num_threads(), "attnzero_cpu: a gradient copy per thread");
    P.mod_grad = mod_grad->data_ptr<double>();
    P.mod_grad_stride = mod_grad->stride(0);
  }
  P.mod_tmp = mod_tmp;
}

// f(r0, m, n) for the rows of a block: all R rows over its nc columns at once, or (trim: the band's
// right edge crosses the block) in groups of MR rows [r0, r0 + m), each over the n = reach[r0 / MR]
// columns its rows can keep (Problem::reach).
template <typename F>
void by_groups(bool trim, int64_t R, int64_t nc, const int64_t* reach, const F& f) {
  if (!trim) return f(int64_t(0), R, nc);
  for (int64_t r0 = 0; r0 < R; r0 += MR) f(r0, std::min<int64_t>(MR, R - r0), reach[r0 / MR]);
}

// The backward's dV and dK of a trimmed block, Σ over its query rows for each key column c: the
// groups of MR rows before the first that reaches c hold p = ds = 0 there, so the sum starts at that
// group's first row. f(c0, cols, r0): key columns [c0, c0 + cols), from row r0 (R: none reaches
// them) to R; columns in groups of MR, as the product's tiles take them, runs of equal r0 together.
template <typename F>
void by_key_groups(bool trim, int64_t R, int64_t nc, const int64_t* reach, const F& f) {
  if (!trim) return f(int64_t(0), nc, int64_t(0));
  const auto first_row = [&](int64_t c) {
    int64_t r0 = 0;
    while (r0 < R && reach[r0 / MR] <= c) r0 += MR;
    return std::min(r0, R);
  };
  for (int64_t c0 = 0; c0 < nc;) {
    const int64_t r0 = first_row(c0);
    int64_t c1 = std::min(nc, c0 + MR);
    while (c1 < nc && first_row(c1) == r0) c1 = std::min(nc, c1 + MR);
    f(c0, c1 - c0, r0);
    c0 = c1;
  }
}

// Pieces of a thread's work memory (run_tasks), 64-byte aligned, handed out in order.
struct Scratch {
  float* next;
  float* take(size_t n) {
    float* piece = next;
    next += (n + 15) / 16 * 16;
    return piece;
  }
};
inline size_t room(std::initializer_list<int64_t> sizes) {  // what `take` needs for these pieces
  size_t n = 0;
  for (int64_t s : sizes) n += (static_cast<size_t>(s) + 15) / 16 * 16;
  return n;
}

// Tasks per thread at least: a problem too small to pay for a parallel region (about 2^17
// multiply-adds in all) runs on the calling thread.
inline int64_t grain(int64_t tasks, int64_t work_per_task) {
  constexpr int64_t MIN_PARALLEL_WORK = int64_t(1) << 17;
  return std::max<int64_t>(1, std::min<int64_t>(tasks, MIN_PARALLEL_WORK / std::max<int64_t>(1, work_per_task)));
}

// The tasks of a call as threads take them: chunk indices [front, back), packed in one atomic word
// (front in the high half). The thread that owns the range takes chunks from its front; a thread
// whose own range is done takes them from the back.
struct Range {
  std::atomic<uint64_t> ends{0};

  void set(uint64_t front, uint64_t back) { ends.store(front << 32 | back, std::memory_order_relaxed); }
  bool take(bool from_front, int64_t* c) {  // one chunk index into *c; false when the range is empty
    uint64_t cur = ends.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = cur >> 32, back = cur & 0xffffffffu;
      if (front >= back) return false;
      const uint64_t next = from_front ? (front + 1) << 32 | back : front << 32 | (back - 1);
      if (ends.compare_exchange_weak(cur, next, std::memory_order_acq_rel, std::memory_order_relaxed)) {
        *c = static_cast<int64_t>(from_front ? front : back - 1);
        return true;
      }
    }
  }
};

// The one parallel region of a call: fn(slot, scratch, begin, end) over chunks of [0, tasks) on
// torch's OpenMP threads. Thread t owns the t-th of `threads` equal contiguous ranges of chunks, as
// at::parallel_for deals them (and MKL its rows): it reads the q, k, v rows the projection before it
// wrote on its own core and writes the rows the projection after it reads there (whole ViT-Tiny
// forward 2–4 % faster than handing chunks out in order — docs/benchmarks.md). A thread done with its
// range takes chunks from the back of the others': with equal ranges alone a thread that lost its
// core to another process made the whole call wait for its share (sentence embeddings' forward fell
// to 0.72× torch with a competing process). Small problems (fewer tasks than `grain`), one thread,
// or a call from inside a parallel region: on the calling thread.
//
// `share` false (a reduction whose order must not vary: torch.use_deterministic_algorithms): each
// thread takes only its own range, so a thread's partial sums cover the same tasks at every call.
//
// `slot` numbers the thread (0 on the calling thread; < at::get_num_threads()) and `scratch` is its
// `per_thread` floats of work memory: one block allocated here, on the calling thread, and freed
// when the call returns, as torch's own CPU attention does. (Buffers each thread kept from call to
// call left the heap and caches unlike torch's call: in ViT-Tiny the ops after attnzero's call ran
// 5–15 % slower than after torch's — docs/benchmarks.md.)
template <typename F>
void run_tasks(int64_t tasks, int64_t grain, size_t per_thread, const F& fn, bool share = true) {
  if (tasks <= 0) return;
  const bool here = at::in_parallel_region() || omp_in_parallel();
  const int64_t threads = here ? 1 : std::min<int64_t>(at::get_num_threads(), (tasks + grain - 1) / grain);
  per_thread = (per_thread + 15) / 16 * 16;
  const at::DataPtr work = c10::GetCPUAllocator()->allocate(threads * per_thread * sizeof(float));  // 64-byte aligned
  float* w = static_cast<float*>(work.get());
  if (threads <= 1) {
    fn(int64_t(0), w, int64_t(0), tasks);
    return;
  }
  // about 8 chunks a thread, so that what is left of a slow thread's range can be shared out
  const int64_t chunk = std::max<int64_t>(grain, tasks / (8 * threads)), chunks = (tasks + chunk - 1) / chunk;
  std::vector<Range> ranges(threads);
  for (int64_t t = 0; t < threads; ++t) ranges[t].set(chunks * t / threads, chunks * (t + 1) / threads);
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int64_t slot = omp_get_thread_num();
    int64_t c;
    for (int64_t r = 0; r < (share ? threads : 1); ++r) {  // its own range first, then the others' from the back
      Range& range = ranges[(slot + r) % threads];
      while (range.take(r == 0, &c)) fn(slot, w + slot * per_thread, c * chunk, std::min(tasks, (c + 1) * chunk));
    }
  }
}

// Query blocks in the order 0, n−1, 1, n−2, …: under causal the late blocks hold more keys, and
// chunks are handed out in order, so heavy and light tasks alternate.
inline int64_t zigzag(int64_t t, int64_t n) { return (t % 2 == 0) ? t / 2 : n - 1 - t / 2; }

// ---------------------------------------------------------------------------------------------
// Forward (MATH.md, "Forward with an online softmax")

template <typename T>
void forward_impl(const Problem& P, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                  at::Tensor& lse) {
  const int64_t tasks = P.B * P.Hkv * P.nqb;
  const int64_t R_max = P.G * P.bm, D = P.D, Dv = P.Dv, bn = P.bn;
  const T* qp = q.data_ptr<T>();
  // out in q's dtype, or in float32 for 16-bit inputs (cpu_kernel.forward's out_f32: O before its
  // rounding, which a backward takes for D)
  const bool out_f32 = !std::is_same_v<T, float> && out.scalar_type() == at::kFloat;
  T* op = out_f32 ? nullptr : out.data_ptr<T>();
  float* opf = out_f32 ? out.data_ptr<float>() : nullptr;
  float* lp = lse.data_ptr<float>();
  const bool tiled = P.tiled();
  const bool q_in_place = rows_in_place<T>(P, q);
  // per thread: the task's queries (unless read in place), one K and V block (16-bit inputs), the
  // scores, acc, m, l, and Kᵀ of a head in panels (the register tiles' B)
  const bool wide = !std::is_same_v<T, float>;
  const int64_t n_panels = tiled ? (P.Lk + PANEL - 1) / PANEL : 0;
  const size_t per_thread = room({q_in_place ? 0 : R_max * D, wide ? bn * D : 0, wide ? bn * Dv : 0, R_max * bn,
                                  R_max * Dv, R_max, R_max, n_panels * PANEL * D});
  std::vector<KPanels> panels(at::get_num_threads(), KPanels(n_panels));  // a thread's, by slot
  run_tasks(tasks, grain(tasks, R_max * P.Lk * (D + Dv)), per_thread,
            [&](int64_t slot, float* scratch, int64_t begin, int64_t end) {
    OneMklThread one(!tiled);
    Scratch pool{scratch};
    float* qs = pool.take(q_in_place ? 0 : R_max * D);
    float* kb = pool.take(wide ? bn * D : 0);
    float* vb = pool.take(wide ? bn * Dv : 0);
    float* s = pool.take(R_max * bn);
    float* acc = pool.take(R_max * Dv);
    float* m = pool.take(R_max);
    float* l = pool.take(R_max);
    KPanels& kt = panels[slot];
    kt.data = pool.take(n_panels * PANEL * D);
    std::vector<int64_t> reach_of((R_max + MR - 1) / MR);  // per group of MR rows: the columns it computes
    int64_t* reach = reach_of.data();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / P.nqb, ib = zigzag(task % P.nqb, P.nqb);
      const int64_t b = bh / P.Hkv, hkv = bh % P.Hkv;
      const int64_t i0 = ib * P.bm, ni = std::min(P.bm, P.Lq - i0), R = P.G * ni;
      const T* kh = k.data_ptr<T>() + b * k.stride(0) + hkv * k.stride(1);  // this head's K rows
      if (tiled) kt.start(bh);
      // q rows of the group's heads, stacked: (G·ni, D), row stride ldq (rows_in_place: where they
      // lie; else a dense float32 copy)
      const float* qa = qs;
      int64_t ldq = D;
      if (q_in_place) {
        if constexpr (std::is_same_v<T, float>) qa = qp + b * q.stride(0) + hkv * q.stride(1) + i0 * q.stride(2);
        ldq = q.stride(2);
      } else {
        for (int64_t g = 0; g < P.G; ++g)
          load_rows(qs + g * ni * D, qp + b * q.stride(0) + (hkv * P.G + g) * q.stride(1) + i0 * q.stride(2), ni,
                    D, q.stride(2), q.stride(3));
      }
      std::fill(m, m + R, NEG_INF);  // m = −inf before the first kept key
      std::fill(l, l + R, 0.f);
      bool first = true;  // no block visited yet: acc is written (beta = 0), not rescaled
      for (int64_t jb = 0; jb < P.nkb; ++jb) {
        Block blk;
        if (!P.block(b, ib, jb, ni, std::min(bn, P.Lk - jb * bn), &blk)) continue;
        const int64_t j0 = blk.j0, nc = blk.nc;
        int64_t ldk, ldv;
        const float* vp = kv_block<T>(v, b, hkv, j0, nc, vb, &ldv);
        // A block the band's right edge crosses (causal's diagonal): each group of MR rows computes
        // only the columns its rows can keep (P.reach), about the block's triangle
        const bool trim = P.reach(blk, R, ni, reach);
        if (tiled) {  // x_ij = q_i · k_j
          by_groups(trim, R, nc, reach, [&](int64_t r0, int64_t rows, int64_t n) {
            kt.scores(rows, j0, n, qa + r0 * ldq, ldq, s + r0 * bn, bn, kh, P.Lk, D, k.stride(2), k.stride(3));
          });
        } else {
          const float* kp = kv_block<T>(k, b, hkv, j0, nc, kb, &ldk);
          gemm(false, true, R, nc, D, 1.f, qa, ldq, kp, ldk, 0.f, s, bn);
        }
        const bool plain = P.plain(blk.kind);
        for (int64_t r = 0; r < R; ++r) {
          const int64_t g = r / ni, ii = r % ni, h = hkv * P.G + g, i = i0 + ii;
          float* sr = s + r * bn;
          const int64_t n = trim ? reach[r / MR] : nc;  // this row's columns
          Block row = blk;
          row.nc = n;
          float f = 1.f, top;  // s_ij = f · sr_j; top = max_j s_ij
          if (plain) {
            f = P.scale, top = P.scale * row_max(sr, n);
          } else {
            P.scores(sr, nullptr, nullptr, row, b, h, ii);  // s_ij (−inf where blocked)
            top = row_max(sr, n);
          }
          const float m_new = std::max(m[r], top);                // m_new = max(m, max_j s_ij)
          const float m_use = m_new == NEG_INF ? 0.f : m_new;     // a safe 0 inside the exp only
          const float alpha = std::exp(m[r] - m_use);             // alpha = exp(m − m_new)
          const float rowsum = exp_sum(sr, n, f, m_use);          // p_ij = exp(s_ij − m_new)
          l[r] = alpha * l[r] + rowsum;                           // l = alpha·l + Σ_j p_ij
          m[r] = m_new;                                           // m = m_new
          if (!first && alpha != 1.f) {                           // acc = alpha·acc (+ Σ_j p_ij v_j below)
            float* ar = acc + r * Dv;
            for (int64_t d = 0; d < Dv; ++d) ar[d] *= alpha;
          }
          if (P.dropout) P.drop(sr, n, b, h, i, j0);  // p̃_ij = p_ij · Z_ij / (1 − p) for the values only
        }
        if (tiled) {  // acc += Σ_j p_ij v_j
          by_groups(trim, R, nc, reach, [&](int64_t r0, int64_t rows, int64_t n) {
            product({rows, Dv, n, s + r0 * bn, bn, 1, vp, ldv, acc + r0 * Dv, Dv, 1.f, !first});
          });
        } else
          gemm(false, false, R, Dv, nc, 1.f, s, bn, vp, ldv, first ? 0.f : 1.f, acc, Dv);
        first = false;
      }
      if (first) std::fill(acc, acc + R * Dv, 0.f);  // no block kept anything: O = 0
      // O_i = acc / l, lse_i = m + log(l); a row with no kept key (l = 0): 0, −inf. A NaN score makes l
      // NaN, and the row's O and lse NaN, as torch's (acc alone may miss it: dropout can drop its p)
      for (int64_t r = 0; r < R; ++r) {
        const int64_t g = r / ni, ii = r % ni, h = hkv * P.G + g, i = i0 + ii;
        const float inv = l[r] != 0.f ? 1.f / l[r] : 0.f;
        const int64_t o0 = b * out.stride(0) + h * out.stride(1) + i * out.stride(2);  // (out's rows are unit-stride)
        const float* ar = acc + r * Dv;
        if (out_f32) {
          for (int64_t d = 0; d < Dv; ++d) opf[o0 + d] = ar[d] * inv;
        } else {
          for (int64_t d = 0; d < Dv; ++d) op[o0 + d] = static_cast<T>(ar[d] * inv);
        }
        lp[(b * P.Hq + h) * P.Lq + i] = l[r] == 0.f ? NEG_INF : m[r] + std::log(l[r]);  // (m = −inf: l is 0 or NaN)
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                           const std::optional<at::Tensor>& mask,
                                           const std::optional<at::Tensor>& bias,
                                           const std::optional<at::Tensor>& table,
                                           const std::optional<at::Tensor>& tiles, int64_t left, int64_t right,
                                           double scale, double softcap, double dropout_p, int64_t seed,
                                           int64_t block_q, int64_t block_k, int64_t mod_fwd,
                                           const std::optional<at::Tensor>& caps, bool out_f32) {
  at::NoGradGuard no_grad;  // plain values out (the autograd is cpu_kernel.py's Function)
  const at::Tensor q = values(q_in), k = unit_rows(values(k_in)), v = unit_rows(values(v_in));
  Problem P = make_problem(q, k, v, mask, bias, table, tiles, left, right, scale, softcap, dropout_p, seed, block_q,
                           block_k);
  set_mod(P, mod_fwd, 0, caps, std::nullopt, 0);
  std::atomic<int32_t> oob{0};
  P.mod_oob = &oob;
  at::Tensor out = empty_output(q_in, k_in, v_in, out_f32 ? at::kFloat : q.scalar_type(), P.dropout);
  at::Tensor lse = at::empty({P.B, P.Hq, P.Lq}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attnzero_cpu_forward", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "attnzero_cpu: float64 runs on flash.py");
    } else {
      forward_impl<scalar_t>(P, q, k, v, out, lse);
    }
  });
  TORCH_CHECK_INDEX(oob.load() == 0, "score_mod: an index into a tensor it reads is out of bounds");
  return {out, lse};
}

// ---------------------------------------------------------------------------------------------
// Backward (MATH.md, "Backward from (O, lse), recomputing P block by block")

template <typename T>
void backward_impl(const Problem& P, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk,
                   at::Tensor& dv, float* dbias, const int64_t* dbs, int64_t dbias_per_thread) {
  const int64_t D = P.D, Dv = P.Dv, bn = P.bn, G = P.G, Lq = P.Lq;
  const int64_t NR = G * Lq, R_max = G * P.bm;
  const T* qp = q.data_ptr<T>();
  const T* dop = dout.data_ptr<T>();
  // O in q's dtype, or (16-bit inputs) in float32: the forward's unrounded output (out_f32), since
  // O's rounding in D would reach every key's dS of the row (MATH.md, section 4)
  const bool out_f32 = !std::is_same_v<T, float> && out.scalar_type() == at::kFloat;
  const T* outp = out_f32 ? nullptr : out.data_ptr<T>();
  const float* outf = out_f32 ? out.data_ptr<float>() : nullptr;
  const float* lp = lse.data_ptr<float>();
  T* dqp = dq.data_ptr<T>();
  T* dkp = dk.data_ptr<T>();
  T* dvp = dv.data_ptr<T>();
  const int64_t dqs[3] = {dq.stride(0), dq.stride(1), dq.stride(2)}, dks = dk.stride(2), dvs = dv.stride(2);
  const int64_t tasks = P.B * P.Hkv;
  const bool tiled = P.tiled();
  const int64_t npanel = tiled ? (bn + PANEL - 1) / PANEL * PANEL : 0;  // a key block's rows, whole panels
  // Rows of the task, query block by query block: block ib holds rows [G·i0, G·(i0 + ni)), its row
  // G·i0 + g·ni + ii being query head hkv·G + g, query i0 + ii.
  const int64_t RB = R_max * bn, nd = P.dropout ? RB : 0, nt = P.cap > 0.f ? RB : 0;
  const int64_t nx = P.mod_bwd != nullptr ? RB : 0, nm = P.mod_bwd != nullptr ? P.mod_tmp * bn : 0;
  // q and dO rows read where they lie, or copied (rows_in_place); K and V blocks converted unless float32
  const bool in_place = rows_in_place<T>(P, q) && rows_in_place<T>(P, dout);
  const int64_t nq = in_place ? 0 : NR, nkv = std::is_same_v<T, float> ? 0 : bn;
  const int64_t ldq = in_place ? q.stride(2) : D, ldo = in_place ? dout.stride(2) : Dv;
  const size_t per_thread = room({nq * D, nq * Dv, NR, NR, NR * D, nkv * D, nkv * Dv, bn * D, bn * Dv, RB, RB, nd, nt,
                                  nx, nm, npanel * D, npanel * Dv});
  // a broadcast bias's gradient and a score_mod's captured tensors' are summed per thread: with tasks
  // shared out as threads finish, the sums would group differently from call to call
  const bool per_thread_sums = (dbias != nullptr && dbias_per_thread > 0) || P.mod_grad != nullptr;
  const bool share = !(per_thread_sums && at::globalContext().deterministicAlgorithms());
  run_tasks(tasks, grain(tasks, 2 * NR * P.Lk * (D + Dv)), per_thread,
            [&](int64_t slot, float* scratch, int64_t begin, int64_t end) {
    OneMklThread one(!tiled);
    Scratch pool{scratch};
    float *qs = pool.take(nq * D), *dos = pool.take(nq * Dv), *Dr = pool.take(NR), *lser = pool.take(NR);
    float *dqa = pool.take(NR * D), *kb = pool.take(nkv * D), *vb = pool.take(nkv * Dv);
    float *dka = pool.take(bn * D), *dva = pool.take(bn * Dv), *s = pool.take(RB), *dp = pool.take(RB);
    float *pd = pool.take(nd), *th = pool.take(nt), *xs = pool.take(nx), *mt = pool.take(nm);
    float *kt = pool.take(npanel * D), *vt = pool.take(npanel * Dv);  // the key block's Kᵀ, Vᵀ as panels
    std::vector<int64_t> reach_of((R_max + MR - 1) / MR);  // per group of MR rows: the columns it computes
    int64_t* reach = reach_of.data();
    float* db = dbias == nullptr ? nullptr : dbias + (dbias_per_thread ? slot * dbias_per_thread : 0);
    double* mg = P.mod_grad == nullptr ? nullptr : P.mod_grad + slot * P.mod_grad_stride;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / P.Hkv, hkv = task % P.Hkv;
      T* dk0 = dkp + b * dk.stride(0) + hkv * dk.stride(1);  // this head's dK, dV rows
      T* dv0 = dvp + b * dv.stride(0) + hkv * dv.stride(1);
      const float* qf = qs;  // the task's q and dO rows: row r at qf + r·ldq, dof + r·ldo
      const float* dof = dos;
      if constexpr (std::is_same_v<T, float>) {
        if (in_place) {
          qf = qp + b * q.stride(0) + hkv * q.stride(1);
          dof = dop + b * dout.stride(0) + hkv * dout.stride(1);
        }
      }
      for (int64_t ib = 0; ib < P.nqb; ++ib) {
        const int64_t i0 = ib * P.bm, ni = std::min(P.bm, Lq - i0);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = hkv * G + g, row0 = G * i0 + g * ni;
          if (!in_place) {
            const int64_t qo = b * q.stride(0) + h * q.stride(1) + i0 * q.stride(2);
            load_rows(qs + row0 * D, qp + qo, ni, D, q.stride(2), q.stride(3));
            const int64_t go = b * dout.stride(0) + h * dout.stride(1) + i0 * dout.stride(2);
            load_rows(dos + row0 * Dv, dop + go, ni, Dv, dout.stride(2), dout.stride(3));
          }
          const int64_t os2 = out.stride(2), os3 = out.stride(3);
          const int64_t o0 = b * out.stride(0) + h * out.stride(1) + i0 * os2;
          for (int64_t ii = 0; ii < ni; ++ii) {  // D_i = Σ_d dO_id · O_id
            const float* dor = dof + (row0 + ii) * ldo;
            Dr[row0 + ii] = out_f32 ? dot(dor, outf + o0 + ii * os2, Dv, os3) : dot(dor, outp + o0 + ii * os2, Dv, os3);
            lser[row0 + ii] = lp[b * lse.stride(0) + h * lse.stride(1) + (i0 + ii) * lse.stride(2)];
          }
        }
      }
      std::fill(dqa, dqa + NR * D, 0.f);
      for (int64_t jb = 0; jb < P.nkb; ++jb) {
        const int64_t jstart = jb * bn, ncb = std::min(bn, P.Lk - jstart);  // the key block
        int64_t ldk, ldv;
        const float* kb0 = kv_block<T>(k, b, hkv, jstart, ncb, kb, &ldk);
        const float* vb0 = kv_block<T>(v, b, hkv, jstart, ncb, vb, &ldv);
        for (int64_t c = 0; tiled && c < ncb; c += PANEL) {  // once per key block, for all its query blocks
          to_panel(kt + c * D, kb0, c, std::min(PANEL, ncb - c), D, ldk, int64_t(1));
          to_panel(vt + c * Dv, vb0, c, std::min(PANEL, ncb - c), Dv, ldv, int64_t(1));
        }
        std::fill(dka, dka + ncb * D, 0.f);
        std::fill(dva, dva + ncb * Dv, 0.f);
        bool any = false;
        for (int64_t ib = 0; ib < P.nqb; ++ib) {
          const int64_t i0 = ib * P.bm, ni = std::min(P.bm, Lq - i0), R = G * ni, row0 = G * i0;
          Block blk;
          if (!P.block(b, ib, jb, ni, ncb, &blk)) continue;
          any = true;
          // the block's columns [j0, j0 + nc) are rows c0.. of the key block's K, V, dK, dV
          const int64_t j0 = blk.j0, nc = blk.nc, c0 = j0 - jstart;
          const float* kp = kb0 + c0 * ldk;
          const float* vp = vb0 + c0 * ldv;
          float* dkb = dka + c0 * D;
          float* dvb = dva + c0 * Dv;
          const float* qi = qf + row0 * ldq;
          const float* doi = dof + row0 * ldo;
          // as in the forward, a block the band's right edge crosses is computed by groups of MR
          // rows, each up to its reach (S, dp and dQ); past it p and ds are 0, and dV and dK sum
          // each key's rows from the first group that reaches it
          const bool trim = P.reach(blk, R, ni, reach);
          if (tiled) {  // x_ij = q_i · k_j
            by_groups(trim, R, nc, reach, [&](int64_t r0, int64_t rows, int64_t n) {
              product_t(rows, c0, n, D, qi + r0 * ldq, ldq, kt, s + r0 * bn, bn, 1.f);
            });
          } else {
            gemm(false, true, R, nc, D, 1.f, qi, ldq, kp, ldk, 0.f, s, bn);
          }
          const bool plain = P.plain(blk.kind);  // s_ij = scale · x_ij, folded into the exp
          for (int64_t r = 0; r < R; ++r) {
            const int64_t g = r / ni, ii = r % ni, h = hkv * G + g, i = i0 + ii;
            float* sr = s + r * bn;
            const int64_t n = trim ? reach[r / MR] : nc;  // this row's columns
            Block row = blk;
            row.nc = n;
            if (!plain) P.scores(sr, P.cap > 0.f ? th + r * bn : nullptr, nx ? xs + r * bn : nullptr, row, b, h, ii);
            const float lse_i = lser[row0 + r];
            if (lse_i == NEG_INF) {  // p_ij = 0 for a row with no kept key
              std::fill(sr, sr + n, 0.f);
            } else {
              exp_sum(sr, n, plain ? P.scale : 1.f, lse_i);  // p_ij = exp(s_ij − lse_i) (0 where blocked)
            }
            std::fill(sr + n, sr + nc, 0.f);  // (past the reach)
            if (P.dropout) {  // p̃_ij = p_ij · Z_ij / (1 − p)
              float* pr = pd + r * bn;
              std::copy(sr, sr + nc, pr);
              P.drop(pr, n, b, h, i, j0);
            }
          }
          const float* pt = P.dropout ? pd : s;
          if (tiled) {
            by_key_groups(trim, R, nc, reach, [&](int64_t c, int64_t cols, int64_t r0) {  // dV_j += Σ_i p̃_ij dO_i
              product({cols, Dv, R - r0, pt + r0 * bn + c, 1, bn, doi + r0 * ldo, ldo, dvb + c * Dv, Dv, 1.f, true});
            });
            by_groups(trim, R, nc, reach, [&](int64_t r0, int64_t rows, int64_t n) {  // dp_ij = dO_i · v_j
              product_t(rows, c0, n, Dv, doi + r0 * ldo, ldo, vt, dp + r0 * bn, bn, 1.f);
            });
          } else {
            gemm(true, false, nc, Dv, R, 1.f, pt, bn, doi, ldo, 1.f, dvb, Dv);
            gemm(false, true, R, nc, Dv, 1.f, doi, ldo, vp, ldv, 0.f, dp, bn);
          }
          for (int64_t r = 0; r < R; ++r) {
            const int64_t g = r / ni, ii = r % ni, h = hkv * G + g, i = i0 + ii;
            const int64_t n = trim ? reach[r / MR] : nc;  // this row's columns
            float* dpr = dp + r * bn;
            const float* pr = s + r * bn;
            const float Di = Dr[row0 + r];
            if (P.dropout) {  // ds_ij = p_ij (Z_ij · dp_ij / (1 − p) − D_i) = p̃_ij · dp_ij − p_ij · D_i
              const float* ptr = pd + r * bn;
              for (int64_t j = 0; j < n; ++j) dpr[j] = ptr[j] * dpr[j] - pr[j] * Di;
            } else {  // ds_ij = p_ij (dp_ij − D_i)
              for (int64_t j = 0; j < n; ++j) dpr[j] = pr[j] * (dpr[j] - Di);
            }
            std::fill(dpr + n, dpr + nc, 0.f);  // (past the reach)
            if (db != nullptr) {  // dbias_ij += ds_ij (summed where the bias broadcasts)
              float* dbr = db + b * dbs[0] + h * dbs[1] + i * dbs[2] + j0 * dbs[3];
              for (int64_t j = 0; j < n; ++j) dbr[j * dbs[3]] += dpr[j];
            }
            if (P.cap > 0.f) {  // through the cap: ds · (1 − t²)
              const float* tr = th + r * bn;
              for (int64_t j = 0; j < n; ++j) dpr[j] *= 1.f - tr[j] * tr[j];
            }
            if (nx) P.mod_bwd(xs + r * bn, dpr, n, b, h, i, j0, P.caps, mg, mt);  // through the mod: ds · ∂y/∂x (+ dθ)
          }
          if (tiled) {
            by_groups(trim, R, nc, reach, [&](int64_t r0, int64_t rows, int64_t n) {  // dQ_i += scale · Σ_j ds_ij k_j
              product({rows, D, n, dp + r0 * bn, bn, 1, kp, ldk, dqa + (row0 + r0) * D, D, P.scale, true});
            });
            by_key_groups(trim, R, nc, reach, [&](int64_t c, int64_t cols, int64_t r0) {  // dK_j += scale · Σ_i ds_ij q_i
              product({cols, D, R - r0, dp + r0 * bn + c, 1, bn, qi + r0 * ldq, ldq, dkb + c * D, D, P.scale, true});
            });
          } else {
            gemm(false, false, R, D, nc, P.scale, dp, bn, kp, ldk, 1.f, dqa + row0 * D, D);
            gemm(true, false, nc, D, R, P.scale, dp, bn, qi, ldq, 1.f, dkb, D);
          }
        }
        for (int64_t c = 0; c < ncb; ++c) {  // the key block's dK, dV rows (rows of unit stride)
          T* dkr = dk0 + (jstart + c) * dks, *dvr = dv0 + (jstart + c) * dvs;
          for (int64_t d = 0; d < D; ++d) dkr[d] = static_cast<T>(any ? dka[c * D + d] : 0.f);
          for (int64_t d = 0; d < Dv; ++d) dvr[d] = static_cast<T>(any ? dva[c * Dv + d] : 0.f);
        }
      }
      for (int64_t ib = 0; ib < P.nqb; ++ib) {  // dQ back to (B, Hq, Lq, D)
        const int64_t i0 = ib * P.bm, ni = std::min(P.bm, Lq - i0);
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = hkv * G + g, row0 = G * i0 + g * ni;
          for (int64_t ii = 0; ii < ni; ++ii) {
            T* dst = dqp + b * dqs[0] + h * dqs[1] + (i0 + ii) * dqs[2];
            const float* src = dqa + (row0 + ii) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(src[d]);
          }
        }
      }
    }
  }, share);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in,
    const at::Tensor& lse, const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& table, const std::optional<at::Tensor>& tiles, int64_t left, int64_t right,
    double scale, double softcap, double dropout_p, int64_t seed, int64_t block_q, int64_t block_k, bool bias_grad,
    int64_t mod_fwd, int64_t mod_bwd, const std::optional<at::Tensor>& caps, const std::optional<at::Tensor>& mod_grad,
    int64_t mod_tmp) {
  at::NoGradGuard no_grad;
  const at::Tensor q = values(q_in), dout = values(dout_in), out = values(out_in);
  const at::Tensor k = unit_rows(values(k_in)), v = unit_rows(values(v_in));
  Problem P = make_problem(q, k, v, mask, bias, table, tiles, left, right, scale, softcap, dropout_p, seed, block_q,
                           block_k);
  set_mod(P, mod_fwd, mod_bwd, caps, mod_grad, mod_tmp);
  at::Tensor dq = empty_in_order_of(q, P.D), dk = empty_in_order_of(k_in, P.D), dv = empty_in_order_of(v_in, P.Dv);
  // dbias, float32, in the bias's own (broadcast) shape: written in place by the task that owns its
  // (batch, head) when the bias has every batch and query head, else summed from one copy per thread.
  at::Tensor dbias = at::empty({0}, q.options().dtype(at::kFloat));
  at::Tensor acc;
  int64_t dbs[4] = {0, 0, 0, 0};
  int64_t per_thread = 0;
  if (bias.has_value() && bias_grad) {
    const auto shape = bias->sizes();
    const bool owned = shape[0] == P.B && shape[1] == P.Hq;
    const int64_t n = owned ? 1 : at::get_num_threads();
    acc = at::zeros({n, shape[0], shape[1], shape[2], shape[3]}, q.options().dtype(at::kFloat));
    const at::Tensor one = acc[0].expand({P.B, P.Hq, P.Lq, P.Lk});
    for (int d = 0; d < 4; ++d) dbs[d] = one.stride(d);
    per_thread = owned ? 0 : acc.stride(0);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attnzero_cpu_backward", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "attnzero_cpu: float64 runs on flash.py");
    } else {
      backward_impl<scalar_t>(P, dout, q, k, v, out, lse, dq, dk, dv, acc.defined() ? acc.data_ptr<float>() : nullptr,
                              dbs, per_thread);
    }
  });
  if (acc.defined()) dbias = acc.sum(0);
  return {dq, dk, dv, dbias};
}

// dropout_kept for n consecutive keys from (b, h, i, j0) of a (·, H, Lq, Lk) problem: the tests'
// view of the hash (a row of 2³² keys cannot be run).
at::Tensor keep_mask(int64_t seed, double dropout_p, int64_t H, int64_t Lq, int64_t Lk, int64_t b, int64_t h,
                     int64_t i, int64_t j0, int64_t n) {
  const double th = std::min(std::nearbyint(dropout_p * 4294967296.0), 4294967296.0);
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kBool));
  bool* o = out.data_ptr<bool>();
  const uint64_t start = static_cast<uint64_t>(((b * H + h) * Lq + i) * Lk + j0);
  for (int64_t j = 0; j < n; ++j) o[j] = dropout_kept(start + j, static_cast<uint64_t>(seed), static_cast<uint64_t>(th));
  return out;
}

}  // namespace

// The functions as a Python module: a pybind11 call costs about 1 µs, where a dispatcher op's boxed
// call from Python (the torch.ops.attnzero_cpu ops this file registered before) cost about 8 — most
// of a tiny call's budget. torch.compile / torch.export never see them: ops.py wraps the backend in
// custom ops of its own.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward);
  m.def("backward", &backward);
  m.def("keep_mask", &keep_mask);
}
