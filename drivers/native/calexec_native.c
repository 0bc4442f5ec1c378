/* calexec host-side native helpers: the fused BF16 logits postprocess (see calexec_native.h).
 *
 * The slice is processed in blocks of BLOCK elements: one loop over a block converts, checks
 * finiteness and takes the block's maximum key (no branch on the data, so the compiler
 * vectorises it); only when the block's maximum beats the running one is the block scanned
 * again (from L1) for the first index of it; with SUMEXP, a second loop over the block's FP32
 * values (in L1) sums exp(x - running max). Source bytes are read from memory once and the
 * destination written once.
 *
 * Ordering without floating point: a finite BF16 value's key is +magnitude bits for a
 * positive sign and -magnitude bits for a negative one. The key is monotone in the value and
 * maps -0 and +0 to the same key, so "first index of the largest key" is np.argmax's rule on
 * the FP32 values, whatever the FPU's denormal mode.
 */
#include "calexec_native.h"

#include <math.h>
#include <string.h>

#define BLOCK 1024

/* One build, chosen at load time: AVX2+FMA where the CPU has it, the baseline (SSE2 on x86-64)
 * elsewhere. -DCALEXEC_CLONES= builds the baseline only (the sanitizer check runs both). */
#ifndef CALEXEC_CLONES
#if defined(__GNUC__) && defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define CALEXEC_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
#endif
#endif
#ifndef CALEXEC_CLONES
#define CALEXEC_CLONES
#endif

#if defined(__GNUC__)
#define CALEXEC_INLINE static inline __attribute__((always_inline))
#else
#define CALEXEC_INLINE static inline
#endif

typedef union {
    uint32_t u;
    float f;
} bits32;

CALEXEC_INLINE int16_t bf16_key(uint16_t b) {
    const int16_t mag = (int16_t)(b & 0x7FFFu);
    return (b & 0x8000u) ? (int16_t)-mag : mag;
}

CALEXEC_INLINE float bf16_value(uint16_t b) {
    bits32 v;
    v.u = (uint32_t)b << 16;
    return v.f;
}

/* exp(x) for x <= 0, eight lanes at a time (GCC/clang vector extensions: AVX registers in the
 * AVX2 clone, pairs of SSE registers otherwise). Cephes expf's reduction and polynomial
 * (about 1 ulp): x is clamped at -87 (exp(-87) = 1.6e-38, so a term below it counts as that:
 * far below the sum, which is >= 1), x*log2(e) is rounded to the nearest integer n with the
 * 1.5*2^23 trick, and 2^n is built in the exponent bits. */
typedef float v8sf __attribute__((vector_size(32)));
typedef int32_t v8si __attribute__((vector_size(32)));

#define V8(x) {x, x, x, x, x, x, x, x}

CALEXEC_INLINE v8sf exp8_nonpositive(v8sf x) {
    const v8sf lo = V8(-87.0f), magic = V8(12582912.0f);
    const v8si below = x < lo;
    x = (v8sf)(((v8si)x & ~below) | ((v8si)lo & below));
    const v8sf n = (x * (v8sf)V8(1.44269504088896341f) + magic) - magic;
    v8sf r = x - n * (v8sf)V8(0.693359375f);
    r = r - n * (v8sf)V8(-2.12194440e-4f);
    v8sf p = V8(1.9875691500e-4f);
    p = p * r + (v8sf)V8(1.3981999507e-3f);
    p = p * r + (v8sf)V8(8.3334519073e-3f);
    p = p * r + (v8sf)V8(4.1665795894e-2f);
    p = p * r + (v8sf)V8(1.6666665459e-1f);
    p = p * r + (v8sf)V8(5.0000001201e-1f);
    p = p * r * r + r + (v8sf)V8(1.0f);
    const v8si scale = (__builtin_convertvector(n, v8si) + 127) << 23;
    return p * (v8sf)scale;
}

/* sum of exp(bd[j] - m) over the block, eight lanes then the tail (deterministic order) */
CALEXEC_INLINE double block_sumexp(const float *bd, size_t len, float m) {
    const v8sf mv = V8(m);
    v8sf acc = V8(0.0f);
    size_t j = 0;
    for (; j + 8 <= len; j += 8) {
        v8sf x;
        memcpy(&x, bd + j, sizeof x);
        acc += exp8_nonpositive(x - mv);
    }
    double sum = (((double)acc[0] + acc[1]) + ((double)acc[2] + acc[3]))
                 + (((double)acc[4] + acc[5]) + ((double)acc[6] + acc[7]));
    if (j < len) {
        v8sf x = V8(-INFINITY);  /* exp(-inf - m) clamps to exp(-87): excluded below */
        memcpy(&x, bd + j, (len - j) * sizeof(float));
        const v8sf e = exp8_nonpositive(x - mv);
        for (size_t l = 0; l < len - j; l++)
            sum += e[l];
    }
    return sum;
}

CALEXEC_CLONES
int calexec_bf16_logits(const uint16_t *src, size_t size, size_t base, size_t n, float *dst,
                        size_t dst_len, unsigned int flags, calexec_logits_stats *out) {
    if (out == NULL)
        return CALEXEC_LOGITS_ENULL;
    out->argmax = -1;
    out->first_nonfinite = -1;
    out->max = -INFINITY;
    out->sumexp = 0.0;
    if ((flags & CALEXEC_LOGITS_NOSTORE) && (flags & CALEXEC_LOGITS_SUMEXP))
        return CALEXEC_LOGITS_EFLAGS;
    if (base > size || n > size - base)
        return CALEXEC_LOGITS_EBOUNDS;
    if (n > dst_len)
        return CALEXEC_LOGITS_EDST;
    if (n == 0)
        return CALEXEC_LOGITS_OK;
    if (src == NULL || dst == NULL)
        return CALEXEC_LOGITS_ENULL;
    const uint16_t *s = src + base;
    const int want_sumexp = (flags & CALEXEC_LOGITS_SUMEXP) != 0;
    const int store = (flags & CALEXEC_LOGITS_NOSTORE) == 0;
    int32_t best_key = INT32_MIN;
    size_t best = 0;
    float run_max = -INFINITY;
    double sum = 0.0;
    for (size_t i0 = 0; i0 < n; i0 += BLOCK) {
        const size_t len = n - i0 < BLOCK ? n - i0 : BLOCK;
        const uint16_t *bs = s + i0;
        float *bd = dst + i0;
        /* 16-bit lanes: NaN/Inf iff the magnitude bits are >= 0x7F80 (exponent all ones) */
        uint16_t mag_max = 0;
        int16_t bmax = INT16_MIN;
        if (store) {
            for (size_t j = 0; j < len; j++) {
                const uint16_t b = bs[j];
                bd[j] = bf16_value(b);
                const uint16_t mag = (uint16_t)(b & 0x7FFFu);
                mag_max = mag > mag_max ? mag : mag_max;
                const int16_t k = bf16_key(b);
                bmax = k > bmax ? k : bmax;
            }
        } else {  /* the same loop without the store (two loops: each one vectorises) */
            for (size_t j = 0; j < len; j++) {
                const uint16_t b = bs[j];
                const uint16_t mag = (uint16_t)(b & 0x7FFFu);
                mag_max = mag > mag_max ? mag : mag_max;
                const int16_t k = bf16_key(b);
                bmax = k > bmax ? k : bmax;
            }
        }
        if (mag_max >= 0x7F80u) {
            for (size_t j = 0; j < len; j++) {
                if ((bs[j] & 0x7F80u) == 0x7F80u) {
                    out->first_nonfinite = (int64_t)(i0 + j);
                    break;
                }
            }
            return CALEXEC_LOGITS_NONFINITE;
        }
        if (bmax > best_key) {
            size_t j = 0;
            while (bf16_key(bs[j]) != bmax)  /* bmax is some element's key: bounded by len */
                j++;
            best_key = bmax;
            best = i0 + j;
        }
        if (want_sumexp) {
            const float m = bf16_value(s[best]);
            if (m > run_max) {
                if (run_max != -INFINITY)
                    sum *= exp((double)run_max - (double)m);
                run_max = m;
            }
            sum += block_sumexp(bd, len, run_max);
        }
    }
    out->argmax = (int64_t)best;
    out->max = bf16_value(s[best]);
    out->sumexp = want_sumexp ? sum : 0.0;
    return CALEXEC_LOGITS_OK;
}
