/*
 * Internal structures of the CalRT emulator, shared by emulator.c (the API surface:
 * handles, objects, validation, KV, resets), emu_controls.c (calrt_emu_ controls) and
 * emu_engine.c (device threads, stages, the synthetic Qwen3 model, faults).
 *
 * Locking: g_reg_mu (handle registry) -> dev->mu. Every object belongs to one device and
 * all of its mutable state is guarded by dev->mu. Stage work that touches host memory or
 * runs the model is done with dev->mu released while eng->in_stage is set; resets and close
 * wait for in_stage to clear, and buffers/KV referenced by a queued job cannot be destroyed,
 * so a stage never touches freed memory.
 */
#ifndef CALRT_EMU_INTERNAL_H
#define CALRT_EMU_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "calrt.h"
#include "calrt_emu.h"

enum { OBJ_DEVICE = 1, OBJ_CALBIN, OBJ_MODEL, OBJ_INBUF, OBJ_OUTBUF, OBJ_KV };
enum { KIND_PREFILL_IDS = 1, KIND_PREFILL_EMBEDS, KIND_DECODE };
enum { MAX_MODELS = 16, MAX_TENSORS = 8, MAX_CSRS = 8, MAX_META = 16, NUM_ENGINES = 2 };
enum { CSR_CUR = 0, CSR_TOTAL = 1 };

#define EMU_V_MUL 0x9E3779B97F4A7C15ULL

struct emu_device;

typedef struct emu_obj {
    uint32_t type;
    struct emu_device *dev;
    uint64_t handle;
} emu_obj;

typedef struct emu_tensor {
    char name[CALRT_NAME_MAX];
    int32_t dtype;
    int32_t rank;
    uint64_t shape[CALRT_MAX_RANK];
    uint64_t elems;
    uint64_t elem_size;
    uint64_t byte_size;
    uint64_t row_elems; /* elements per sequence row (product of dims after axis 1) */
    int32_t sliceable;
} emu_tensor;

struct emu_calbin;

typedef struct emu_model {
    emu_obj h;
    struct emu_calbin *cb;
    char name[CALRT_NAME_MAX];
    int kind;
    uint64_t salt;
    int n_in, n_out, n_csr, n_meta;
    emu_tensor in[MAX_TENSORS], out[MAX_TENSORS];
    char csr[MAX_CSRS][CALRT_NAME_MAX];
    int csr_role[MAX_CSRS]; /* CSR_CUR, CSR_TOTAL or -1 */
    char meta_key[MAX_META][CALRT_NAME_MAX];
    int64_t meta_val[MAX_META];
    int idx_tokens; /* input index of input_ids / inputs_embeds */
    int idx_pos;    /* input index of positions */
    uint64_t tile_d0, vocab, hidden, max_seq, rows; /* rows = token capacity per job */
} emu_model;

typedef struct emu_calbin {
    emu_obj h;
    uint64_t seed;
    int n_models;
    emu_model models[MAX_MODELS];
    struct emu_calbin *next;
} emu_calbin;

typedef struct emu_map {
    void *host;
    uint64_t size;
    int mapped;
    int sliced;
    uint64_t off, cnt; /* elements */
} emu_map;

typedef struct emu_inbuf {
    emu_obj h;
    emu_model *m;
    emu_map t[MAX_TENSORS];
    int csr_set[MAX_CSRS];
    int64_t csr_val[MAX_CSRS];
    int inflight;
    struct emu_inbuf *next;
} emu_inbuf;

struct emu_job;

typedef struct emu_outbuf {
    emu_obj h;
    emu_model *m;
    emu_map map;
    uint8_t *devmem; /* device-side output, byte_size bytes (not zero-filled: see below) */
    int devmem_written; /* a compute wrote devmem; until then it reads as zeros */
    int32_t status;
    uint64_t valid_bytes;
    struct emu_job *job; /* in flight, NULL when idle or finished */
    int waiters;
    /* the last job, for a Wait failure after it already executed */
    uint64_t last_kv_serial;
    int32_t last_seq;
    uint32_t last_past, last_cur;
    int64_t last_h2d_ns, last_d2h_ns; /* the last job's measured DMA copies, 0: not run */
    struct emu_outbuf *next;
} emu_outbuf;

typedef struct emu_seq {
    uint32_t committed;
    uint32_t reserved_blocks;
    uint32_t cap;    /* allocated entries of states */
    uint64_t *states; /* states[p] = state after p positions, p <= committed */
} emu_seq;

typedef struct emu_kv {
    emu_obj h;
    emu_calbin *cb;
    uint64_t serial;
    uint32_t block_size, capacity, free_blocks;
    int32_t max_seqs;
    emu_seq *seqs;
    int inflight;
} emu_kv;

typedef struct emu_job {
    uint64_t id;
    uint64_t epoch;
    int engine;
    int stage; /* next calrt_emu_stage */
    int result;
    emu_model *m;
    emu_kv *kv;
    int32_t seq;
    uint32_t past, cur;
    emu_inbuf *ib;
    emu_outbuf *ob;
    const uint8_t *in_host[2]; /* tokens/embeds region, positions region */
    uint64_t in_bytes[2];
    int guard; /* dma_guard at infer(): in_sum/out_sum exist only when it was on */
    uint64_t in_sum[2];
    uint64_t out_sum;
    uint8_t *staging; /* device copy of the inputs, in_bytes[0] + in_bytes[1] */
    int f_ccu, f_nan, f_inf, f_short, f_hang, f_stale;
    int hang_counted;
    int kv_failed; /* a Wait failure was reported before the job executed */
    uint64_t valid_bytes;
    int64_t h2d_ns, d2h_ns; /* measured H2D / D2H stage durations, 0: not run */
    int64_t ready_ns; /* when its next stage may start in the model: infer(), then the end of
                         each stage (emu_stage_start_ns) */
    int computed;
    struct emu_job *next;
} emu_job;

typedef struct emu_engine {
    struct emu_device *dev;
    int index;
    pthread_t thread;
    int started;
    int up; /* its thread runs (named, timer slack set): calrt_device_open waits for it */
    emu_job *head, *tail;
    int count;
    int in_stage;
    int64_t free_ns; /* when its last stage ended in the model */
    pthread_cond_t cv; /* its thread waits here for work (emu_wake_engines) */
} emu_engine;

typedef struct emu_ghost {
    void *host;
    uint64_t size;
    uint8_t *data;
    int64_t due_ns;
    struct emu_ghost *next;
} emu_ghost;

typedef struct emu_fault {
    int32_t mode;
    uint64_t param;
    uint64_t rng;
    int32_t rc;
    uint64_t calls;
    uint64_t fired;
} emu_fault;

typedef struct emu_knobs {
    int64_t h2d_us, prefill_per_token_us, decode_us, d2h_us;
    int64_t queue_depth, overlap, kv_after_failed_wait;
    int64_t reset_ccu_scope, reset_config_scope, reset_scope;
    int64_t dma_guard, stale_delay_us, stepped;
    int64_t kv_blocks, kv_block_size, max_seqs;
} emu_knobs;

typedef struct emu_device {
    emu_obj h;
    pthread_mutex_t mu;
    pthread_cond_t done_cv;  /* waiters: a job finished or was aborted */
    pthread_cond_t stage_cv; /* resets/close/steppers: a stage ended */
    emu_knobs k;
    int closing;
    int waiters; /* API calls blocked on a condition (Wait, resets): close waits for 0 */
    int parallel;
    emu_calbin *configured;
    emu_calbin *calbins;
    emu_inbuf *inbufs;
    emu_outbuf *outbufs;
    emu_kv *kv;
    uint64_t kv_serial;
    emu_engine eng[NUM_ENGINES];
    uint64_t epoch;
    uint64_t next_job_id;
    int job_owner;     /* OVERLAP_NONE: engine running a job, -1 free */
    int compute_owner; /* OVERLAP_DMA: engine computing, -1 free */
    int64_t job_free_ns, compute_free_ns; /* when the last owner's job / compute ended in the model */
    int64_t resumed_ns; /* when stepped mode last ended: a job it held starts no earlier */
    emu_ghost *ghosts;
    emu_fault faults[CALRT_EMU_FAULT_COUNT];
    uint64_t kv_rng;
    calrt_emu_counters c;
} emu_device;

typedef struct knob_def {
    const char *name;
    size_t offset;
    int64_t min, max;
    int open_only;
} knob_def;

/* emulator.c */
/* Look up a handle of the given OBJ_ type and lock its device; NULL if NULL/stale/wrong. */
void *emu_acquire(const void *h, uint32_t type);
int32_t emu_unlock_rc(emu_device *dev, int32_t rc); /* unlock dev->mu, return rc */
const knob_def *emu_knob_find(const char *key);
int64_t *emu_knob_ptr(emu_device *dev, const knob_def *k);
int emu_any_in_stage(emu_device *dev);
int emu_wait_out_of_stages(emu_device *dev); /* 0: closing (dev->mu held) */

/* emu_engine.c */
uint64_t emu_sm(uint64_t z);
uint64_t emu_mix(uint64_t state, int32_t token, uint32_t pos);
uint64_t emu_checksum(const void *p, uint64_t n);
int64_t emu_now_ns(void);
/* The modelled time of a stage (pure arithmetic, checked by emu_check.c). A stage starts in
 * the model at the latest of: the job's previous stage's modelled end (infer() for H2D), the
 * engine's last stage's modelled end, and the modelled end of the stage of another engine whose
 * release it waited for (overlap rules) or of the stepped mode that held it; never after `now`, when its thread started it, and at
 * `now` in stepped mode. It ends `max(latency, work)` after that start: the thread's wake-up
 * lateness is not the device's time. */
int64_t emu_stage_start_ns(int64_t ready_ns, int64_t engine_free_ns, int64_t resource_free_ns, int64_t now_ns,
                           int stepped);
int64_t emu_stage_end_ns(int64_t start_ns, int64_t latency_ns, int64_t work_ns);
int emu_fault_fire(emu_device *dev, int point); /* dev->mu held */
int emu_engine_start(emu_device *dev, int e); /* 1 started, 0 failed */
/* Wake the engine threads that have something to do (dev->mu held): a job queued, a stale
 * completion (engine 0), the close. An idle engine is left asleep: every job used to wake
 * both engines at each stage, the idle one's wake-ups a host thread's CPU no device costs. */
void emu_wake_engines(emu_device *dev);
/* Run one step on engine e with dev->mu held (released during stage work). */
int32_t emu_engine_advance(emu_device *dev, int e, int what, int32_t *did);
void emu_job_finish(emu_device *dev, emu_job *job, int32_t status);
void emu_job_free(emu_job *job);
void emu_kv_fail_policy(emu_device *dev, emu_kv *kv, int32_t seq, uint32_t past, uint32_t cur);
int emu_seq_reserve_states(emu_seq *s, uint32_t len);
int emu_deliver_ghost_locked(emu_device *dev);

#endif
