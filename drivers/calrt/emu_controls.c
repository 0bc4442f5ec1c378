/*
 * CalRT emulator, calrt_emu_ controls (calrt_emu.h): latency, knobs, the fault plan,
 * stepped mode, counters and the UndoSlice-forgotten query.
 */
#define _POSIX_C_SOURCE 200809L

#include <string.h>

#include "emu_internal.h"

int32_t calrt_emu_set_latency(calrt_device *h, int64_t h2d_us, int64_t prefill_per_token_us, int64_t decode_us,
                              int64_t d2h_us)
{
    /* the same 0..60 s range the knobs accept (a huge sleep would wedge a stage) */
    const int64_t max_us = 60000000;
    if (h2d_us < 0 || prefill_per_token_us < 0 || decode_us < 0 || d2h_us < 0 || h2d_us > max_us ||
        prefill_per_token_us > max_us || decode_us > max_us || d2h_us > max_us)
        return CALRT_ERR_INVALID_VALUE;
    emu_device *dev = (emu_device *)emu_acquire(h, OBJ_DEVICE);
    if (!dev)
        return CALRT_ERR_INVALID_VALUE;
    dev->k.h2d_us = h2d_us;
    dev->k.prefill_per_token_us = prefill_per_token_us;
    dev->k.decode_us = decode_us;
    dev->k.d2h_us = d2h_us;
    return emu_unlock_rc(dev, CALRT_SUCCESS);
}

int32_t calrt_emu_set_knob(calrt_device *h, const char *key, int64_t value)
{
    const knob_def *k = emu_knob_find(key);
    emu_device *dev = (emu_device *)emu_acquire(h, OBJ_DEVICE);
    if (!dev)
        return CALRT_ERR_INVALID_VALUE;
    if (!k || k->open_only)
        return emu_unlock_rc(dev, CALRT_ERR_INVALID_CONFIG);
    if (value < k->min || value > k->max)
        return emu_unlock_rc(dev, CALRT_ERR_INVALID_VALUE);
    int64_t stepped = dev->k.stepped;
    *emu_knob_ptr(dev, k) = value;
    if (stepped && !dev->k.stepped)
        dev->resumed_ns = emu_now_ns();
    emu_wake_engines(dev);
    return emu_unlock_rc(dev, CALRT_SUCCESS);
}

int32_t calrt_emu_get_knob(calrt_device *h, const char *key, int64_t *value)
{
    const knob_def *k = emu_knob_find(key);
    if (!value)
        return CALRT_ERR_INVALID_VALUE;
    emu_device *dev = (emu_device *)emu_acquire(h, OBJ_DEVICE);
    if (!dev)
        return CALRT_ERR_INVALID_VALUE;
    if (!k)
        return emu_unlock_rc(dev, CALRT_ERR_INVALID_CONFIG);
    *value = *emu_knob_ptr(dev, k);
    return emu_unlock_rc(dev, CALRT_SUCCESS);
}

int32_t calrt_emu_fault_set(calrt_device *h, int32_t point, int32_t mode, uint64_t param, uint64_t seed, int32_t rc)
{
    if (point < 0 || point >= CALRT_EMU_FAULT_COUNT || mode < CALRT_EMU_MODE_OFF || mode > CALRT_EMU_MODE_ALWAYS)
        return CALRT_ERR_INVALID_VALUE;
    if ((mode == CALRT_EMU_MODE_NTH || mode == CALRT_EMU_MODE_EVERY_K) && param < 1)
        return CALRT_ERR_INVALID_VALUE;
    if ((mode == CALRT_EMU_MODE_PROB && param > 1000000) || rc < 0 || rc > 29)
        return CALRT_ERR_INVALID_VALUE;
    emu_device *dev = (emu_device *)emu_acquire(h, OBJ_DEVICE);
    if (!dev)
        return CALRT_ERR_INVALID_VALUE;
    emu_fault *f = &dev->faults[point];
    f->mode = mode;
    f->param = param;
    f->rng = seed;
    f->rc = rc;
    f->calls = 0;
    f->fired = 0;
    return emu_unlock_rc(dev, CALRT_SUCCESS);
}

int32_t calrt_emu_fault_clear(calrt_device *h, int32_t point)
{
    if (point < 0 || point >= CALRT_EMU_FAULT_COUNT)
        return CALRT_ERR_INVALID_VALUE;
    emu_device *dev = (emu_device *)emu_acquire(h, OBJ_DEVICE);
    if (!dev)
        return CALRT_ERR_INVALID_VALUE;
    dev->faults[point].mode = CALRT_EMU_MODE_OFF;
    return emu_unlock_rc(dev, CALRT_SUCCESS);
}

int32_t calrt_emu_fault_stats(calrt_device *h, int32_t point, uint64_t *calls, uint64_t *fired)
{
    if (point < 0 || point >= CALRT_EMU_FAULT_COUNT || !calls || !fired)
        return CALRT_ERR_INVALID_VALUE;
    emu_device *dev = (emu_device *)emu_acquire(h, OBJ_DEVICE);
    if (!dev)
        return CALRT_ERR_INVALID_VALUE;
    *calls = dev->faults[point].calls;
    *fired = dev->faults[point].fired;
    return emu_unlock_rc(dev, CALRT_SUCCESS);
}

int32_t calrt_emu_set_stepped(calrt_device *h, int32_t on)
{
    emu_device *dev = (emu_device *)emu_acquire(h, OBJ_DEVICE);
    if (!dev)
        return CALRT_ERR_INVALID_VALUE;
    if (dev->k.stepped && !on)
        dev->resumed_ns = emu_now_ns();
    dev->k.stepped = on != 0;
    emu_wake_engines(dev);
    /* The caller owns the engines from here: the stage a device thread is in ends first,
     * so its next calrt_emu_step never meets 17. */
    if (on && !emu_wait_out_of_stages(dev))
        return emu_unlock_rc(dev, CALRT_ERR_DEVICE_UNAVAILABLE);
    return emu_unlock_rc(dev, CALRT_SUCCESS);
}

int32_t calrt_emu_step(calrt_device *h, int32_t engine, int32_t what, int32_t *did)
{
    if (!did || engine < 0 || engine >= NUM_ENGINES || what < CALRT_EMU_STAGE_NONE || what > CALRT_EMU_STAGE_JOB)
        return CALRT_ERR_INVALID_VALUE;
    emu_device *dev = (emu_device *)emu_acquire(h, OBJ_DEVICE);
    if (!dev)
        return CALRT_ERR_INVALID_VALUE;
    if (!dev->k.stepped)
        return emu_unlock_rc(dev, CALRT_ERR_INVALID_VALUE);
    if (emu_deliver_ghost_locked(dev)) {
        *did = CALRT_EMU_DID_STALE;
        return emu_unlock_rc(dev, CALRT_SUCCESS);
    }
    return emu_unlock_rc(dev, emu_engine_advance(dev, engine, what, did));
}

int32_t calrt_emu_pending(calrt_device *h, int32_t engine, int32_t *jobs, int32_t *next_stage)
{
    if (!jobs || !next_stage || engine < 0 || engine >= NUM_ENGINES)
        return CALRT_ERR_INVALID_VALUE;
    emu_device *dev = (emu_device *)emu_acquire(h, OBJ_DEVICE);
    if (!dev)
        return CALRT_ERR_INVALID_VALUE;
    *jobs = dev->eng[engine].count;
    *next_stage = dev->eng[engine].head ? dev->eng[engine].head->stage : CALRT_EMU_STAGE_NONE;
    return emu_unlock_rc(dev, CALRT_SUCCESS);
}

int32_t calrt_emu_get_counters(calrt_device *h, calrt_emu_counters *out)
{
    if (!out)
        return CALRT_ERR_INVALID_VALUE;
    emu_device *dev = (emu_device *)emu_acquire(h, OBJ_DEVICE);
    if (!dev)
        return CALRT_ERR_INVALID_VALUE;
    *out = dev->c;
    return emu_unlock_rc(dev, CALRT_SUCCESS);
}

int32_t calrt_emu_inputbuf_active_slices(calrt_inputbuf *h, int32_t *count)
{
    if (!count)
        return CALRT_ERR_INVALID_VALUE;
    emu_inbuf *b = (emu_inbuf *)emu_acquire(h, OBJ_INBUF);
    if (!b)
        return CALRT_ERR_INVALID_VALUE;
    int32_t n = 0;
    for (int i = 0; i < b->m->n_in; i++)
        n += b->t[i].sliced;
    *count = n;
    return emu_unlock_rc(b->h.dev, CALRT_SUCCESS);
}

int32_t calrt_emu_outputbuf_copy_ns(calrt_outputbuf *h, int64_t *h2d_ns, int64_t *d2h_ns)
{
    if (!h2d_ns || !d2h_ns)
        return CALRT_ERR_INVALID_VALUE;
    emu_outbuf *b = (emu_outbuf *)emu_acquire(h, OBJ_OUTBUF);
    if (!b)
        return CALRT_ERR_INVALID_VALUE;
    *h2d_ns = b->last_h2d_ns;
    *d2h_ns = b->last_d2h_ns;
    return emu_unlock_rc(b->h.dev, CALRT_SUCCESS);
}
