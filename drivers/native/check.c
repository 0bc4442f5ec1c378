/* Self-check of calexec_bf16_logits for the sanitizer builds (make -C drivers/calrt
 * check-sanitizers): random BF16 slices, every source and destination allocated at its exact
 * size so that ASan reports any access past it, compared with a plain scalar reference
 * (conversion, first NaN/Inf, first maximum with -0 == +0). Bounds refusals with huge and
 * overflowing base/n. Exit 0 when all agree, 1 on the first disagreement. */
#include "calexec_native.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t next_u64(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static const uint16_t special[] = {0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x807F, 0x7F7F,
                                   0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x3F80, 0xBF80};

static float widen(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static int fail(const char *what, size_t size, size_t base, size_t n) {
    fprintf(stderr, "native check: %s (size=%zu base=%zu n=%zu)\n", what, size, base, n);
    return 1;
}

static int one_case(size_t size, size_t base, size_t n, int specials) {
    uint16_t *src = malloc(size ? size * sizeof *src : 1);
    float *dst = malloc(n ? n * sizeof *dst : 1);
    if (src == NULL || dst == NULL)
        return fail("out of memory", size, base, n);
    for (size_t i = 0; i < size; i++) {
        uint64_t r = next_u64();
        src[i] = (specials && (r & 31) == 0) ? special[(r >> 8) % (sizeof special / 2)]
                                            : (uint16_t)(r >> 16);
        if (!specials && (src[i] & 0x7F80u) == 0x7F80u)
            src[i] &= 0xBFFFu; /* finite */
    }
    calexec_logits_stats st, ns;
    /* NOSTORE first: the same answers, dst untouched (a sentinel pattern stays) */
    memset(dst, 0xA5, n * sizeof *dst);
    int nrc = calexec_bf16_logits(src, size, base, n, dst, n, CALEXEC_LOGITS_NOSTORE, &ns);
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &dst[i], sizeof u);
        if (u != 0xA5A5A5A5u) {
            free(src);
            free(dst);
            return fail("NOSTORE wrote the destination", size, base, n);
        }
    }
    int rc = calexec_bf16_logits(src, size, base, n, dst, n, CALEXEC_LOGITS_SUMEXP, &st);
    if (nrc != rc || ns.argmax != st.argmax || ns.first_nonfinite != st.first_nonfinite
        || memcmp(&ns.max, &st.max, sizeof ns.max) != 0) {
        free(src);
        free(dst);
        return fail("NOSTORE answers otherwise than the conversion", size, base, n);
    }
    long long bad = -1, best = -1;
    float best_v = 0.0f;
    for (size_t i = 0; i < n && bad < 0; i++) {
        if ((src[base + i] & 0x7F80u) == 0x7F80u)
            bad = (long long)i;
        else if (best < 0 || widen(src[base + i]) > best_v) {
            best = (long long)i;
            best_v = widen(src[base + i]);
        }
    }
    int status = 0;
    if (bad >= 0) {
        if (rc != CALEXEC_LOGITS_NONFINITE || st.first_nonfinite != bad)
            status = fail("non-finite not reported at its index", size, base, n);
    } else if (rc != CALEXEC_LOGITS_OK || st.argmax != best) {
        status = fail("argmax differs from the scalar reference", size, base, n);
    } else {
        for (size_t i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, &dst[i], sizeof u);
            if (u != (uint32_t)src[base + i] << 16) {
                status = fail("converted bits differ", size, base, n);
                break;
            }
        }
        if (n > 0 && !(st.sumexp >= 1.0 && st.sumexp <= (double)n + 1e-3))
            status = fail("sumexp outside [1, n]", size, base, n);
    }
    free(src);
    free(dst);
    return status;
}

int main(void) {
    /* bounds: refused before any access (NULL pointers would crash if touched) */
    calexec_logits_stats st;
    const size_t huge = (size_t)-1;
    const size_t refused[][3] = {{5, 0, 4}, {4, 1, 4}, {0, 5, 4}, {huge, 2, 4}, {1, huge, 4},
                                 {2, huge - 1, 4}};
    for (size_t k = 0; k < sizeof refused / sizeof refused[0]; k++)
        if (calexec_bf16_logits(NULL, refused[k][2], refused[k][0], refused[k][1], NULL, huge, 0,
                                &st) != CALEXEC_LOGITS_EBOUNDS)
            return fail("out-of-bounds slice not refused", refused[k][2], refused[k][0],
                        refused[k][1]);
    if (calexec_bf16_logits(NULL, 8, 0, 4, NULL, 3, 0, &st) != CALEXEC_LOGITS_EDST)
        return fail("short destination not refused", 8, 0, 4);
    if (calexec_bf16_logits(NULL, 0, 0, 0, NULL, 0, 0, &st) != CALEXEC_LOGITS_OK || st.argmax != -1)
        return fail("empty slice", 0, 0, 0);
    if (calexec_bf16_logits(NULL, 4, 0, 1, NULL, 1,
                            CALEXEC_LOGITS_NOSTORE | CALEXEC_LOGITS_SUMEXP, &st)
        != CALEXEC_LOGITS_EFLAGS)
        return fail("NOSTORE with SUMEXP not refused", 4, 0, 1);
    if (calexec_bf16_logits(NULL, 4, 0, 1, NULL, 1, 0, NULL) != CALEXEC_LOGITS_ENULL)
        return fail("NULL stats", 4, 0, 1);
    for (int iter = 0; iter < 3000; iter++) {
        size_t size = (size_t)(next_u64() % 5000);
        size_t base = size ? (size_t)(next_u64() % (size + 1)) : 0;
        size_t n = (next_u64() & 1) ? size - base : (size_t)(next_u64() % (size - base + 1));
        if (one_case(size, base, n, iter & 1))
            return 1;
    }
    if (one_case(151936, 0, 151936, 0) || one_case(16 * 151936, 14 * 151936, 151936, 1))
        return 1;
    printf("native check: ok\n");
    return 0;
}
