/* calexec host-side native helpers (not part of the CalRT ABI; see drivers/native_build.py).
 *
 * calexec_bf16_logits: the fused logits postprocess of spec §10.1 / S10 / FI10. For the slice
 * src[base, base + n) of a BF16 tensor of `size` elements it, in one streaming pass over the
 * bytes (block by block, each block re-read only from L1):
 *   - writes the FP32 value of src[base + i] to dst[i] (a BF16 value is the top half of an
 *     FP32: the bits shifted left by 16, exact for every value incl. -0, denormals, Inf, NaN);
 *   - stops at the first NaN/Inf (exponent bits all ones) with CALEXEC_LOGITS_NONFINITE and
 *     its index in out->first_nonfinite (dst[:n] is then partly written: not a result);
 *   - out->argmax: the index within the slice of the first maximum, the rule of np.argmax on
 *     the FP32 values (-0 == +0, first occurrence wins); out->max: that value;
 *   - with CALEXEC_LOGITS_SUMEXP in flags, out->sumexp: sum over the slice of exp(x - max),
 *     accumulated in double per block (relative error about 1e-6: what sampling and
 *     logprobs need, not bit-reproducible across machines);
 *   - with CALEXEC_LOGITS_NOSTORE in flags, dst is not written (its arguments are checked as
 *     always): the finiteness check, argmax and max alone, reading only the BF16 bytes (half
 *     the memory traffic; greedy ahead's token, with the conversion done later by a second
 *     call without the flag, which answers the same). NOSTORE with SUMEXP (the sum reads the
 *     FP32 values) is refused with CALEXEC_LOGITS_EFLAGS before anything is read.
 * Bounds (§10.1): refused with CALEXEC_LOGITS_EBOUNDS unless base <= size and n <= size - base
 * (no overflow), with CALEXEC_LOGITS_EDST unless n <= dst_len; nothing is read or written
 * then. n == 0 is valid: argmax -1, max -Inf, sumexp 0. No allocation, no global state,
 * thread-safe; needs no GIL (cffi releases it around the call).
 */
#ifndef CALEXEC_NATIVE_H
#define CALEXEC_NATIVE_H

#include <stddef.h>
#include <stdint.h>

enum calexec_logits_rc {
    CALEXEC_LOGITS_OK = 0,
    CALEXEC_LOGITS_EBOUNDS = 1,
    CALEXEC_LOGITS_EDST = 2,
    CALEXEC_LOGITS_NONFINITE = 3,
    CALEXEC_LOGITS_ENULL = 4,
    CALEXEC_LOGITS_EFLAGS = 5
};

enum calexec_logits_flags {
    CALEXEC_LOGITS_SUMEXP = 1,
    CALEXEC_LOGITS_NOSTORE = 2
};

typedef struct calexec_logits_stats {
    int64_t argmax;
    int64_t first_nonfinite;
    float max;
    double sumexp;
} calexec_logits_stats;

int calexec_bf16_logits(const uint16_t *src, size_t size, size_t base, size_t n, float *dst,
                        size_t dst_len, unsigned int flags, calexec_logits_stats *out);

#endif
