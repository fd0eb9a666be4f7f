/* Softcap's tanh, fused, for flash on CPU (float32). Built and loaded by softcap_cpu.py.

   One pass over a score block s (n0, n1, n2), contiguous, in place:

       t = tanh(s);  t_out = t (if given);  s = cap · t + a + b;  s = exp2(s) (if exp2)
       (exp2 = 2: t_out = s · (1 − t²) instead, with s the exp2: the backward's factor)

   a and b are optional addends (the causal edge tile, a per-row shift) read through strides, where
   a stride of 0 broadcasts; their innermost stride is 0 or 1. torch's own CPU tanh is MKL's, which
   takes a slow path on CPUs that are not Intel's (9× an exp2 there); this one is glibc's vector
   tanh (libmvec, the same function for every vendor), and it saves the passes that the scale and the
   addends would take as separate torch ops. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define W 16
typedef __m512 vec;
vec _ZGVeN16v_tanhf(vec);
vec _ZGVeN16v_exp2f(vec);
#define TANH _ZGVeN16v_tanhf
#define EXP2 _ZGVeN16v_exp2f
#define LOAD _mm512_loadu_ps
#define STORE _mm512_storeu_ps
#define SET1 _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define MUL _mm512_mul_ps
#define SUB _mm512_sub_ps
#define ABS _mm512_abs_ps
#define I(v) _mm512_castps_si512(v)
/* |m| with the sign of x (m >= 0) */
#define WITH_SIGN(m, x) _mm512_castsi512_ps(_mm512_or_si512(I(m), _mm512_and_si512(I(x), I(SET1(-0.0f)))))
typedef __mmask16 lanes;
#define SMALL(ax) _mm512_cmp_ps_mask(ax, SET1(SMALL_X), _CMP_LE_OQ)
#define ALL(m) ((m) == 0xFFFF)
#define NONE(m) ((m) == 0)
#define BLEND(m, big, small) _mm512_mask_blend_ps(m, big, small)
#define BELOW(y, v) _mm512_cmp_ps_mask(y, SET1(v), _CMP_LT_OQ)
#elif defined(__AVX2__) && defined(__FMA__)
#define W 8
typedef __m256 vec;
vec _ZGVdN8v_tanhf(vec);
vec _ZGVdN8v_exp2f(vec);
#define TANH _ZGVdN8v_tanhf
#define EXP2 _ZGVdN8v_exp2f
#define LOAD _mm256_loadu_ps
#define STORE _mm256_storeu_ps
#define SET1 _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define ADD _mm256_add_ps
#define MUL _mm256_mul_ps
#define SUB _mm256_sub_ps
#define ABS(x) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)
#define WITH_SIGN(m, x) _mm256_or_ps(m, _mm256_and_ps(x, _mm256_set1_ps(-0.0f)))
typedef __m256 lanes;
#define SMALL(ax) _mm256_cmp_ps(ax, SET1(SMALL_X), _CMP_LE_OQ)
#define ALL(m) (_mm256_movemask_ps(m) == 0xFF)
#define NONE(m) (_mm256_movemask_ps(m) == 0)
#define BLEND(m, big, small) _mm256_blendv_ps(big, small, m)
#define BELOW(y, v) _mm256_cmp_ps(y, SET1(v), _CMP_LT_OQ)
#else
#error "softcap.c needs AVX2 and FMA, or AVX-512"
#endif

/* The lanes one vector holds (8 or 16: the loader refuses anything else). */
int az_lanes(void) { return W; }

/* tanh(x) for 0 <= x <= SMALL_X: x + x·y·P(y), y = x², P of degree 7 fitted toward the minimax of
   tanh's relative error on [0, 1] (tools/fit_tanh.py: within 2^-31 as a formula, 1.32 units of
   2^-24·tanh x at most once evaluated in float32 like this, over every third float of [2^-12, 1]).
   libmvec's tanhf takes about twice as long (17 cycles a vector against 9 here), and the scores of
   attention are mostly this small (|s| <= softcap). */
#define SMALL_X 1.0f
static inline vec tanh_small(vec x) {
    vec y = MUL(x, x);
    vec p = SET1(0.00012147080269642174f);  /* x^17 */
    p = FMA(p, y, SET1(-0.0008411375456489623f));  /* x^15 */
    p = FMA(p, y, SET1(0.0030785948038101196f));  /* x^13 */
    p = FMA(p, y, SET1(-0.008595115505158901f));  /* x^11 */
    p = FMA(p, y, SET1(0.02178473211824894f));  /* x^9 */
    p = FMA(p, y, SET1(-0.05395309999585152f));  /* x^7 */
    p = FMA(p, y, SET1(0.1333319991827011f));  /* x^5 */
    p = FMA(p, y, SET1(-0.333333283662796f));  /* x^3 */
    return FMA(MUL(x, y), p, x);
}

/* tanh of W lanes: each lane by the polynomial where |x| <= SMALL_X (on |x|, the sign put back: tanh is
   odd, and tanh(−0) = −0), else by libmvec (NaN included), so a lane's result depends only on its
   own x; libmvec is called only when some lane needs it. */
static inline vec tanh_vec(vec x) {
    vec ax = ABS(x);
    lanes small = SMALL(ax);
    if (NONE(small)) return TANH(x);
    vec poly = WITH_SIGN(tanh_small(ax), x);
    return ALL(small) ? poly : BLEND(small, TANH(x), poly);
}

/* exp2 of W lanes. Below −150 (a blocked pair's −inf above all) exp2 is 0 in float32; libmvec would
   send such lanes down its slow scalar path, so they are given 0 in, and 0 out. */
static inline vec exp2_vec(vec y) {
    lanes dead = BELOW(y, -150.0f);
    if (NONE(dead)) return EXP2(y);
    vec zero = SET1(0.0f);
    return BLEND(dead, EXP2(BLEND(dead, y, zero)), zero);
}

/* W scores x of one row, their addends (zero vectors when absent): the whole formula. exp2: 0 none,
   1 exp2 at the end, 2 that and t_out = p · (1 − t²) instead of t, p the result. */
static inline vec formula(vec x, float *t_out, vec cap, vec a, vec b, int exp2) {
    vec t = tanh_vec(x);
    if (t_out && exp2 != 2) STORE(t_out, t);
    vec y = ADD(FMA(cap, t, a), b);
    if (!exp2) return y;
    vec p = exp2_vec(y);
    if (t_out && exp2 == 2) STORE(t_out, MUL(p, FMA(SUB(SET1(0.0f), t), t, SET1(1.0f))));  /* p · (1 − t·t) */
    return p;
}

/* One addend's W values from column k of its row (inner stride 1), or its one value (stride 0). */
static inline vec addend(const float *row, int64_t stride, int64_t k) {
    if (!row) return SET1(0.0f);
    return stride ? LOAD(row + k) : SET1(row[0]);
}

/* The formula over s (n0, n1, n2), in place; returns 0, or −1 for strides it does not take. */
int az_softcap(float *s, float *t_out, int64_t n0, int64_t n1, int64_t n2, float cap, int exp2,
               const float *a, int64_t a0, int64_t a1, int64_t a2,
               const float *b, int64_t b0, int64_t b1, int64_t b2) {
    if ((a && a2 != 0 && a2 != 1) || (b && b2 != 0 && b2 != 1)) return -1;
    const vec vcap = SET1(cap);
    for (int64_t i = 0; i < n0; i++) {
        for (int64_t j = 0; j < n1; j++) {
            int64_t row = (i * n1 + j) * n2;  /* the row's first element in s and t_out */
            float *x = s + row, *t = t_out ? t_out + row : 0;
            const float *ra = a ? a + i * a0 + j * a1 : 0, *rb = b ? b + i * b0 + j * b1 : 0;
            int64_t k = 0;
            for (; k + W <= n2; k += W) {
                vec y = formula(LOAD(x + k), t ? t + k : 0, vcap, addend(ra, a2, k), addend(rb, b2, k), exp2);
                STORE(x + k, y);
            }
            if (k < n2) {  /* the last n2 − k < W columns, through zero-padded copies: the same lanes */
                int64_t n = n2 - k;
                float xs[W], ts[W], as[W], bs[W];
                memset(xs, 0, sizeof xs), memset(as, 0, sizeof as), memset(bs, 0, sizeof bs);
                memcpy(xs, x + k, n * sizeof(float));
                if (ra) for (int64_t e = 0; e < n; e++) as[e] = ra[a2 * (k + e)];
                if (rb) for (int64_t e = 0; e < n; e++) bs[e] = rb[b2 * (k + e)];
                vec y = formula(LOAD(xs), t ? ts : 0, vcap, LOAD(as), LOAD(bs), exp2);
                STORE(xs, y);
                memcpy(x + k, xs, n * sizeof(float));
                if (t) memcpy(t + k, ts, n * sizeof(float));
            }
        }
    }
    return 0;
}
