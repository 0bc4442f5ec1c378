#ifndef CALRT_EMU_H
#define CALRT_EMU_H
#include <stdint.h>

/*
 * Emulator-only controls (prefix calrt_emu_). A vendor shim does not export these; the
 * Python driver detects their absence and reports Device.emu = None.
 *
 * Device config keys (calrt_device_open "key=value;..." and calrt_emu_set_knob):
 *   kv_blocks (default 4096), kv_block_size (256), max_seqs (64)   -- open-time only
 *   h2d_us, prefill_per_token_us, decode_us, d2h_us (0)            -- latency profile
 *   queue_depth (4: jobs queued or running per engine; more -> infer returns 17)
 *   overlap (CALRT_EMU_OVERLAP_*, default FULL; names none|dma|full accepted in config)
 *   kv_after_failed_wait (CALRT_EMU_KV_*, default UNCHANGED; unchanged|partial|unknown)
 *   reset_ccu_scope (JOBS), reset_config_scope (JOBS|CONFIG), reset_scope (JOBS|KV|CONFIG):
 *       bitmasks of CALRT_EMU_SCOPE_*, what each reset does
 *   dma_guard (1: checksum inputs/outputs to detect host writes in flight; fixed per job
 *       at infer(): flipping it affects only jobs submitted afterwards)
 *   stale_delay_us (1000: delay after a reset before a stale completion lands)
 *   stepped (0: device threads run by themselves; 1: only calrt_emu_step advances work)
 * set_knob: unknown key -> 5, bad value -> 4; in the device config string both -> 5 (the
 * configuration is invalid). All setters take effect for the next stage/job (dma_guard:
 * the next job submitted).
 *
 * Latency: each stage sleeps on an absolute CLOCK_MONOTONIC deadline (clock_nanosleep, the
 * engine threads' timer slack 1 ns): its modelled start plus its profile. A stage starts in
 * the model when the job is ready (infer(), then its previous stage's modelled end), its
 * engine's last stage ended, any resource the overlap rules made it wait for was released and
 * the stepped mode that held it ended, never after its thread started it (at the caller's step in stepped mode), and lasts
 * max(real work, profile) from there: a job completes at infer() + its stages' profiles,
 * whatever its engine thread's wake-up lateness (emu_stage_start_ns, emu_check.c).
 * compute = decode_us for decode graphs, prefill_per_token_us * cur_seq_len for prefill.
 */

/* Parallel-mode overlap of the two engines (spec section 14). */
typedef enum calrt_emu_overlap {
    CALRT_EMU_OVERLAP_NONE = 0, /* one job at a time on the whole device (H2D..signal) */
    CALRT_EMU_OVERLAP_DMA = 1,  /* H2D/D2H overlap, compute stages are exclusive */
    CALRT_EMU_OVERLAP_FULL = 2  /* engines are independent */
} calrt_emu_overlap;

/* What the device KV of the job's sequence holds after a failed job: an injected
 * DONE_CCU_EXCEPTION or an injected Wait failure (spec section 14). Natural CCU exceptions
 * (bad positions, KV rule violations) never touch the KV. */
typedef enum calrt_emu_kv_policy {
    CALRT_EMU_KV_UNCHANGED = 0, /* committed length = the job's past_len, states intact */
    CALRT_EMU_KV_PARTIAL = 1,   /* committed = past_len + cur/2, those states correct */
    CALRT_EMU_KV_UNKNOWN = 2    /* committed = past_len + k (seeded k in 0..cur), states
                                   after past_len corrupted: only a release/rewind is safe */
} calrt_emu_kv_policy;

typedef enum calrt_emu_scope {
    CALRT_EMU_SCOPE_JOBS = 1,   /* abort queued and running jobs (status ABORTED) */
    CALRT_EMU_SCOPE_KV = 2,     /* release every sequence (committed 0, reservation 0) */
    CALRT_EMU_SCOPE_CONFIG = 4  /* unconfigure the device */
} calrt_emu_scope;

/* Fault points. "Calls" are counted per point as noted; a fired fault counts in fired. */
typedef enum calrt_emu_fault_point {
    CALRT_EMU_FAULT_SUBMIT_RC = 0,         /* infer after validation returns rc (default 17) */
    CALRT_EMU_FAULT_WAIT_RC = 1,           /* Wait returns rc at once (default 13); KV of the
                                              job then follows kv_after_failed_wait */
    CALRT_EMU_FAULT_CCU_EXCEPTION = 2,     /* per accepted job: ends DONE_CCU_EXCEPTION */
    CALRT_EMU_FAULT_OUTPUT_NAN = 3,        /* per accepted job: one NaN in the valid row */
    CALRT_EMU_FAULT_OUTPUT_INF = 4,        /* per accepted job: one +Inf in the valid row */
    CALRT_EMU_FAULT_OUTPUT_SHORT = 5,      /* per accepted job: D2H writes half the bytes;
                                              calrt_outputbuf_valid_bytes reports it */
    CALRT_EMU_FAULT_HANG = 6,              /* per accepted job: compute never ends until a
                                              reset aborts it */
    CALRT_EMU_FAULT_STALE_COMPLETION = 7,  /* per accepted job: if a reset aborts it, its D2H
                                              still lands in its old host output
                                              stale_delay_us after the reset */
    CALRT_EMU_FAULT_UNKNOWN_CSR = 8,       /* set_csr returns 4 */
    CALRT_EMU_FAULT_CAN_ALLOCATE_FALSE = 9,/* can_allocate returns 0 */
    CALRT_EMU_FAULT_APPLY_FALSE = 10,      /* apply returns 0 (reservation unchanged) */
    CALRT_EMU_FAULT_MAP_FAIL = 11,         /* inputbuf/outputbuf map returns rc (default 24) */
    CALRT_EMU_FAULT_SLICE_FAIL = 12,       /* slice returns rc (default 14) */
    CALRT_EMU_FAULT_COUNT = 13
} calrt_emu_fault_point;

typedef enum calrt_emu_fault_mode {
    CALRT_EMU_MODE_OFF = 0,
    CALRT_EMU_MODE_NTH = 1,      /* fires once, on call number param (1-based, counted from set) */
    CALRT_EMU_MODE_EVERY_K = 2,  /* fires on calls k, 2k, 3k, ... (param = k >= 1) */
    CALRT_EMU_MODE_PROB = 3,     /* fires with probability param / 1e6, seeded PRNG: the same
                                    seed and call sequence fire on the same calls */
    CALRT_EMU_MODE_ALWAYS = 4
} calrt_emu_fault_mode;

/* Device stages of a job, in order. COMPUTE -> SIGNAL directly on a CCU exception. */
typedef enum calrt_emu_stage {
    CALRT_EMU_STAGE_NONE = 0,
    CALRT_EMU_STAGE_H2D = 1,
    CALRT_EMU_STAGE_COMPUTE = 2,
    CALRT_EMU_STAGE_D2H = 3,
    CALRT_EMU_STAGE_SIGNAL = 4,
    CALRT_EMU_STAGE_JOB = 5      /* calrt_emu_step: run the head job to its end */
} calrt_emu_stage;

/* What one calrt_emu_step call did. */
typedef enum calrt_emu_did {
    CALRT_EMU_DID_NOTHING = 0,   /* no job queued on the engine */
    CALRT_EMU_DID_H2D = 1,
    CALRT_EMU_DID_COMPUTE = 2,
    CALRT_EMU_DID_D2H = 3,
    CALRT_EMU_DID_SIGNAL = 4,    /* the job finished (also the result of a STAGE_JOB step) */
    CALRT_EMU_DID_HUNG = 5,      /* the head job hangs (fault) until a reset */
    CALRT_EMU_DID_BLOCKED = 6,   /* the other engine holds the resource (overlap knob) */
    CALRT_EMU_DID_STALE = 7      /* delivered one pending stale completion */
} calrt_emu_did;

typedef struct calrt_emu_counters {
    uint64_t jobs_submitted;
    uint64_t jobs_executed;          /* finished DONE */
    uint64_t ccu_exceptions;         /* finished DONE_CCU_EXCEPTION */
    uint64_t jobs_aborted;           /* discarded by resets */
    uint64_t resets_ccu;
    uint64_t resets_configuration;
    uint64_t resets_full;
    uint64_t dma_input_violations;   /* input region changed between infer() and H2D */
    uint64_t dma_output_violations;  /* output region changed between infer() and D2H */
    uint64_t stale_completions;      /* stale D2H writes delivered after a reset */
    uint64_t stale_pending;          /* stale D2H writes not delivered yet */
    uint64_t hangs;                  /* jobs that hung */
} calrt_emu_counters;

int32_t calrt_emu_set_latency(calrt_device *dev, int64_t h2d_us, int64_t prefill_per_token_us,
                              int64_t decode_us, int64_t d2h_us);
int32_t calrt_emu_set_knob(calrt_device *dev, const char *key, int64_t value);
int32_t calrt_emu_get_knob(calrt_device *dev, const char *key, int64_t *value);

/* Arm a fault point: resets its call counter and PRNG (seed). rc is the code returned by the
 * SUBMIT_RC/WAIT_RC/MAP_FAIL/SLICE_FAIL points (0 = the point's default). 4 bad point, mode,
 * or param (NTH/EVERY_K need param >= 1, PROB param <= 1000000). */
int32_t calrt_emu_fault_set(calrt_device *dev, int32_t point, int32_t mode, uint64_t param,
                            uint64_t seed, int32_t rc);
int32_t calrt_emu_fault_clear(calrt_device *dev, int32_t point);
/* Calls counted and faults fired at a point since it was last set (fired survives clear). */
int32_t calrt_emu_fault_stats(calrt_device *dev, int32_t point, uint64_t *calls, uint64_t *fired);

/* Stepped mode: on != 0 stops the device threads from advancing work by themselves; it
 * returns once the stage a device thread was in has finished (at most that stage's latency),
 * so the caller's next calrt_emu_step owns the engine. 18 if the device closes meanwhile. */
int32_t calrt_emu_set_stepped(calrt_device *dev, int32_t on);
/* Advance engine in the caller's thread: what is a calrt_emu_stage (NONE = the next stage,
 * a named stage = that stage only if it is next, else 4; JOB = until the head job is
 * signalled). A pending stale completion is delivered first (did = STALE) regardless of its
 * delay. 4 when not in stepped mode or bad engine, 17 when another thread is stepping the
 * engine. *did is a calrt_emu_did. */
int32_t calrt_emu_step(calrt_device *dev, int32_t engine, int32_t what, int32_t *did);
/* Jobs queued or running on engine and the next stage of its head job (STAGE_NONE if none). */
int32_t calrt_emu_pending(calrt_device *dev, int32_t engine, int32_t *jobs, int32_t *next_stage);

int32_t calrt_emu_get_counters(calrt_device *dev, calrt_emu_counters *out);

/* Why the calling thread's last calrt_calbin_load refused its calbin (19) for a tensor dtype:
 * an unknown name, or not the dtype the emulator executes there (NUL-terminated, truncated
 * to cap; "" for any other outcome). 4 when out is NULL or cap is 0. */
int32_t calrt_emu_calbin_error(char *out, uint64_t cap);

/* UndoSlice-forgotten detection: number of tensors of buf with an active slice. */
int32_t calrt_emu_inputbuf_active_slices(calrt_inputbuf *buf, int32_t *count);

/* The measured H2D and D2H copy durations (ns) of the last job finished on buf (0: that
 * stage did not run, e.g. an aborted job); the host cannot time them on CalRT 0.7.6. */
int32_t calrt_emu_outputbuf_copy_ns(calrt_outputbuf *buf, int64_t *h2d_ns, int64_t *d2h_ns);

#endif
