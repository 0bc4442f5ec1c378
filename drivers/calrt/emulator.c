/*
 * CalRT emulator, API side: generation-checked handles, devices, calbins and models,
 * buffers, the KV manager, infer/Wait validation and resets. The calrt_emu_ controls are
 * in emu_controls.c, the device threads and the job stages in emu_engine.c.
 *
 * Calbin file format (text, UTF-8, '\n' line ends; written by drivers/synthetic/calbin.py):
 *   CALBIN 1                              header, exactly (else FILE_FORMAT)
 *   seed <u64>                            initial state of every sequence is sm(seed)
 *   model <name> <kind>                   kind: prefill_ids | prefill_embeds | decode
 *   salt <u64>                            optional, XORed into the state before logits
 *   meta <key> <i64>                      graph metadata (logits_tile_d0, max_seq, ...)
 *   input <name> <dtype> <sliceable 0|1> <d0,d1,...>
 *   output <name> <dtype> 0 <d0,d1,...>
 *   csr <name>
 *   end                                   closes the model
 * Anything else, or a model breaking the Qwen3 contract the emulator executes, is
 * INVALID_CALBIN.
 */
#define _POSIX_C_SOURCE 200809L

#include <ctype.h>
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "emu_internal.h"

/* ---- handle registry ----------------------------------------------------------------- */

enum { REG_SLOTS = 1 << 16 };

typedef struct reg_slot {
    uint32_t gen;
    uint32_t type;
    void *obj;
} reg_slot;

static pthread_mutex_t g_reg_mu = PTHREAD_MUTEX_INITIALIZER;
static reg_slot g_slots[REG_SLOTS];
static uint32_t g_free[REG_SLOTS];
static uint32_t g_nfree, g_used;

/* fork(): a child forked while another thread of the parent held the registry (a Wait, an
 * infer, a buffer's map: every call resolves its handles under g_reg_mu) found it locked for
 * good, its holder not being in the child: the child's first device open hung (a pre-fork
 * server, a multiprocessing fork, an executor built in a forked child). The fork takes the
 * registry first; parent and child let it go after it. */
static void reg_prefork(void)
{
    pthread_mutex_lock(&g_reg_mu);
}

static void reg_postfork(void)
{
    pthread_mutex_unlock(&g_reg_mu);
}

__attribute__((constructor)) static void reg_atfork(void)
{
    pthread_atfork(reg_prefork, reg_postfork, reg_postfork);
}

/* Register obj (g_reg_mu held); its handle goes to obj->handle. 0 when the table is full. */
static int reg_add(emu_obj *obj)
{
    uint32_t idx;
    if (g_nfree)
        idx = g_free[--g_nfree];
    else if (g_used < REG_SLOTS)
        idx = g_used++;
    else
        return 0;
    reg_slot *s = &g_slots[idx];
    if (s->gen == 0)
        s->gen = 1;
    s->type = obj->type;
    s->obj = obj;
    obj->handle = ((uint64_t)s->gen << 32) | ((uint64_t)obj->type << 24) | idx;
    return 1;
}

static void *reg_get(const void *h, uint32_t type)
{
    uint64_t v = (uint64_t)(uintptr_t)h;
    uint32_t idx = (uint32_t)(v & 0xFFFFFFu);
    if (!h || idx >= g_used || ((v >> 24) & 0xFFu) != type)
        return NULL;
    reg_slot *s = &g_slots[idx];
    if (!s->obj || s->type != type || s->gen != (uint32_t)(v >> 32))
        return NULL;
    return s->obj;
}

static void reg_remove(emu_obj *obj)
{
    uint32_t idx = (uint32_t)(obj->handle & 0xFFFFFFu);
    reg_slot *s = &g_slots[idx];
    s->obj = NULL;
    s->gen = s->gen + 1 ? s->gen + 1 : 1;
    g_free[g_nfree++] = idx;
}

/* Look up a handle and lock its device; NULL for NULL/stale/wrong-type handles. */
void *emu_acquire(const void *h, uint32_t type)
{
    pthread_mutex_lock(&g_reg_mu);
    emu_obj *o = (emu_obj *)reg_get(h, type);
    if (o)
        pthread_mutex_lock(&o->dev->mu);
    pthread_mutex_unlock(&g_reg_mu);
    return o;
}

int32_t emu_unlock_rc(emu_device *dev, int32_t rc)
{
    pthread_mutex_unlock(&dev->mu);
    return rc;
}

/* Look up a handle and lock its device, keeping the registry locked, for a destroy that removes
 * the handle; NULL (and nothing held) for NULL/stale/wrong-type handles. destroy_done lets go. */
static void *acquire_for_destroy(const void *h, uint32_t type)
{
    pthread_mutex_lock(&g_reg_mu);
    emu_obj *o = (emu_obj *)reg_get(h, type);
    if (!o) {
        pthread_mutex_unlock(&g_reg_mu);
        return NULL;
    }
    pthread_mutex_lock(&o->dev->mu);
    return o;
}

/* The end of a destroy begun by acquire_for_destroy: busy (the object is in use) refuses it. */
static int32_t destroy_done(emu_device *dev, int busy)
{
    pthread_mutex_unlock(&g_reg_mu);
    return emu_unlock_rc(dev, busy ? CALRT_ERR_DEVICE_BUSY : CALRT_SUCCESS);
}

/* Take node out of the singly linked list whose first pointer is head (a no-op when absent). */
#define LIST_UNLINK(type, head, node)                            \
    do {                                                         \
        for (type **pp_ = &(head); *pp_; pp_ = &(*pp_)->next)    \
            if (*pp_ == (node)) {                                \
                *pp_ = (node)->next;                             \
                break;                                           \
            }                                                    \
    } while (0)

/* ---- knobs and config ------------------------------------------------------------------ */

#define KNOB(field, lo, hi, open) { #field, offsetof(emu_knobs, field), lo, hi, open }
static const knob_def k_knobs[] = {
    KNOB(h2d_us, 0, 60000000, 0),
    KNOB(prefill_per_token_us, 0, 60000000, 0),
    KNOB(decode_us, 0, 60000000, 0),
    KNOB(d2h_us, 0, 60000000, 0),
    KNOB(queue_depth, 1, 1024, 0),
    KNOB(overlap, 0, 2, 0),
    KNOB(kv_after_failed_wait, 0, 2, 0),
    KNOB(reset_ccu_scope, 0, 7, 0),
    KNOB(reset_config_scope, 0, 7, 0),
    KNOB(reset_scope, 0, 7, 0),
    KNOB(dma_guard, 0, 1, 0),
    KNOB(stale_delay_us, 0, 60000000, 0),
    KNOB(stepped, 0, 1, 0),
    KNOB(kv_blocks, 1, 1 << 24, 1),
    KNOB(kv_block_size, 1, 1 << 20, 1),
    KNOB(max_seqs, 1, 4096, 1),
};
#undef KNOB

/* Enum names accepted in the config string: overlap (first three), kv_after_failed_wait. */
static const char *const k_names[] = {"none", "dma", "full", "unchanged", "partial", "unknown"};

const knob_def *emu_knob_find(const char *key)
{
    for (size_t i = 0; key && i < sizeof k_knobs / sizeof k_knobs[0]; i++)
        if (strcmp(k_knobs[i].name, key) == 0)
            return &k_knobs[i];
    return NULL;
}

int64_t *emu_knob_ptr(emu_device *dev, const knob_def *k)
{
    return (int64_t *)((char *)&dev->k + k->offset);
}

static void knobs_default(emu_knobs *k)
{
    memset(k, 0, sizeof *k);
    k->queue_depth = 4;
    k->overlap = CALRT_EMU_OVERLAP_FULL;
    k->kv_after_failed_wait = CALRT_EMU_KV_UNCHANGED;
    k->reset_ccu_scope = CALRT_EMU_SCOPE_JOBS;
    k->reset_config_scope = CALRT_EMU_SCOPE_JOBS | CALRT_EMU_SCOPE_CONFIG;
    k->reset_scope = CALRT_EMU_SCOPE_JOBS | CALRT_EMU_SCOPE_KV | CALRT_EMU_SCOPE_CONFIG;
    k->dma_guard = 1;
    k->stale_delay_us = 1000;
    k->kv_blocks = 4096;
    k->kv_block_size = 256;
    k->max_seqs = 64;
}

/* Parse "key=value;..." into dev->k. */
static int32_t parse_config(emu_device *dev, const char *config)
{
    char buf[1024];
    if (!config)
        return CALRT_SUCCESS;
    if (strlen(config) >= sizeof buf)
        return CALRT_ERR_INVALID_CONFIG;
    strcpy(buf, config);
    char *save = NULL;
    for (char *item = strtok_r(buf, ";", &save); item; item = strtok_r(NULL, ";", &save)) {
        while (*item == ' ')
            item++;
        if (!*item)
            continue;
        char *eq = strchr(item, '=');
        if (!eq)
            return CALRT_ERR_INVALID_CONFIG;
        *eq = '\0';
        const knob_def *k = emu_knob_find(item);
        if (!k)
            return CALRT_ERR_INVALID_CONFIG;
        const char *val = eq + 1;
        int64_t v = -1;
        int first = strcmp(k->name, "overlap") == 0 ? 0 : strcmp(k->name, "kv_after_failed_wait") == 0 ? 3 : -1;
        for (int i = 0; first >= 0 && i < 3; i++)
            if (strcmp(val, k_names[first + i]) == 0)
                v = i;
        if (v < 0) {
            char *end = NULL;
            errno = 0;
            v = strtoll(val, &end, 10);
            if (errno || end == val || *end)
                return CALRT_ERR_INVALID_CONFIG;
        }
        if (v < k->min || v > k->max)
            return CALRT_ERR_INVALID_CONFIG;
        *emu_knob_ptr(dev, k) = v;
    }
    return CALRT_SUCCESS;
}

/* ---- device ------------------------------------------------------------------------------ */

const char *calrt_version(void)
{
    return "0.7.6-emu";
}

static void device_free(emu_device *dev)
{
    for (int e = 0; e < NUM_ENGINES; e++)
        while (dev->eng[e].head) {
            emu_job *j = dev->eng[e].head;
            dev->eng[e].head = j->next;
            emu_job_free(j);
        }
    while (dev->ghosts) {
        emu_ghost *g = dev->ghosts;
        dev->ghosts = g->next;
        free(g->data);
        free(g);
    }
    while (dev->inbufs) {
        emu_inbuf *b = dev->inbufs;
        dev->inbufs = b->next;
        free(b);
    }
    while (dev->outbufs) {
        emu_outbuf *b = dev->outbufs;
        dev->outbufs = b->next;
        free(b->devmem);
        free(b);
    }
    while (dev->calbins) {
        emu_calbin *c = dev->calbins;
        dev->calbins = c->next;
        free(c);
    }
    if (dev->kv) {
        for (int32_t i = 0; i < dev->kv->max_seqs; i++)
            free(dev->kv->seqs[i].states);
        free(dev->kv->seqs);
        free(dev->kv);
    }
    for (int e = 0; e < NUM_ENGINES; e++)
        pthread_cond_destroy(&dev->eng[e].cv);
    pthread_cond_destroy(&dev->done_cv);
    pthread_cond_destroy(&dev->stage_cv);
    pthread_mutex_destroy(&dev->mu);
    free(dev);
}

int emu_any_in_stage(emu_device *dev)
{
    for (int e = 0; e < NUM_ENGINES; e++)
        if (dev->eng[e].in_stage)
            return 1;
    return 0;
}

/* Wait (dev->mu held, counted among the waiters close waits for) until no engine is in a
 * stage: at most a stage's latency. 0 if the device closes meanwhile (its close woken). */
int emu_wait_out_of_stages(emu_device *dev)
{
    dev->waiters++;
    while (emu_any_in_stage(dev) && !dev->closing)
        pthread_cond_wait(&dev->stage_cv, &dev->mu);
    dev->waiters--;
    if (dev->closing) {
        pthread_cond_broadcast(&dev->stage_cv);
        return 0;
    }
    return 1;
}

/* Stop the threads and free dev. dev->mu held on entry; handles already invalidated. */
static void device_shutdown(emu_device *dev)
{
    dev->closing = 1;
    emu_wake_engines(dev);
    pthread_cond_broadcast(&dev->done_cv);
    pthread_cond_broadcast(&dev->stage_cv);
    while (dev->waiters > 0 || emu_any_in_stage(dev))
        pthread_cond_wait(&dev->stage_cv, &dev->mu);
    pthread_mutex_unlock(&dev->mu);
    for (int e = 0; e < NUM_ENGINES; e++)
        if (dev->eng[e].started)
            pthread_join(dev->eng[e].thread, NULL);
    device_free(dev);
}

int32_t calrt_device_open(const char *config, calrt_device **out)
{
    if (!out)
        return CALRT_ERR_INVALID_VALUE;
    emu_device *dev = (emu_device *)calloc(1, sizeof *dev);
    if (!dev)
        return CALRT_ERR_MEM_ALLOC;
    knobs_default(&dev->k);
    int32_t rc = parse_config(dev, config);
    if (rc) {
        free(dev);
        return rc;
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&dev->mu, NULL);
    for (int e = 0; e < NUM_ENGINES; e++)
        pthread_cond_init(&dev->eng[e].cv, &ca);
    pthread_cond_init(&dev->done_cv, &ca);
    pthread_cond_init(&dev->stage_cv, &ca);
    pthread_condattr_destroy(&ca);
    dev->h.type = OBJ_DEVICE;
    dev->h.dev = dev;
    dev->job_owner = dev->compute_owner = -1;
    dev->epoch = 1;
    dev->kv_rng = 0x5EED;
    pthread_mutex_lock(&g_reg_mu);
    int ok = reg_add(&dev->h);
    pthread_mutex_unlock(&g_reg_mu);
    if (!ok) {
        device_free(dev);
        return CALRT_ERR_MEM_ALLOC;
    }
    pthread_mutex_lock(&dev->mu);
    for (int e = 0; e < NUM_ENGINES; e++)
        if (!emu_engine_start(dev, e)) {
            pthread_mutex_unlock(&dev->mu);
            calrt_device_close((calrt_device *)(uintptr_t)dev->h.handle);
            return CALRT_ERR_MEM_ALLOC;
        }
    /* the device is open once its engine threads run: named and with their timer slack */
    for (int e = 0; e < NUM_ENGINES; e++)
        while (!dev->eng[e].up)
            pthread_cond_wait(&dev->stage_cv, &dev->mu);
    pthread_mutex_unlock(&dev->mu);
    *out = (calrt_device *)(uintptr_t)dev->h.handle;
    return CALRT_SUCCESS;
}

int32_t calrt_device_close(calrt_device *h)
{
    pthread_mutex_lock(&g_reg_mu);
    emu_device *dev = (emu_device *)reg_get(h, OBJ_DEVICE);
    if (!dev) {
        pthread_mutex_unlock(&g_reg_mu);
        return CALRT_ERR_INVALID_VALUE;
    }
    pthread_mutex_lock(&dev->mu);
    reg_remove(&dev->h);
    for (emu_calbin *c = dev->calbins; c; c = c->next) {
        reg_remove(&c->h);
        for (int i = 0; i < c->n_models; i++)
            reg_remove(&c->models[i].h);
    }
    for (emu_inbuf *b = dev->inbufs; b; b = b->next)
        reg_remove(&b->h);
    for (emu_outbuf *b = dev->outbufs; b; b = b->next)
        reg_remove(&b->h);
    if (dev->kv)
        reg_remove(&dev->kv->h);
    pthread_mutex_unlock(&g_reg_mu);
    device_shutdown(dev);
    return CALRT_SUCCESS;
}

/* ---- calbin ------------------------------------------------------------------------------- */

static const char *const DTYPE_NAMES[] = {"", "U8", "S32", "F32", "BF16", "F16", "S64"};

/* Why the calling thread's last calrt_calbin_load refused a calbin for a dtype ("" when it
 * did not): calrt_emu_calbin_error hands it to the driver, which names it. */
static _Thread_local char g_calbin_why[200];
static _Thread_local int g_calbin_line; /* its line, when known (0: the model as a whole) */

static int32_t dtype_parse(const char *s)
{
    for (int32_t i = 1; i < 7; i++)
        if (strcmp(s, DTYPE_NAMES[i]) == 0)
            return i;
    return CALRT_DTYPE_INVALID;
}

/* A tensor whose dtype is not the one the emulator executes: say so (0, like the checks). */
static int dtype_refused(const char *model, const emu_tensor *t, int32_t wanted)
{
    snprintf(g_calbin_why, sizeof g_calbin_why, "model '%s' tensor '%s': dtype %s, the emulator "
             "executes %s there", model, t->name, DTYPE_NAMES[t->dtype], DTYPE_NAMES[wanted]);
    return 0;
}

int32_t calrt_emu_calbin_error(char *out, uint64_t cap)
{
    if (!out || cap == 0)
        return CALRT_ERR_INVALID_VALUE;
    if (g_calbin_why[0] && g_calbin_line > 0)
        snprintf(out, cap, "line %d: %s", g_calbin_line, g_calbin_why);
    else
        snprintf(out, cap, "%s", g_calbin_why);
    return CALRT_SUCCESS;
}

static uint64_t dtype_size(int32_t d)
{
    switch (d) {
    case CALRT_DTYPE_U8: return 1;
    case CALRT_DTYPE_BF16:
    case CALRT_DTYPE_F16: return 2;
    case CALRT_DTYPE_S32:
    case CALRT_DTYPE_F32: return 4;
    case CALRT_DTYPE_S64: return 8;
    default: return 0;
    }
}

/* Whether only white space is left at s (a line's end once sscanf read its fields: sscanf
 * stops at the first byte its format does not take, so "meta vocab 151936&meta hidden 64" or
 * "seed 1264843\x97" read as a meta of 151936 and a seed of 1264843, the rest dropped, and a
 * corrupted file loaded as another model, until stop 73). */
static int only_space(const char *s)
{
    while (*s && isspace((unsigned char)*s))
        s++;
    return *s == '\0';
}

/* The decimal integer that is all of s but white space around it: digits, a '-' first when
 * `sign` (in [INT64_MIN, INT64_MAX] then, else [0, UINT64_MAX]) -> *out; 0 otherwise. sscanf's
 * %llu took "-1" as 2**64-1 and "+5", and a number past the type was undefined behaviour. */
static int whole_int(const char *s, int sign, unsigned long long *out)
{
    while (*s && isspace((unsigned char)*s))
        s++;
    const char *digits = sign && *s == '-' ? s + 1 : s;
    if (!isdigit((unsigned char)*digits))
        return 0;
    char *end = NULL;
    errno = 0;
    if (sign) {
        long long v = strtoll(s, &end, 10);
        *out = (unsigned long long)v;
    } else {
        *out = strtoull(s, &end, 10);
    }
    return errno == 0 && end != s && only_space(end);
}

/* "input|output <name> <dtype> <sliceable> <d0,d1,..>" -> t; 0 on a malformed line. */
static int parse_tensor(const char *rest, emu_tensor *t)
{
    char name[CALRT_NAME_MAX], dt[16], slt[16], dims[256];
    int n = 0;
    /* the sliceable flag is the text "0" or "1": read with %d, 4294967296 overflowed (undefined
     * behaviour; glibc made it 0 and the line loaded) */
    if (sscanf(rest, "%63s %15s %15s %255s%n", name, dt, slt, dims, &n) != 4
        || (strcmp(slt, "0") != 0 && strcmp(slt, "1") != 0) || !only_space(rest + n))
        return 0;
    int sl = slt[0] == '1';
    memset(t, 0, sizeof *t);
    strcpy(t->name, name);
    t->dtype = dtype_parse(dt);
    t->elem_size = dtype_size(t->dtype);
    t->sliceable = sl;
    if (!t->elem_size) {
        snprintf(g_calbin_why, sizeof g_calbin_why, "tensor '%s': dtype '%s' is not one of U8, "
                 "S32, F32, BF16, F16, S64", name, dt);
        return 0;
    }
    t->elems = 1;
    char *p = dims;
    while (*p) {
        char *end = NULL;
        unsigned long long d = strtoull(p, &end, 10);
        if (end == p || d == 0 || d > (1ull << 32) || t->rank == CALRT_MAX_RANK)
            return 0;
        t->shape[t->rank++] = d;
        if (t->elems > (1ull << 40) / d)
            return 0;
        t->elems *= d;
        p = *end == ',' ? end + 1 : end;
        if (*end && *end != ',')
            return 0;
    }
    if (t->rank < 2)
        return 0;
    t->byte_size = t->elems * t->elem_size;
    t->row_elems = t->elems / (t->shape[0] * t->shape[1]);
    return 1;
}

static int model_meta(const emu_model *m, const char *key, int64_t *out)
{
    for (int i = 0; i < m->n_meta; i++)
        if (strcmp(m->meta_key[i], key) == 0) {
            *out = m->meta_val[i];
            return 1;
        }
    return 0;
}

static int tensor_index(const emu_tensor *ts, int n, const char *name)
{
    for (int i = 0; name && i < n; i++)
        if (strncmp(ts[i].name, name, CALRT_NAME_MAX) == 0)
            return i;
    return -1;
}

/* Check a parsed model against the Qwen3 contract the emulator executes. */
static int model_finish(emu_model *m)
{
    int64_t d0, vocab, max_seq, hidden = 0;
    m->idx_tokens = tensor_index(m->in, m->n_in, m->kind == KIND_PREFILL_EMBEDS ? "inputs_embeds" : "input_ids");
    m->idx_pos = tensor_index(m->in, m->n_in, "positions");
    if (m->idx_tokens < 0 || m->idx_pos < 0 || m->n_in != 2 || m->n_out != 1)
        return 0;
    if (!model_meta(m, "logits_tile_d0", &d0) || !model_meta(m, "vocab", &vocab) ||
        !model_meta(m, "max_seq", &max_seq) || max_seq < 1)
        return 0;
    const emu_tensor *tk = &m->in[m->idx_tokens], *tp = &m->in[m->idx_pos], *lo = &m->out[0];
    int embeds = m->kind == KIND_PREFILL_EMBEDS;
    if (tk->dtype != (embeds ? CALRT_DTYPE_BF16 : CALRT_DTYPE_S32))
        return dtype_refused(m->name, tk, embeds ? CALRT_DTYPE_BF16 : CALRT_DTYPE_S32);
    if (tp->dtype != CALRT_DTYPE_S32)
        return dtype_refused(m->name, tp, CALRT_DTYPE_S32);
    if (lo->dtype != CALRT_DTYPE_BF16)
        return dtype_refused(m->name, lo, CALRT_DTYPE_BF16);
    if (embeds && (!model_meta(m, "hidden", &hidden) || tk->rank != 3 || tk->shape[2] != (uint64_t)hidden))
        return 0;
    if (!embeds && tk->rank != 2)
        return 0;
    if (tp->rank != 2 || tp->shape[1] != tk->shape[1] || tk->shape[0] != 1)
        return 0;
    if (lo->rank != 3 || lo->shape[0] != 1 || lo->shape[1] != (uint64_t)d0 ||
        lo->shape[2] != (uint64_t)vocab || strcmp(lo->name, "logits") != 0)
        return 0;
    if (m->kind == KIND_DECODE && tk->shape[1] != 1)
        return 0;
    int have_cur = 0, have_total = 0;
    for (int i = 0; i < m->n_csr; i++) {
        m->csr_role[i] = -1;
        if (strcmp(m->csr[i], "cur_seq_len") == 0)
            m->csr_role[i] = CSR_CUR, have_cur = 1;
        if (strcmp(m->csr[i], "total_seq_len") == 0)
            m->csr_role[i] = CSR_TOTAL, have_total = 1;
    }
    m->tile_d0 = (uint64_t)d0;
    m->vocab = (uint64_t)vocab;
    m->hidden = (uint64_t)hidden;
    m->max_seq = (uint64_t)max_seq;
    m->rows = tk->shape[1];
    return have_cur && have_total;
}

static int32_t calbin_parse(FILE *f, emu_calbin *cb)
{
    char line[1024];
    if (!fgets(line, sizeof line, f) || strcmp(line, "CALBIN 1\n") != 0)
        return ferror(f) ? CALRT_ERR_FILE_READ : CALRT_ERR_FILE_FORMAT;
    emu_model *m = NULL;
    int have_seed = 0, lineno = 1;
    while (fgets(line, sizeof line, f)) {
        char word[16], a[CALRT_NAME_MAX], b[32];
        lineno++;
        size_t len = strlen(line);
        if (len == 0 || line[len - 1] != '\n' || sscanf(line, "%15s", word) != 1)
            return CALRT_ERR_INVALID_CALBIN;
        const char *rest = line + strlen(word);
        unsigned long long u;
        int n = 0; /* what sscanf read of rest: the line must end there (only_space) */
        if (!m && strcmp(word, "seed") == 0 && whole_int(rest, 0, &u)) {
            cb->seed = u;
            have_seed = 1;
        } else if (!m && strcmp(word, "model") == 0 && sscanf(rest, "%63s %31s%n", a, b, &n) == 2 && only_space(rest + n)) {
            if (cb->n_models == MAX_MODELS)
                return CALRT_ERR_INVALID_CALBIN;
            m = &cb->models[cb->n_models];
            memset(m, 0, sizeof *m);
            strcpy(m->name, a);
            m->kind = strcmp(b, "prefill_ids") == 0 ? KIND_PREFILL_IDS
                      : strcmp(b, "prefill_embeds") == 0 ? KIND_PREFILL_EMBEDS
                      : strcmp(b, "decode") == 0 ? KIND_DECODE : 0;
            if (!m->kind)
                return CALRT_ERR_INVALID_CALBIN;
        } else if (m && strcmp(word, "salt") == 0 && whole_int(rest, 0, &u)) {
            m->salt = u;
        } else if (m && strcmp(word, "meta") == 0 && sscanf(rest, "%63s%n", a, &n) == 1 && isspace((unsigned char)rest[n])
                   && whole_int(rest + n, 1, &u) && m->n_meta < MAX_META) {
            strcpy(m->meta_key[m->n_meta], a);
            m->meta_val[m->n_meta++] = (long long)u;
        } else if (m && strcmp(word, "input") == 0 && m->n_in < MAX_TENSORS && parse_tensor(rest, &m->in[m->n_in])) {
            m->n_in++;
        } else if (m && strcmp(word, "output") == 0 && m->n_out < MAX_TENSORS && parse_tensor(rest, &m->out[m->n_out])) {
            m->n_out++;
        } else if (m && strcmp(word, "csr") == 0 && sscanf(rest, "%63s%n", a, &n) == 1 && only_space(rest + n) && m->n_csr < MAX_CSRS) {
            strcpy(m->csr[m->n_csr++], a);
        } else if (m && strcmp(word, "end") == 0 && only_space(rest)) {
            if (!model_finish(m))
                return CALRT_ERR_INVALID_CALBIN;
            cb->n_models++;
            m = NULL;
        } else {
            g_calbin_line = lineno; /* names the line of a refused dtype */
            return CALRT_ERR_INVALID_CALBIN;
        }
    }
    if (ferror(f))
        return CALRT_ERR_FILE_READ;
    if (m || !have_seed || cb->n_models == 0)
        return CALRT_ERR_INVALID_CALBIN;
    for (int i = 0; i < cb->n_models; i++)
        for (int j = 0; j < i; j++)
            if (strcmp(cb->models[i].name, cb->models[j].name) == 0)
                return CALRT_ERR_INVALID_CALBIN;
    return CALRT_SUCCESS;
}

int32_t calrt_calbin_load(calrt_device *h, const char *path, calrt_calbin **out)
{
    if (!path || !out)
        return CALRT_ERR_INVALID_VALUE;
    g_calbin_why[0] = '\0';
    g_calbin_line = 0;
    emu_calbin *cb = (emu_calbin *)calloc(1, sizeof *cb);
    if (!cb)
        return CALRT_ERR_MEM_ALLOC;
    FILE *f = fopen(path, "rb");
    int32_t rc = f ? calbin_parse(f, cb) : errno == ENOENT ? CALRT_ERR_FILE_NOT_FOUND : CALRT_ERR_FILE_READ;
    if (f)
        fclose(f);
    if (rc) {
        free(cb);
        return rc;
    }
    pthread_mutex_lock(&g_reg_mu);
    emu_device *dev = (emu_device *)reg_get(h, OBJ_DEVICE);
    if (!dev) {
        pthread_mutex_unlock(&g_reg_mu);
        free(cb);
        return CALRT_ERR_INVALID_VALUE;
    }
    pthread_mutex_lock(&dev->mu);
    cb->h.type = OBJ_CALBIN;
    cb->h.dev = dev;
    int ok = reg_add(&cb->h);
    for (int i = 0; ok && i < cb->n_models; i++) {
        cb->models[i].h.type = OBJ_MODEL;
        cb->models[i].h.dev = dev;
        cb->models[i].cb = cb;
        if (!reg_add(&cb->models[i].h)) {
            while (i-- > 0)
                reg_remove(&cb->models[i].h);
            reg_remove(&cb->h);
            ok = 0;
        }
    }
    pthread_mutex_unlock(&g_reg_mu);
    if (!ok) {
        free(cb);
        return emu_unlock_rc(dev, CALRT_ERR_MEM_ALLOC);
    }
    cb->next = dev->calbins;
    dev->calbins = cb;
    *out = (calrt_calbin *)(uintptr_t)cb->h.handle;
    return emu_unlock_rc(dev, CALRT_SUCCESS);
}

int32_t calrt_calbin_unload(calrt_calbin *h)
{
    emu_calbin *cb = (emu_calbin *)acquire_for_destroy(h, OBJ_CALBIN);
    if (!cb)
        return CALRT_ERR_INVALID_VALUE;
    emu_device *dev = cb->h.dev;
    int busy = dev->configured == cb || (dev->kv && dev->kv->cb == cb);
    for (emu_inbuf *b = dev->inbufs; b; b = b->next)
        busy |= b->m->cb == cb;
    for (emu_outbuf *b = dev->outbufs; b; b = b->next)
        busy |= b->m->cb == cb;
    if (!busy) {
        reg_remove(&cb->h);
        for (int i = 0; i < cb->n_models; i++)
            reg_remove(&cb->models[i].h);
        LIST_UNLINK(emu_calbin, dev->calbins, cb);
        free(cb);
    }
    return destroy_done(dev, busy);
}

int32_t calrt_configure(calrt_device *h, calrt_calbin *cbh)
{
    pthread_mutex_lock(&g_reg_mu);
    emu_device *dev = (emu_device *)reg_get(h, OBJ_DEVICE);
    emu_calbin *cb = (emu_calbin *)reg_get(cbh, OBJ_CALBIN);
    if (!dev || !cb || cb->h.dev != dev) {
        pthread_mutex_unlock(&g_reg_mu);
        return CALRT_ERR_INVALID_VALUE;
    }
    pthread_mutex_lock(&dev->mu);
    pthread_mutex_unlock(&g_reg_mu);
    if (dev->configured)
        return emu_unlock_rc(dev, CALRT_ERR_ALREADY_CONFIGURED);
    dev->configured = cb;
    return emu_unlock_rc(dev, CALRT_SUCCESS);
}

int32_t calrt_get_all_models(calrt_calbin *h, calrt_model **out, int32_t cap, int32_t *count)
{
    if (!count || cap < 0 || (cap > 0 && !out))
        return CALRT_ERR_INVALID_VALUE;
    emu_calbin *cb = (emu_calbin *)emu_acquire(h, OBJ_CALBIN);
    if (!cb)
        return CALRT_ERR_INVALID_VALUE;
    for (int i = 0; i < cb->n_models && i < cap; i++)
        out[i] = (calrt_model *)(uintptr_t)cb->models[i].h.handle;
    *count = cb->n_models;
    return emu_unlock_rc(cb->h.dev, CALRT_SUCCESS);
}

/* ---- model introspection ------------------------------------------------------------- */

static int32_t copy_name(const char *src, char *buf, uint64_t cap)
{
    uint64_t n = strlen(src);
    if (!buf)
        return CALRT_ERR_INVALID_VALUE;
    if (n + 1 > cap)
        return CALRT_ERR_OUT_OF_BOUNDS;
    memcpy(buf, src, n + 1);
    return CALRT_SUCCESS;
}

int32_t calrt_model_name(calrt_model *h, char *buf, uint64_t cap)
{
    emu_model *m = (emu_model *)emu_acquire(h, OBJ_MODEL);
    if (!m)
        return CALRT_ERR_INVALID_VALUE;
    return emu_unlock_rc(m->h.dev, copy_name(m->name, buf, cap));
}

static int32_t model_count(calrt_model *h, int32_t *count, int which)
{
    if (!count)
        return CALRT_ERR_INVALID_VALUE;
    emu_model *m = (emu_model *)emu_acquire(h, OBJ_MODEL);
    if (!m)
        return CALRT_ERR_INVALID_VALUE;
    *count = which == 0 ? m->n_in : which == 1 ? m->n_out : which == 2 ? m->n_csr : m->n_meta;
    return emu_unlock_rc(m->h.dev, CALRT_SUCCESS);
}

int32_t calrt_model_num_inputs(calrt_model *h, int32_t *count) { return model_count(h, count, 0); }
int32_t calrt_model_num_outputs(calrt_model *h, int32_t *count) { return model_count(h, count, 1); }
int32_t calrt_model_num_csrs(calrt_model *h, int32_t *count) { return model_count(h, count, 2); }
int32_t calrt_model_num_meta(calrt_model *h, int32_t *count) { return model_count(h, count, 3); }

static int32_t tensor_info(calrt_model *h, int32_t index, calrt_tensor_info *out, int output)
{
    if (!out)
        return CALRT_ERR_INVALID_VALUE;
    emu_model *m = (emu_model *)emu_acquire(h, OBJ_MODEL);
    if (!m)
        return CALRT_ERR_INVALID_VALUE;
    if (index < 0 || index >= (output ? m->n_out : m->n_in))
        return emu_unlock_rc(m->h.dev, CALRT_ERR_OUT_OF_BOUNDS);
    const emu_tensor *t = output ? &m->out[index] : &m->in[index];
    memset(out, 0, sizeof *out);
    strcpy(out->name, t->name);
    out->dtype = t->dtype;
    out->rank = t->rank;
    memcpy(out->shape, t->shape, sizeof out->shape);
    out->byte_size = t->byte_size;
    out->sliceable = t->sliceable;
    return emu_unlock_rc(m->h.dev, CALRT_SUCCESS);
}

int32_t calrt_model_input_info(calrt_model *h, int32_t i, calrt_tensor_info *o) { return tensor_info(h, i, o, 0); }
int32_t calrt_model_output_info(calrt_model *h, int32_t i, calrt_tensor_info *o) { return tensor_info(h, i, o, 1); }

int32_t calrt_model_csr_name(calrt_model *h, int32_t index, char *buf, uint64_t cap)
{
    emu_model *m = (emu_model *)emu_acquire(h, OBJ_MODEL);
    if (!m)
        return CALRT_ERR_INVALID_VALUE;
    if (index < 0 || index >= m->n_csr)
        return emu_unlock_rc(m->h.dev, CALRT_ERR_OUT_OF_BOUNDS);
    return emu_unlock_rc(m->h.dev, copy_name(m->csr[index], buf, cap));
}

int32_t calrt_model_meta(calrt_model *h, const char *key, int64_t *out)
{
    if (!key || !out)
        return CALRT_ERR_INVALID_VALUE;
    emu_model *m = (emu_model *)emu_acquire(h, OBJ_MODEL);
    if (!m)
        return CALRT_ERR_INVALID_VALUE;
    return emu_unlock_rc(m->h.dev, model_meta(m, key, out) ? CALRT_SUCCESS : CALRT_ERR_INVALID_VALUE);
}

int32_t calrt_model_meta_at(calrt_model *h, int32_t index, char *key, uint64_t cap, int64_t *value)
{
    if (!value)
        return CALRT_ERR_INVALID_VALUE;
    emu_model *m = (emu_model *)emu_acquire(h, OBJ_MODEL);
    if (!m)
        return CALRT_ERR_INVALID_VALUE;
    if (index < 0 || index >= m->n_meta)
        return emu_unlock_rc(m->h.dev, CALRT_ERR_OUT_OF_BOUNDS);
    int32_t rc = copy_name(m->meta_key[index], key, cap);
    if (rc == CALRT_SUCCESS)
        *value = m->meta_val[index];
    return emu_unlock_rc(m->h.dev, rc);
}

/* ---- buffers ------------------------------------------------------------------------------ */

int32_t calrt_inputbuf_create(calrt_model *h, calrt_inputbuf **out)
{
    if (!out)
        return CALRT_ERR_INVALID_VALUE;
    pthread_mutex_lock(&g_reg_mu);
    emu_model *m = (emu_model *)reg_get(h, OBJ_MODEL);
    emu_inbuf *b = m ? (emu_inbuf *)calloc(1, sizeof *b) : NULL;
    if (!b) {
        pthread_mutex_unlock(&g_reg_mu);
        return m ? CALRT_ERR_MEM_ALLOC : CALRT_ERR_INVALID_VALUE;
    }
    b->h.type = OBJ_INBUF;
    b->h.dev = m->h.dev;
    b->m = m;
    if (!reg_add(&b->h)) {
        pthread_mutex_unlock(&g_reg_mu);
        free(b);
        return CALRT_ERR_MEM_ALLOC;
    }
    emu_device *dev = m->h.dev;
    pthread_mutex_lock(&dev->mu);
    pthread_mutex_unlock(&g_reg_mu);
    b->next = dev->inbufs;
    dev->inbufs = b;
    *out = (calrt_inputbuf *)(uintptr_t)b->h.handle;
    return emu_unlock_rc(dev, CALRT_SUCCESS);
}

int32_t calrt_outputbuf_create(calrt_model *h, calrt_outputbuf **out)
{
    if (!out)
        return CALRT_ERR_INVALID_VALUE;
    pthread_mutex_lock(&g_reg_mu);
    emu_model *m = (emu_model *)reg_get(h, OBJ_MODEL);
    if (!m) {
        pthread_mutex_unlock(&g_reg_mu);
        return CALRT_ERR_INVALID_VALUE;
    }
    emu_outbuf *b = (emu_outbuf *)calloc(1, sizeof *b);
    /* not zero-filled (a memset of ~5 MB a prefill buffer, every generation): a compute
     * clears and writes it before a d2h copies it; a stale completion of a job that never
     * computed sends zeros (devmem_written), as the zeroed buffer did */
    uint8_t *mem = (uint8_t *)malloc(m->out[0].byte_size);
    if (!b || !mem) {
        pthread_mutex_unlock(&g_reg_mu);
        free(b);
        free(mem);
        return CALRT_ERR_MEM_ALLOC;
    }
    b->h.type = OBJ_OUTBUF;
    b->h.dev = m->h.dev;
    b->m = m;
    b->devmem = mem;
    if (!reg_add(&b->h)) {
        pthread_mutex_unlock(&g_reg_mu);
        free(b);
        free(mem);
        return CALRT_ERR_MEM_ALLOC;
    }
    emu_device *dev = m->h.dev;
    pthread_mutex_lock(&dev->mu);
    pthread_mutex_unlock(&g_reg_mu);
    b->next = dev->outbufs;
    dev->outbufs = b;
    *out = (calrt_outputbuf *)(uintptr_t)b->h.handle;
    return emu_unlock_rc(dev, CALRT_SUCCESS);
}

int32_t calrt_inputbuf_destroy(calrt_inputbuf *h)
{
    emu_inbuf *b = (emu_inbuf *)acquire_for_destroy(h, OBJ_INBUF);
    if (!b)
        return CALRT_ERR_INVALID_VALUE;
    emu_device *dev = b->h.dev;
    int busy = b->inflight > 0;
    if (!busy) {
        reg_remove(&b->h);
        LIST_UNLINK(emu_inbuf, dev->inbufs, b);
        free(b);
    }
    return destroy_done(dev, busy);
}

int32_t calrt_outputbuf_destroy(calrt_outputbuf *h)
{
    emu_outbuf *b = (emu_outbuf *)acquire_for_destroy(h, OBJ_OUTBUF);
    if (!b)
        return CALRT_ERR_INVALID_VALUE;
    emu_device *dev = b->h.dev;
    int busy = b->job != NULL || b->waiters > 0;
    if (!busy) {
        reg_remove(&b->h);
        LIST_UNLINK(emu_outbuf, dev->outbufs, b);
        free(b->devmem);
        free(b);
    }
    return destroy_done(dev, busy);
}

static int32_t map_check(emu_device *dev, const emu_tensor *t, int32_t dtype, void *host, uint64_t size)
{
    if (!host || size == 0)
        return CALRT_ERR_INVALID_VALUE;
    if (emu_fault_fire(dev, CALRT_EMU_FAULT_MAP_FAIL))
        return dev->faults[CALRT_EMU_FAULT_MAP_FAIL].rc ? dev->faults[CALRT_EMU_FAULT_MAP_FAIL].rc
                                                          : CALRT_ERR_MAP_BROKEN;
    if (dtype != t->dtype)
        return CALRT_ERR_DTYPE_MISMATCH;
    if (size > t->byte_size)
        return CALRT_ERR_OUT_OF_BOUNDS;
    if (size % t->elem_size)
        return CALRT_ERR_SHAPE_MISMATCH;
    return CALRT_SUCCESS;
}

int32_t calrt_inputbuf_map(calrt_inputbuf *h, const char *tensor, int32_t dtype, void *host, uint64_t size)
{
    emu_inbuf *b = (emu_inbuf *)emu_acquire(h, OBJ_INBUF);
    if (!b)
        return CALRT_ERR_INVALID_VALUE;
    int i = tensor_index(b->m->in, b->m->n_in, tensor);
    if (i < 0)
        return emu_unlock_rc(b->h.dev, CALRT_ERR_INVALID_VALUE);
    if (b->inflight)
        return emu_unlock_rc(b->h.dev, CALRT_ERR_DEVICE_BUSY);
    int32_t rc = map_check(b->h.dev, &b->m->in[i], dtype, host, size);
    if (rc == CALRT_SUCCESS) {
        emu_map *mp = &b->t[i];
        mp->host = host;
        mp->size = size;
        mp->mapped = 1;
        mp->sliced = 0;
    }
    return emu_unlock_rc(b->h.dev, rc);
}

int32_t calrt_outputbuf_map(calrt_outputbuf *h, const char *tensor, int32_t dtype, void *host, uint64_t size)
{
    emu_outbuf *b = (emu_outbuf *)emu_acquire(h, OBJ_OUTBUF);
    if (!b)
        return CALRT_ERR_INVALID_VALUE;
    if (tensor_index(b->m->out, b->m->n_out, tensor) != 0)
        return emu_unlock_rc(b->h.dev, CALRT_ERR_INVALID_VALUE);
    if (b->job)
        return emu_unlock_rc(b->h.dev, CALRT_ERR_DEVICE_BUSY);
    int32_t rc = map_check(b->h.dev, &b->m->out[0], dtype, host, size);
    if (rc == CALRT_SUCCESS) {
        b->map.host = host;
        b->map.size = size;
        b->map.mapped = 1;
    }
    return emu_unlock_rc(b->h.dev, rc);
}

int32_t calrt_inputbuf_slice(calrt_inputbuf *h, const char *tensor, uint64_t offset, uint64_t count)
{
    emu_inbuf *b = (emu_inbuf *)emu_acquire(h, OBJ_INBUF);
    if (!b)
        return CALRT_ERR_INVALID_VALUE;
    emu_device *dev = b->h.dev;
    int i = tensor_index(b->m->in, b->m->n_in, tensor);
    if (i < 0 || count == 0)
        return emu_unlock_rc(dev, CALRT_ERR_INVALID_VALUE);
    const emu_tensor *t = &b->m->in[i];
    if (!t->sliceable)
        return emu_unlock_rc(dev, CALRT_ERR_UNSUPPORTED);
    if (emu_fault_fire(dev, CALRT_EMU_FAULT_SLICE_FAIL))
        return emu_unlock_rc(dev, dev->faults[CALRT_EMU_FAULT_SLICE_FAIL].rc ? dev->faults[CALRT_EMU_FAULT_SLICE_FAIL].rc
                                                                         : CALRT_ERR_OUT_OF_BOUNDS);
    if (offset > t->elems || count > t->elems - offset)
        return emu_unlock_rc(dev, CALRT_ERR_OUT_OF_BOUNDS);
    /* The device reads whole rows. Refused here, where the bad argument is, rather than at
     * infer(), whose codes are about the job (calrt.h documents 4 for this call). */
    if (offset % t->row_elems || count % t->row_elems)
        return emu_unlock_rc(dev, CALRT_ERR_INVALID_VALUE);
    b->t[i].sliced = 1;
    b->t[i].off = offset;
    b->t[i].cnt = count;
    return emu_unlock_rc(dev, CALRT_SUCCESS);
}

int32_t calrt_inputbuf_undo_slice(calrt_inputbuf *h, const char *tensor)
{
    emu_inbuf *b = (emu_inbuf *)emu_acquire(h, OBJ_INBUF);
    if (!b)
        return CALRT_ERR_INVALID_VALUE;
    int i = tensor_index(b->m->in, b->m->n_in, tensor);
    if (i >= 0)
        b->t[i].sliced = 0;
    return emu_unlock_rc(b->h.dev, i < 0 ? CALRT_ERR_INVALID_VALUE : CALRT_SUCCESS);
}

int32_t calrt_inputbuf_set_csr(calrt_inputbuf *h, const char *name, int64_t value)
{
    emu_inbuf *b = (emu_inbuf *)emu_acquire(h, OBJ_INBUF);
    if (!b)
        return CALRT_ERR_INVALID_VALUE;
    if (emu_fault_fire(b->h.dev, CALRT_EMU_FAULT_UNKNOWN_CSR))
        return emu_unlock_rc(b->h.dev, CALRT_ERR_INVALID_VALUE);
    for (int i = 0; name && i < b->m->n_csr; i++)
        if (strncmp(b->m->csr[i], name, CALRT_NAME_MAX) == 0) {
            b->csr_set[i] = 1;
            b->csr_val[i] = value;
            return emu_unlock_rc(b->h.dev, CALRT_SUCCESS);
        }
    return emu_unlock_rc(b->h.dev, CALRT_ERR_INVALID_VALUE);
}

/* ---- KV manager ---------------------------------------------------------------------------- */

/* Free a KV manager and its sequences' states (also a half-built one: seqs may be NULL). */
static void kv_free(emu_kv *kv)
{
    for (int32_t i = 0; kv->seqs && i < kv->max_seqs; i++)
        free(kv->seqs[i].states);
    free(kv->seqs);
    free(kv);
}

int32_t calrt_kv_create(calrt_device *h, calrt_calbin *cbh, calrt_kv **out)
{
    if (!out)
        return CALRT_ERR_INVALID_VALUE;
    pthread_mutex_lock(&g_reg_mu);
    emu_device *dev = (emu_device *)reg_get(h, OBJ_DEVICE);
    emu_calbin *cb = (emu_calbin *)reg_get(cbh, OBJ_CALBIN);
    if (!dev || !cb || cb->h.dev != dev) {
        pthread_mutex_unlock(&g_reg_mu);
        return CALRT_ERR_INVALID_VALUE;
    }
    pthread_mutex_lock(&dev->mu);
    int32_t rc = CALRT_SUCCESS;
    emu_kv *kv = NULL;
    if (dev->kv) {
        rc = CALRT_ERR_ALREADY_REGISTERED;
    } else if (!(kv = (emu_kv *)calloc(1, sizeof *kv)) ||
               !(kv->seqs = (emu_seq *)calloc((size_t)dev->k.max_seqs, sizeof *kv->seqs))) {
        rc = CALRT_ERR_MEM_ALLOC;
    } else {
        kv->h.type = OBJ_KV;
        kv->h.dev = dev;
        kv->cb = cb;
        kv->serial = ++dev->kv_serial;
        kv->block_size = (uint32_t)dev->k.kv_block_size;
        kv->capacity = kv->free_blocks = (uint32_t)dev->k.kv_blocks;
        kv->max_seqs = (int32_t)dev->k.max_seqs;
        for (int32_t i = 0; i < kv->max_seqs && rc == CALRT_SUCCESS; i++) {
            if (!emu_seq_reserve_states(&kv->seqs[i], 0))
                rc = CALRT_ERR_MEM_ALLOC;
            else
                kv->seqs[i].states[0] = emu_sm(cb->seed);
        }
        if (rc == CALRT_SUCCESS && !reg_add(&kv->h))
            rc = CALRT_ERR_MEM_ALLOC;
    }
    pthread_mutex_unlock(&g_reg_mu);
    if (rc != CALRT_SUCCESS && kv) {
        kv_free(kv);
    } else if (rc == CALRT_SUCCESS) {
        dev->kv = kv;
        *out = (calrt_kv *)(uintptr_t)kv->h.handle;
    }
    return emu_unlock_rc(dev, rc);
}

int32_t calrt_kv_destroy(calrt_kv *h)
{
    emu_kv *kv = (emu_kv *)acquire_for_destroy(h, OBJ_KV);
    if (!kv)
        return CALRT_ERR_INVALID_VALUE;
    emu_device *dev = kv->h.dev;
    int busy = kv->inflight > 0;
    if (!busy) {
        reg_remove(&kv->h);
        kv_free(kv);
        dev->kv = NULL;
    }
    return destroy_done(dev, busy);
}

int32_t calrt_kv_geometry(calrt_kv *h, uint32_t *block_size, uint32_t *capacity_blocks, uint32_t *free_blocks,
                          int32_t *max_seqs)
{
    if (!block_size || !capacity_blocks || !free_blocks || !max_seqs)
        return CALRT_ERR_INVALID_VALUE;
    emu_kv *kv = (emu_kv *)emu_acquire(h, OBJ_KV);
    if (!kv)
        return CALRT_ERR_INVALID_VALUE;
    *block_size = kv->block_size;
    *capacity_blocks = kv->capacity;
    *free_blocks = kv->free_blocks;
    *max_seqs = kv->max_seqs;
    return emu_unlock_rc(kv->h.dev, CALRT_SUCCESS);
}

int32_t calrt_kv_can_allocate(calrt_kv *h, uint32_t n_blocks)
{
    emu_kv *kv = (emu_kv *)emu_acquire(h, OBJ_KV);
    if (!kv)
        return 0;
    if (emu_fault_fire(kv->h.dev, CALRT_EMU_FAULT_CAN_ALLOCATE_FALSE))
        return emu_unlock_rc(kv->h.dev, 0);
    return emu_unlock_rc(kv->h.dev, kv->free_blocks >= n_blocks);
}

static uint64_t kv_max_len(const emu_kv *kv)
{
    uint64_t mx = 0;
    for (int i = 0; i < kv->cb->n_models; i++)
        if (kv->cb->models[i].max_seq > mx)
            mx = kv->cb->models[i].max_seq;
    return mx;
}

int32_t calrt_kv_apply(calrt_kv *h, int32_t seq, uint32_t target_len)
{
    emu_kv *kv = (emu_kv *)emu_acquire(h, OBJ_KV);
    if (!kv)
        return 0;
    emu_device *dev = kv->h.dev;
    if (seq < 0 || seq >= kv->max_seqs || target_len > kv_max_len(kv))
        return emu_unlock_rc(dev, 0);
    if (emu_fault_fire(dev, CALRT_EMU_FAULT_APPLY_FALSE))
        return emu_unlock_rc(dev, 0);
    emu_seq *s = &kv->seqs[seq];
    uint32_t need = (uint32_t)(((uint64_t)target_len + kv->block_size - 1) / kv->block_size);
    if (need > s->reserved_blocks) {
        if (need - s->reserved_blocks > kv->free_blocks)
            return emu_unlock_rc(dev, 0);
        kv->free_blocks -= need - s->reserved_blocks;
    } else {
        kv->free_blocks += s->reserved_blocks - need;
    }
    s->reserved_blocks = need;
    if (s->committed > target_len)
        s->committed = target_len;
    return emu_unlock_rc(dev, 1);
}

int32_t calrt_kv_seq_len(calrt_kv *h, int32_t seq, uint32_t *len)
{
    if (!len)
        return CALRT_ERR_INVALID_VALUE;
    emu_kv *kv = (emu_kv *)emu_acquire(h, OBJ_KV);
    if (!kv)
        return CALRT_ERR_INVALID_VALUE;
    if (seq < 0 || seq >= kv->max_seqs)
        return emu_unlock_rc(kv->h.dev, CALRT_ERR_INVALID_VALUE);
    *len = kv->seqs[seq].committed;
    return emu_unlock_rc(kv->h.dev, CALRT_SUCCESS);
}

static void seq_release(emu_kv *kv, int32_t seq)
{
    kv->free_blocks += kv->seqs[seq].reserved_blocks;
    kv->seqs[seq].reserved_blocks = 0;
    kv->seqs[seq].committed = 0;
}

int32_t calrt_kv_release(calrt_kv *h, int32_t seq)
{
    emu_kv *kv = (emu_kv *)emu_acquire(h, OBJ_KV);
    if (!kv)
        return CALRT_ERR_INVALID_VALUE;
    if (seq < 0 || seq >= kv->max_seqs)
        return emu_unlock_rc(kv->h.dev, CALRT_ERR_INVALID_VALUE);
    seq_release(kv, seq);
    return emu_unlock_rc(kv->h.dev, CALRT_SUCCESS);
}

/* ---- jobs ------------------------------------------------------------------------------------ */

/* The region of input tensor i the job reads: cur rows of the valid region. */
static int32_t job_region(const emu_model *m, const emu_inbuf *ib, int i, uint32_t cur, const uint8_t **host,
                          uint64_t *bytes)
{
    const emu_tensor *t = &m->in[i];
    const emu_map *mp = &ib->t[i];
    if (!mp->mapped)
        return CALRT_ERR_INVALID_VALUE;
    /* Whole rows: calrt_inputbuf_slice admits only those, and the whole tensor is whole rows. */
    uint64_t off = mp->sliced ? mp->off : 0, cnt = mp->sliced ? mp->cnt : t->elems;
    if (cnt / t->row_elems < cur)
        return CALRT_ERR_OUT_OF_BOUNDS;
    uint64_t start = off * t->elem_size, len = (uint64_t)cur * t->row_elems * t->elem_size;
    if (start > mp->size || len > mp->size - start)
        return CALRT_ERR_OUT_OF_BOUNDS;
    *host = (const uint8_t *)mp->host + start;
    *bytes = len;
    return CALRT_SUCCESS;
}

static int32_t infer_locked(emu_device *dev, emu_model *m, emu_kv *kv, int32_t seq, emu_inbuf *ib, emu_outbuf *ob,
                            int32_t task)
{
    if (!dev->configured)
        return CALRT_ERR_MISSING_CONFIG;
    if (m->cb != dev->configured || kv->cb != m->cb)
        return CALRT_ERR_INVALID_CONFIG;
    if (seq < 0 || seq >= kv->max_seqs || ib->m != m || ob->m != m)
        return CALRT_ERR_INVALID_VALUE;
    if (task < -1 || task > CALRT_TASK_PONG)
        return CALRT_ERR_INVALID_VALUE;
    if (task == CALRT_TASK_PONG && !dev->parallel)
        return CALRT_ERR_UNSUPPORTED;
    if (ob->job)
        return CALRT_ERR_DEVICE_BUSY;
    int64_t cur = -1, total = -1;
    for (int i = 0; i < m->n_csr; i++) {
        if (m->csr_role[i] == CSR_CUR && ib->csr_set[i])
            cur = ib->csr_val[i];
        if (m->csr_role[i] == CSR_TOTAL && ib->csr_set[i])
            total = ib->csr_val[i];
    }
    if (cur < 1 || total < cur)
        return CALRT_ERR_INVALID_VALUE;
    if ((uint64_t)total > m->max_seq || (uint64_t)cur > m->rows)
        return CALRT_ERR_OUT_OF_BOUNDS;
    for (int i = 0; i < m->n_in; i++)
        if (!ib->t[i].mapped)
            return CALRT_ERR_INVALID_VALUE;
    const uint8_t *host[2];
    uint64_t bytes[2];
    int32_t rc = job_region(m, ib, m->idx_tokens, (uint32_t)cur, &host[0], &bytes[0]);
    if (rc == CALRT_SUCCESS)
        rc = job_region(m, ib, m->idx_pos, (uint32_t)cur, &host[1], &bytes[1]);
    if (rc != CALRT_SUCCESS)
        return rc;
    if (!ob->map.mapped)
        return CALRT_ERR_INVALID_VALUE;
    if (ob->map.size != m->out[0].byte_size)
        return CALRT_ERR_SHAPE_MISMATCH;
    if (emu_fault_fire(dev, CALRT_EMU_FAULT_SUBMIT_RC))
        return dev->faults[CALRT_EMU_FAULT_SUBMIT_RC].rc ? dev->faults[CALRT_EMU_FAULT_SUBMIT_RC].rc
                                                         : CALRT_ERR_DEVICE_BUSY;
    int e = task >= 0 ? task : (dev->parallel && dev->eng[1].count < dev->eng[0].count) ? 1 : 0;
    emu_engine *eng = &dev->eng[e];
    if (eng->count >= dev->k.queue_depth)
        return CALRT_ERR_DEVICE_BUSY;
    emu_job *job = (emu_job *)calloc(1, sizeof *job);
    if (job)
        job->staging = (uint8_t *)malloc(bytes[0] + bytes[1]);
    if (!job || !job->staging) {
        free(job);
        return CALRT_ERR_MEM_ALLOC;
    }
    job->id = ++dev->next_job_id;
    job->epoch = dev->epoch;
    job->engine = e;
    job->stage = CALRT_EMU_STAGE_H2D;
    job->m = m;
    job->kv = kv;
    job->seq = seq;
    job->past = (uint32_t)(total - cur);
    job->cur = (uint32_t)cur;
    job->ib = ib;
    job->ob = ob;
    /* The guard is a property of the job, fixed here: the stages compare against checksums
     * taken now, so a job submitted with the guard off has none to compare against, whatever
     * the knob says when it runs. */
    job->guard = dev->k.dma_guard != 0;
    for (int i = 0; i < 2; i++) {
        job->in_host[i] = host[i];
        job->in_bytes[i] = bytes[i];
        if (job->guard)
            job->in_sum[i] = emu_checksum(host[i], bytes[i]);
    }
    if (job->guard)
        job->out_sum = emu_checksum(ob->map.host, ob->map.size);
    job->f_ccu = emu_fault_fire(dev, CALRT_EMU_FAULT_CCU_EXCEPTION);
    job->f_nan = emu_fault_fire(dev, CALRT_EMU_FAULT_OUTPUT_NAN);
    job->f_inf = emu_fault_fire(dev, CALRT_EMU_FAULT_OUTPUT_INF);
    job->f_short = emu_fault_fire(dev, CALRT_EMU_FAULT_OUTPUT_SHORT);
    job->f_hang = emu_fault_fire(dev, CALRT_EMU_FAULT_HANG);
    job->f_stale = emu_fault_fire(dev, CALRT_EMU_FAULT_STALE_COMPLETION);
    ob->job = job;
    ob->status = CALRT_JOB_PENDING;
    ob->valid_bytes = 0;
    ib->inflight++;
    kv->inflight++;
    if (eng->tail)
        eng->tail->next = job;
    else
        eng->head = job;
    eng->tail = job;
    eng->count++;
    job->ready_ns = emu_now_ns(); /* the device starts it now in the model, not when its thread wakes */
    dev->c.jobs_submitted++;
    emu_wake_engines(dev);
    return CALRT_SUCCESS;
}

static int32_t infer_any(calrt_device *dh, calrt_model *mh, calrt_kv *kh, int32_t seq, calrt_inputbuf *ih,
                         calrt_outputbuf *oh, int32_t task)
{
    pthread_mutex_lock(&g_reg_mu);
    emu_device *dev = (emu_device *)reg_get(dh, OBJ_DEVICE);
    emu_model *m = (emu_model *)reg_get(mh, OBJ_MODEL);
    emu_kv *kv = (emu_kv *)reg_get(kh, OBJ_KV);
    emu_inbuf *ib = (emu_inbuf *)reg_get(ih, OBJ_INBUF);
    emu_outbuf *ob = (emu_outbuf *)reg_get(oh, OBJ_OUTBUF);
    if (!dev || !m || !kv || !ib || !ob || m->h.dev != dev || kv->h.dev != dev || ib->h.dev != dev ||
        ob->h.dev != dev) {
        pthread_mutex_unlock(&g_reg_mu);
        return CALRT_ERR_INVALID_VALUE;
    }
    pthread_mutex_lock(&dev->mu);
    pthread_mutex_unlock(&g_reg_mu);
    return emu_unlock_rc(dev, infer_locked(dev, m, kv, seq, ib, ob, task));
}

int32_t calrt_infer(calrt_device *dev, calrt_model *model, calrt_kv *kv, int32_t seq, calrt_inputbuf *inbuf,
                    calrt_outputbuf *outbuf)
{
    return infer_any(dev, model, kv, seq, inbuf, outbuf, -1);
}

int32_t calrt_infer_with_fixed_task_type(calrt_device *dev, calrt_model *model, calrt_kv *kv, int32_t seq,
                                         calrt_inputbuf *inbuf, calrt_outputbuf *outbuf, int32_t task_type)
{
    if (task_type != CALRT_TASK_PING && task_type != CALRT_TASK_PONG)
        return CALRT_ERR_INVALID_VALUE;
    return infer_any(dev, model, kv, seq, inbuf, outbuf, task_type);
}

static struct timespec ns_to_ts(int64_t ns)
{
    struct timespec ts;
    ts.tv_sec = (time_t)(ns / 1000000000LL);
    ts.tv_nsec = (long)(ns % 1000000000LL);
    return ts;
}

int32_t calrt_wait(calrt_outputbuf *h, int64_t timeout_us)
{
    emu_outbuf *ob = (emu_outbuf *)emu_acquire(h, OBJ_OUTBUF);
    if (!ob)
        return CALRT_ERR_INVALID_VALUE;
    emu_device *dev = ob->h.dev;
    if (ob->status == CALRT_JOB_IDLE)
        return emu_unlock_rc(dev, CALRT_ERR_INVALID_VALUE);
    if (emu_fault_fire(dev, CALRT_EMU_FAULT_WAIT_RC)) {
        int32_t rc = dev->faults[CALRT_EMU_FAULT_WAIT_RC].rc ? dev->faults[CALRT_EMU_FAULT_WAIT_RC].rc
                                                             : CALRT_ERR_TIMEOUT;
        if (ob->job && ob->job->computed)
            /* the job already committed its KV at the end of compute: apply the policy now */
            emu_kv_fail_policy(dev, ob->job->kv, ob->job->seq, ob->job->past, ob->job->cur);
        else if (ob->job)
            ob->job->kv_failed = 1;
        else if (ob->status == CALRT_JOB_DONE && dev->kv && dev->kv->serial == ob->last_kv_serial)
            emu_kv_fail_policy(dev, dev->kv, ob->last_seq, ob->last_past, ob->last_cur);
        return emu_unlock_rc(dev, rc);
    }
    int32_t rc = CALRT_SUCCESS;
    int64_t deadline = timeout_us >= 0 ? emu_now_ns() + timeout_us * 1000 : 0;
    struct timespec ts = ns_to_ts(deadline);
    ob->waiters++;
    dev->waiters++;
    while (ob->job && !dev->closing) {
        if (timeout_us < 0) {
            pthread_cond_wait(&dev->done_cv, &dev->mu);
        } else if (emu_now_ns() >= deadline) {
            rc = CALRT_ERR_TIMEOUT;
            break;
        } else {
            pthread_cond_timedwait(&dev->done_cv, &dev->mu, &ts);
        }
    }
    if (dev->closing)
        rc = CALRT_ERR_DEVICE_UNAVAILABLE;
    ob->waiters--;
    dev->waiters--;
    if (dev->closing)
        pthread_cond_broadcast(&dev->stage_cv);
    return emu_unlock_rc(dev, rc);
}

int32_t calrt_get_status(calrt_outputbuf *h, int32_t *status)
{
    if (!status)
        return CALRT_ERR_INVALID_VALUE;
    emu_outbuf *ob = (emu_outbuf *)emu_acquire(h, OBJ_OUTBUF);
    if (!ob)
        return CALRT_ERR_INVALID_VALUE;
    *status = ob->status;
    return emu_unlock_rc(ob->h.dev, CALRT_SUCCESS);
}

int32_t calrt_outputbuf_valid_bytes(calrt_outputbuf *h, uint64_t *bytes)
{
    if (!bytes)
        return CALRT_ERR_INVALID_VALUE;
    emu_outbuf *ob = (emu_outbuf *)emu_acquire(h, OBJ_OUTBUF);
    if (!ob)
        return CALRT_ERR_INVALID_VALUE;
    *bytes = ob->valid_bytes;
    return emu_unlock_rc(ob->h.dev, CALRT_SUCCESS);
}

/* ---- device control ------------------------------------------------------------------------ */

int32_t calrt_enable_parallel_mode(calrt_device *h, int32_t on)
{
    emu_device *dev = (emu_device *)emu_acquire(h, OBJ_DEVICE);
    if (!dev)
        return CALRT_ERR_INVALID_VALUE;
    if (!on && dev->eng[1].count > 0)
        return emu_unlock_rc(dev, CALRT_ERR_DEVICE_BUSY);
    dev->parallel = on != 0;
    return emu_unlock_rc(dev, CALRT_SUCCESS);
}

/* Abort every queued/running job (after the stage in progress), keeping stale-completion
 * ghosts for jobs whose fault is armed. */
static void abort_jobs(emu_device *dev)
{
    for (int e = 0; e < NUM_ENGINES; e++) {
        emu_engine *eng = &dev->eng[e];
        while (eng->head) {
            emu_job *job = eng->head;
            eng->head = job->next;
            eng->count--;
            if (job->f_stale) {
                emu_ghost *g = (emu_ghost *)calloc(1, sizeof *g);
                uint64_t size = job->m->out[0].byte_size;
                if (g && (g->data = (uint8_t *)malloc(size))) {
                    if (job->ob->devmem_written)
                        memcpy(g->data, job->ob->devmem, size);
                    else
                        memset(g->data, 0, size);
                    g->host = job->ob->map.host;
                    g->size = size;
                    g->due_ns = emu_now_ns() + dev->k.stale_delay_us * 1000;
                    emu_ghost **pp = &dev->ghosts;
                    while (*pp)
                        pp = &(*pp)->next;
                    *pp = g;
                    dev->c.stale_pending++;
                } else {
                    free(g);
                }
            }
            emu_job_finish(dev, job, CALRT_JOB_ABORTED);
        }
        eng->tail = NULL;
    }
    dev->job_owner = dev->compute_owner = -1;
    dev->epoch++;
}

static int32_t do_reset(calrt_device *h, int kind)
{
    emu_device *dev = (emu_device *)emu_acquire(h, OBJ_DEVICE);
    if (!dev)
        return CALRT_ERR_INVALID_VALUE;
    int64_t scope = kind == 0 ? dev->k.reset_ccu_scope : kind == 1 ? dev->k.reset_config_scope : dev->k.reset_scope;
    if (!emu_wait_out_of_stages(dev))
        return emu_unlock_rc(dev, CALRT_ERR_DEVICE_UNAVAILABLE);
    if (scope & CALRT_EMU_SCOPE_JOBS)
        abort_jobs(dev);
    if ((scope & CALRT_EMU_SCOPE_KV) && dev->kv)
        for (int32_t i = 0; i < dev->kv->max_seqs; i++)
            seq_release(dev->kv, i);
    if (scope & CALRT_EMU_SCOPE_CONFIG)
        dev->configured = NULL;
    if (kind == 0)
        dev->c.resets_ccu++;
    else if (kind == 1)
        dev->c.resets_configuration++;
    else
        dev->c.resets_full++;
    emu_wake_engines(dev);
    pthread_cond_broadcast(&dev->done_cv);
    return emu_unlock_rc(dev, CALRT_SUCCESS);
}

int32_t calrt_reset_ccu(calrt_device *dev) { return do_reset(dev, 0); }
int32_t calrt_reset_configuration(calrt_device *dev) { return do_reset(dev, 1); }
int32_t calrt_reset(calrt_device *dev) { return do_reset(dev, 2); }
