/*
 * CalRT emulator, device side: the engine threads and the stages of a job (H2D, compute,
 * D2H, signal), the synthetic Qwen3 model, the DMA guard, fault firing and stale
 * completions. See emu_internal.h for the locking rules.
 *
 * Synthetic model (drivers/synthetic/oracle.py is its numpy twin and must match bit for bit):
 *   sm(z)            splitmix64 finaliser
 *   mix(s, tok, pos) = sm(s ^ u32(tok) * 0x9E3779B97F4A7C15 ^ u32(pos) * 0xC2B2AE3D27D4EB4F
 *                        ^ 0xD1B54A32D192ED03)
 *   state at length 0 = sm(calbin_seed); state after position p = mix(state, token_p, p)
 *   logits(s)[i]     = bf16((b - 128) / 32) with b = ((s ^ i * 0x9E37..) * 0xD6E8FEB86659FD93) >> 56,
 *                      except logits(s)[s % V] = 8.0 (0x4100), the unique argmax
 *   (a model's salt is XORed into the state before logits; 0 except for the decoy graph)
 *   embeds token of a row = fnv1a32 of the row's BF16 bytes
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "emu_internal.h"

#ifdef __linux__
#include <sys/prctl.h>
#endif

uint64_t emu_sm(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

uint64_t emu_mix(uint64_t state, int32_t token, uint32_t pos)
{
    return emu_sm(state ^ ((uint64_t)(uint32_t)token * EMU_V_MUL) ^
                  ((uint64_t)pos * 0xC2B2AE3D27D4EB4FULL) ^ 0xD1B54A32D192ED03ULL);
}

static uint32_t fnv1a32(const uint8_t *p, uint64_t n)
{
    uint32_t h = 0x811C9DC5u;
    for (uint64_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x01000193u;
    }
    return h;
}

/* Fletcher-style sum over 64-bit words (order-sensitive, cheap): detects host writes. */
uint64_t emu_checksum(const void *p, uint64_t n)
{
    const uint8_t *b = (const uint8_t *)p;
    uint64_t s1 = 0x9E3779B97F4A7C15ULL, s2 = n;
    uint64_t words = n / 8;
    for (uint64_t i = 0; i < words; i++) {
        uint64_t w;
        memcpy(&w, b + 8 * i, 8);
        s1 += w;
        s2 += s1;
    }
    for (uint64_t i = words * 8; i < n; i++) {
        s1 += b[i];
        s2 += s1;
    }
    return s1 ^ emu_sm(s2);
}

int64_t emu_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t emu_stage_start_ns(int64_t ready_ns, int64_t engine_free_ns, int64_t resource_free_ns, int64_t now_ns,
                           int stepped)
{
    if (stepped)
        return now_ns; /* the caller's step is the stage's start */
    int64_t start = ready_ns;
    if (engine_free_ns > start)
        start = engine_free_ns;
    if (resource_free_ns > start)
        start = resource_free_ns;
    return start < now_ns ? start : now_ns;
}

int64_t emu_stage_end_ns(int64_t start_ns, int64_t latency_ns, int64_t work_ns)
{
    if (latency_ns < 0)
        latency_ns = 0;
    return start_ns + (work_ns > latency_ns ? work_ns : latency_ns);
}

/* Sleep until an absolute CLOCK_MONOTONIC deadline; no syscall when it has passed (a
 * zero-latency profile must not pay the kernel's timer slack). */
static void sleep_until_ns(int64_t deadline)
{
    if (deadline <= emu_now_ns())
        return;
    struct timespec ts;
    ts.tv_sec = (time_t)(deadline / 1000000000LL);
    ts.tv_nsec = (long)(deadline % 1000000000LL);
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

static uint64_t rng_next(uint64_t *state)
{
    *state += EMU_V_MUL;
    return emu_sm(*state);
}

int emu_fault_fire(emu_device *dev, int point)
{
    emu_fault *f = &dev->faults[point];
    int fire = 0;
    if (f->mode == CALRT_EMU_MODE_OFF)
        return 0;
    f->calls++;
    switch (f->mode) {
    case CALRT_EMU_MODE_NTH: fire = f->calls == f->param; break;
    case CALRT_EMU_MODE_EVERY_K: fire = f->calls % f->param == 0; break;
    case CALRT_EMU_MODE_PROB: fire = rng_next(&f->rng) % 1000000u < f->param; break;
    case CALRT_EMU_MODE_ALWAYS: fire = 1; break;
    default: break;
    }
    if (fire)
        f->fired++;
    return fire;
}

/* The tight loop of the device: one BF16 logits row of state s. It vectorises at -O3; the
 * clones let x86-64 use AVX2/AVX-512 64-bit multiplies when the CPU has them (not under
 * sanitizers: their runtime is not ready when the ifunc resolver runs). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__) && \
    !defined(__SANITIZE_ADDRESS__)
__attribute__((target_clones("avx512f", "avx2", "default")))
#endif
static void fill_logits(uint16_t *restrict row, uint64_t s, uint64_t vocab)
{
    for (uint64_t i = 0; i < vocab; i++) {
        uint64_t x = (s ^ (i * EMU_V_MUL)) * 0xD6E8FEB86659FD93ULL;
        float f = (float)((int32_t)(x >> 56) - 128) * 0.03125f;
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        row[i] = (uint16_t)(bits >> 16);
    }
    row[s % vocab] = 0x4100;
}

int emu_seq_reserve_states(emu_seq *s, uint32_t len)
{
    if (len + 1 <= s->cap)
        return 1;
    uint32_t cap = s->cap ? s->cap : 64;
    while (cap < len + 1)
        cap *= 2;
    uint64_t *p = (uint64_t *)realloc(s->states, (size_t)cap * sizeof *p);
    if (!p)
        return 0;
    s->states = p;
    s->cap = cap;
    return 1;
}

void emu_kv_fail_policy(emu_device *dev, emu_kv *kv, int32_t seq, uint32_t past, uint32_t cur)
{
    emu_seq *s = &kv->seqs[seq];
    uint32_t target = past;
    if (dev->k.kv_after_failed_wait == CALRT_EMU_KV_PARTIAL)
        target = past + cur / 2;
    else if (dev->k.kv_after_failed_wait == CALRT_EMU_KV_UNKNOWN)
        target = past + (uint32_t)(rng_next(&dev->kv_rng) % ((uint64_t)cur + 1));
    if (s->committed > target)
        s->committed = target;
    if (dev->k.kv_after_failed_wait == CALRT_EMU_KV_UNKNOWN)
        for (uint32_t p = past + 1; p <= s->committed; p++)
            s->states[p] ^= 0xA5A5A5A5DEADBEEFULL;
}

void emu_job_free(emu_job *job)
{
    free(job->staging);
    free(job);
}

void emu_job_finish(emu_device *dev, emu_job *job, int32_t status)
{
    emu_outbuf *ob = job->ob;
    ob->status = status;
    ob->valid_bytes = status == CALRT_JOB_DONE ? job->valid_bytes : 0;
    ob->job = NULL;
    ob->last_kv_serial = job->kv->serial;
    ob->last_seq = job->seq;
    ob->last_past = job->past;
    ob->last_cur = job->cur;
    ob->last_h2d_ns = job->h2d_ns;
    ob->last_d2h_ns = job->d2h_ns;
    job->ib->inflight--;
    job->kv->inflight--;
    if (status == CALRT_JOB_DONE)
        dev->c.jobs_executed++;
    else if (status == CALRT_JOB_DONE_CCU_EXCEPTION)
        dev->c.ccu_exceptions++;
    else
        dev->c.jobs_aborted++;
    if (dev->job_owner == job->engine) {
        dev->job_owner = -1;
        dev->job_free_ns = job->ready_ns;
    }
    if (dev->compute_owner == job->engine) {
        dev->compute_owner = -1;
        dev->compute_free_ns = job->ready_ns;
    }
    emu_job_free(job);
    pthread_cond_broadcast(&dev->done_cv);
    emu_wake_engines(dev);
}

/* The modelled start of engine e's head job's next stage, at `now` (dev->mu held): the
 * resource is the one the overlap rules made it wait for (may_start), or the end of the
 * stepped mode that held it. */
static int64_t stage_start(emu_device *dev, int e, const emu_job *job, int stage, int64_t now)
{
    int64_t resource = dev->resumed_ns; /* a device held in stepped mode ran nothing meanwhile */
    if (dev->k.overlap == CALRT_EMU_OVERLAP_NONE && stage == CALRT_EMU_STAGE_H2D && dev->job_free_ns > resource)
        resource = dev->job_free_ns;
    if (dev->k.overlap == CALRT_EMU_OVERLAP_DMA && stage == CALRT_EMU_STAGE_COMPUTE && dev->compute_free_ns > resource)
        resource = dev->compute_free_ns;
    return emu_stage_start_ns(job->ready_ns, dev->eng[e].free_ns, resource, now, dev->k.stepped != 0);
}

/* A stage of engine e's job ended at `end` in the model (dev->mu held). */
static void stage_ended(emu_device *dev, int e, emu_job *job, int64_t end)
{
    job->ready_ns = end;
    dev->eng[e].free_ns = end;
}

/* Leave the lock for stage work; the caller re-enters with stage_leave. */
static void stage_enter(emu_device *dev, int e)
{
    dev->eng[e].in_stage = 1;
    pthread_mutex_unlock(&dev->mu);
}

static void stage_leave(emu_device *dev, int e)
{
    pthread_mutex_lock(&dev->mu);
    dev->eng[e].in_stage = 0;
    pthread_cond_broadcast(&dev->stage_cv);
    emu_wake_engines(dev); /* a blocked engine or a due stale completion */
}

/* Deliver the first pending stale completion; dev->mu held throughout. Only between
 * stages (no engine touching host memory), so the stale DMA cannot interleave with a
 * running job's or with infer()'s DMA guard. Returns 1 when one was delivered. */
int emu_deliver_ghost_locked(emu_device *dev)
{
    emu_ghost *g = dev->ghosts;
    if (!g)
        return 0;
    for (int e = 0; e < NUM_ENGINES; e++)
        if (dev->eng[e].in_stage)
            return 0;
    dev->ghosts = g->next;
    memcpy(g->host, g->data, g->size);
    dev->c.stale_completions++;
    dev->c.stale_pending--;
    free(g->data);
    free(g);
    return 1;
}

static void stage_h2d(emu_device *dev, int e, emu_job *job)
{
    int64_t now = emu_now_ns();
    int64_t start = stage_start(dev, e, job, CALRT_EMU_STAGE_H2D, now);
    int64_t latency = dev->k.h2d_us * 1000;
    int guard = job->guard; /* as at infer(), not the knob now */
    int violated = 0;
    job->ob->status = CALRT_JOB_RUNNING;
    stage_enter(dev, e);
    uint64_t off = 0;
    for (int i = 0; i < 2; i++) {
        memcpy(job->staging + off, job->in_host[i], job->in_bytes[i]);
        if (guard && emu_checksum(job->staging + off, job->in_bytes[i]) != job->in_sum[i])
            violated = 1;
        off += job->in_bytes[i];
    }
    int64_t end = emu_stage_end_ns(start, latency, emu_now_ns() - now);
    sleep_until_ns(start + latency);
    stage_leave(dev, e);
    stage_ended(dev, e, job, end);
    job->h2d_ns = end - start > 0 ? end - start : 1;
    if (violated)
        dev->c.dma_input_violations++;
    job->stage = CALRT_EMU_STAGE_COMPUTE;
}

static int32_t job_token(const emu_job *job, uint32_t i)
{
    if (job->m->kind == KIND_PREFILL_EMBEDS) {
        uint64_t row = job->m->hidden * 2;
        return (int32_t)fnv1a32(job->staging + (uint64_t)i * row, row);
    }
    int32_t t;
    memcpy(&t, job->staging + 4ull * i, 4);
    return t;
}

static int32_t job_position(const emu_job *job, uint32_t i)
{
    int32_t p;
    memcpy(&p, job->staging + job->in_bytes[0] + 4ull * i, 4);
    return p;
}

/* Compute: check the device rules, run the state chain and the logits tile into devmem,
 * commit KV. Returns the job's result status. */
static void stage_compute(emu_device *dev, int e, emu_job *job)
{
    emu_model *m = job->m;
    emu_kv *kv = job->kv;
    emu_seq *s = &kv->seqs[job->seq];
    int64_t per = m->kind == KIND_DECODE ? dev->k.decode_us : dev->k.prefill_per_token_us * job->cur;
    int64_t now = emu_now_ns();
    int64_t start = stage_start(dev, e, job, CALRT_EMU_STAGE_COMPUTE, now);
    int64_t latency = per * 1000;
    uint32_t end = job->past + job->cur;
    int ok = job->past <= s->committed && (uint64_t)end <= (uint64_t)s->reserved_blocks * kv->block_size;
    for (uint32_t i = 0; ok && i < job->cur; i++)
        ok = job_position(job, i) == (int32_t)(job->past + i);
    uint64_t *chain = ok ? (uint64_t *)malloc(((size_t)job->cur + 1) * sizeof *chain) : NULL;
    if (!chain)
        ok = 0;
    else
        chain[0] = s->states[job->past];
    stage_enter(dev, e);
    if (ok) {
        for (uint32_t i = 0; i < job->cur; i++)
            chain[i + 1] = emu_mix(chain[i], job_token(job, i), job->past + i);
        uint64_t d0 = m->out[0].shape[1], vocab = m->vocab;
        uint64_t tile = ((uint64_t)(job->cur - 1) / d0) * d0;
        uint16_t *out = (uint16_t *)job->ob->devmem;
        memset(out, 0, m->out[0].byte_size);
        job->ob->devmem_written = 1;
        for (uint64_t r = 0; r < d0 && tile + r < job->cur; r++)
            fill_logits(out + r * vocab, chain[tile + r + 1] ^ m->salt, vocab);
        uint64_t vrow = (uint64_t)(job->cur - 1) % d0;
        uint64_t bad = ((chain[job->cur] ^ m->salt) % vocab + 1) % vocab;
        if (job->f_nan)
            out[vrow * vocab + bad] = 0x7FC0;
        if (job->f_inf)
            out[vrow * vocab + bad] = 0x7F80;
    }
    int64_t done = emu_stage_end_ns(start, latency, emu_now_ns() - now);
    sleep_until_ns(start + latency);
    stage_leave(dev, e);
    stage_ended(dev, e, job, done);
    if (ok && emu_seq_reserve_states(s, end)) {
        memcpy(s->states + job->past + 1, chain + 1, (size_t)job->cur * sizeof *chain);
        s->committed = end;
        if (job->f_ccu || job->kv_failed)
            emu_kv_fail_policy(dev, kv, job->seq, job->past, job->cur);
        job->result = job->f_ccu ? CALRT_JOB_DONE_CCU_EXCEPTION : CALRT_JOB_DONE;
    } else {
        job->result = CALRT_JOB_DONE_CCU_EXCEPTION;
    }
    free(chain);
    job->computed = 1;
    if (dev->compute_owner == e) {
        dev->compute_owner = -1;
        dev->compute_free_ns = done;
        emu_wake_engines(dev);
    }
    job->stage = job->result == CALRT_JOB_DONE ? CALRT_EMU_STAGE_D2H : CALRT_EMU_STAGE_SIGNAL;
}

static void stage_d2h(emu_device *dev, int e, emu_job *job)
{
    int64_t now = emu_now_ns();
    int64_t start = stage_start(dev, e, job, CALRT_EMU_STAGE_D2H, now);
    int64_t latency = dev->k.d2h_us * 1000;
    int guard = job->guard; /* as at infer(), not the knob now */
    uint64_t size = job->m->out[0].byte_size;
    uint64_t valid = job->f_short ? (size / 2) & ~1ull : size;
    int violated = 0;
    emu_outbuf *ob = job->ob;
    stage_enter(dev, e);
    if (guard && emu_checksum(ob->map.host, size) != job->out_sum)
        violated = 1;
    memcpy(ob->map.host, ob->devmem, valid);
    int64_t end = emu_stage_end_ns(start, latency, emu_now_ns() - now);
    sleep_until_ns(start + latency);
    stage_leave(dev, e);
    stage_ended(dev, e, job, end);
    job->d2h_ns = end - start > 0 ? end - start : 1;
    if (violated)
        dev->c.dma_output_violations++;
    job->valid_bytes = valid;
    job->stage = CALRT_EMU_STAGE_SIGNAL;
}

/* Overlap rules of parallel mode: may engine e start its head job's next stage now? */
static int may_start(emu_device *dev, int e, int stage)
{
    if (dev->k.overlap == CALRT_EMU_OVERLAP_NONE && stage == CALRT_EMU_STAGE_H2D) {
        if (dev->job_owner != -1 && dev->job_owner != e)
            return 0;
        dev->job_owner = e;
    }
    if (dev->k.overlap == CALRT_EMU_OVERLAP_DMA && stage == CALRT_EMU_STAGE_COMPUTE) {
        if (dev->compute_owner != -1 && dev->compute_owner != e)
            return 0;
        dev->compute_owner = e;
    }
    return 1;
}

static void pop_head(emu_engine *eng)
{
    emu_job *job = eng->head;
    eng->head = job->next;
    if (!eng->head)
        eng->tail = NULL;
    eng->count--;
}

int32_t emu_engine_advance(emu_device *dev, int e, int what, int32_t *did)
{
    emu_engine *eng = &dev->eng[e];
    *did = CALRT_EMU_DID_NOTHING;
    for (;;) {
        if (dev->closing)
            return CALRT_ERR_DEVICE_UNAVAILABLE;
        if (eng->in_stage)
            return CALRT_ERR_DEVICE_BUSY;
        emu_job *job = eng->head;
        if (!job)
            return CALRT_SUCCESS;
        int stage = job->stage;
        if (what != CALRT_EMU_STAGE_NONE && what != CALRT_EMU_STAGE_JOB && what != stage)
            return CALRT_ERR_INVALID_VALUE;
        if (!may_start(dev, e, stage)) {
            *did = CALRT_EMU_DID_BLOCKED;
            return CALRT_SUCCESS;
        }
        if (stage == CALRT_EMU_STAGE_COMPUTE && job->f_hang) {
            /* A hung CCU keeps the compute resource (overlap DMA) until a reset. */
            if (!job->hang_counted) {
                job->hang_counted = 1;
                dev->c.hangs++;
            }
            *did = CALRT_EMU_DID_HUNG;
            return CALRT_SUCCESS;
        }
        switch (stage) {
        case CALRT_EMU_STAGE_H2D: stage_h2d(dev, e, job); *did = CALRT_EMU_DID_H2D; break;
        case CALRT_EMU_STAGE_COMPUTE: stage_compute(dev, e, job); *did = CALRT_EMU_DID_COMPUTE; break;
        case CALRT_EMU_STAGE_D2H: stage_d2h(dev, e, job); *did = CALRT_EMU_DID_D2H; break;
        default:
            pop_head(eng);
            emu_job_finish(dev, job, job->result);
            *did = CALRT_EMU_DID_SIGNAL;
            return CALRT_SUCCESS;
        }
        if (what != CALRT_EMU_STAGE_JOB)
            return CALRT_SUCCESS;
        /* A reset may have aborted the job while the lock was released. */
        if (eng->head != job)
            return CALRT_SUCCESS;
    }
}

static void *engine_main(void *arg)
{
    emu_engine *eng = (emu_engine *)arg;
    emu_device *dev = eng->dev;
    int e = eng->index;
#ifdef __linux__
    /* Latency profiles sleep on absolute deadlines: do not let the default 50 us timer
     * slack skew them. */
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
    /* Named, so top -H, py-spy and `calexec bench server`'s CPU per thread tell the
     * emulated device's engines from the host's threads (at most 15 characters). */
    char name[16];
    snprintf(name, sizeof name, "calrt-emu-e%d", e & 0xff);
    prctl(PR_SET_NAME, (unsigned long)name, 0UL, 0UL, 0UL);
#endif
    pthread_mutex_lock(&dev->mu);
    eng->up = 1;
    pthread_cond_broadcast(&dev->stage_cv);
    while (!dev->closing) {
        if (e == 0 && dev->ghosts && !dev->k.stepped && dev->ghosts->due_ns <= emu_now_ns() &&
            emu_deliver_ghost_locked(dev))
            continue;
        int32_t did = CALRT_EMU_DID_NOTHING;
        if (!dev->k.stepped && eng->head && !eng->in_stage)
            emu_engine_advance(dev, e, CALRT_EMU_STAGE_NONE, &did);
        if (did != CALRT_EMU_DID_NOTHING && did != CALRT_EMU_DID_HUNG && did != CALRT_EMU_DID_BLOCKED)
            continue;
        if (e == 0 && dev->ghosts && !dev->k.stepped && dev->ghosts->due_ns > emu_now_ns()) {
            struct timespec ts;
            ts.tv_sec = (time_t)(dev->ghosts->due_ns / 1000000000LL);
            ts.tv_nsec = (long)(dev->ghosts->due_ns % 1000000000LL);
            pthread_cond_timedwait(&eng->cv, &dev->mu, &ts);
        } else {
            pthread_cond_wait(&eng->cv, &dev->mu);
        }
    }
    pthread_mutex_unlock(&dev->mu);
    return NULL;
}

void emu_wake_engines(emu_device *dev)
{
    for (int e = 0; e < NUM_ENGINES; e++)
        if (dev->closing || dev->eng[e].head || (e == 0 && dev->ghosts))
            pthread_cond_broadcast(&dev->eng[e].cv);
}

int emu_engine_start(emu_device *dev, int e)
{
    emu_engine *eng = &dev->eng[e];
    eng->dev = dev;
    eng->index = e;
    if (pthread_create(&eng->thread, NULL, engine_main, eng) != 0)
        return 0;
    eng->started = 1;
    return 1;
}
