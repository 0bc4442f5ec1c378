#ifndef CALRT_H
#define CALRT_H
#include <stdint.h>

/*
 * CalRT C ABI: the subset of Calculet CalRT 0.7.6 that the calexec executor uses.
 *
 * A thin shim over the vendor C++ SDK can implement this header; the bundled emulator
 * (emulator.c) implements it too. The header is plain C99 with no macros besides the include
 * guard and <stdint.h>: build_ffi.py drops preprocessor lines and feeds the rest to
 * ffi.cdef, so one text serves the API-mode module and ffi.dlopen() of a vendor shim.
 *
 * General contract (applies to every function):
 *  - Every function returns an int32_t code from calrt_rc (0 success, 1..29 the spec's
 *    section 8 numbers) unless documented otherwise. Codes are never hidden or remapped.
 *  - Handles are opaque. A NULL, destroyed (stale) or wrong-type handle returns
 *    CALRT_ERR_INVALID_VALUE; an implementation must never dereference freed memory
 *    (the emulator uses generation-checked handle ids, not pointers).
 *  - Out-parameters are written only on success.
 *  - Thread safety: all functions may be called from any thread. Calls on objects of one
 *    device are serialised internally, except calrt_wait, which blocks without holding any
 *    lock. Destroying an object that another thread is using at the same moment is the
 *    caller's bug, but never a crash: the destroy either wins (the other call sees a stale
 *    handle) or reports CALRT_ERR_DEVICE_BUSY.
 *  - Nothing returns malloc'd memory: strings go to fixed arrays or caller buffers.
 *  - Blocking: only calrt_wait blocks (bounded by its timeout); calrt_device_close and
 *    the resets wait for the device to finish the stage (H2D/compute/D2H) it is in.
 */

typedef enum calrt_rc {
    CALRT_SUCCESS = 0,
    CALRT_ERR_MEM_ALLOC = 1,
    CALRT_ERR_ALREADY_REGISTERED = 2,
    CALRT_ERR_INVALID_VALUE = 4,
    CALRT_ERR_INVALID_CONFIG = 5,
    CALRT_ERR_ALREADY_CONFIGURED = 7,
    CALRT_ERR_DRIVER_INCOMPATIBLE = 8,
    CALRT_ERR_RUNTIME_TOO_OLD = 9,
    CALRT_ERR_FILE_NOT_FOUND = 10,
    CALRT_ERR_FILE_READ = 11,
    CALRT_ERR_FILE_FORMAT = 12,
    CALRT_ERR_TIMEOUT = 13,
    CALRT_ERR_OUT_OF_BOUNDS = 14,
    CALRT_ERR_UNEXPECTED = 15,
    CALRT_ERR_MISSING_CONFIG = 16,
    CALRT_ERR_DEVICE_BUSY = 17,
    CALRT_ERR_DEVICE_UNAVAILABLE = 18,
    CALRT_ERR_INVALID_CALBIN = 19,
    CALRT_ERR_UNKNOWN = 20,
    CALRT_ERR_DTYPE_MISMATCH = 21,
    CALRT_ERR_SHAPE_MISMATCH = 22,
    CALRT_ERR_DEPENDENCY = 23,
    CALRT_ERR_MAP_BROKEN = 24,
    CALRT_ERR_SOFT_RESET_FAILED = 25,
    CALRT_ERR_UNSUPPORTED = 27,
    CALRT_ERR_DEVICE_CRASH = 28,
    CALRT_ERR_WRONG_DIRECTION = 29
} calrt_rc;

/* Element types of tensors and of mapped host memory. */
typedef enum calrt_dtype {
    CALRT_DTYPE_INVALID = 0,
    CALRT_DTYPE_U8 = 1,
    CALRT_DTYPE_S32 = 2,
    CALRT_DTYPE_F32 = 3,
    CALRT_DTYPE_BF16 = 4,
    CALRT_DTYPE_F16 = 5,
    CALRT_DTYPE_S64 = 6
} calrt_dtype;

/* Engine slot of infer_with_fixed_task_type (two chiplets in parallel mode). */
typedef enum calrt_task_type {
    CALRT_TASK_PING = 0,
    CALRT_TASK_PONG = 1
} calrt_task_type;

/* Status of the last job submitted on an output buffer (calrt_get_status). */
typedef enum calrt_job_status {
    CALRT_JOB_IDLE = 0,               /* no job was ever submitted on this buffer */
    CALRT_JOB_PENDING = 1,            /* accepted by infer(), queued, H2D not started */
    CALRT_JOB_RUNNING = 2,            /* H2D started; compute/D2H in progress */
    CALRT_JOB_DONE = 3,               /* executed, output written, KV committed */
    CALRT_JOB_DONE_CCU_EXCEPTION = 4, /* the CCU faulted; output not written (see KV rules) */
    CALRT_JOB_ABORTED = 5             /* discarded by a reset before it finished */
} calrt_job_status;

typedef enum calrt_limits {
    CALRT_NAME_MAX = 64,   /* names include the terminating NUL */
    CALRT_MAX_RANK = 8
} calrt_limits;

typedef struct calrt_device calrt_device;
typedef struct calrt_calbin calrt_calbin;
typedef struct calrt_model calrt_model;
typedef struct calrt_inputbuf calrt_inputbuf;
typedef struct calrt_outputbuf calrt_outputbuf;
typedef struct calrt_kv calrt_kv;

/* One tensor of a model. shape[i] for i >= rank is 0. byte_size = product(shape) * elem size. */
typedef struct calrt_tensor_info {
    char name[64];
    int32_t dtype;      /* calrt_dtype */
    int32_t rank;
    uint64_t shape[8];
    uint64_t byte_size;
    int32_t sliceable;  /* 1 when SliceTensor may restrict the region the device reads */
} calrt_tensor_info;

/* ---- runtime and device ------------------------------------------------------------ */

/* Version string of the runtime, static storage, never NULL (e.g. "0.7.6-emu"). */
const char *calrt_version(void);

/* Open the virtual device. config: NULL or "" for defaults, else "key=value;key=value".
 * An implementation may ignore keys it does not know only if it documents so; the emulator
 * rejects an unknown key or bad value with CALRT_ERR_INVALID_CONFIG (keys: calrt_emu.h).
 * Returns 1 when out of memory/threads. The device starts unconfigured, parallel mode off. */
int32_t calrt_device_open(const char *config, calrt_device **out);

/* Close the device: discards queued and running jobs (after the current stage), invalidates
 * every handle created from it (calbins, models, buffers, KV managers) and wakes blocked
 * calrt_wait callers (they return 18). Host memory mapped into buffers is never touched
 * afterwards. Stale handle -> 4. */
int32_t calrt_device_close(calrt_device *dev);

/* ---- calbin and configuration ------------------------------------------------------- */

/* Load a calbin file. 10 not found, 11 unreadable, 12 not a calbin (bad header),
 * 19 header fine but content invalid. The calbin's models stay valid until unload. */
int32_t calrt_calbin_load(calrt_device *dev, const char *path, calrt_calbin **out);

/* Unload: 17 while the device is configured with it, a KV manager uses it or buffers of its
 * models exist (destroy them first). */
int32_t calrt_calbin_unload(calrt_calbin *calbin);

/* Configure the device with a loaded calbin. 7 when already configured (use
 * calrt_reset_configuration first); jobs on an unconfigured device fail with 16. */
int32_t calrt_configure(calrt_device *dev, calrt_calbin *calbin);

/* GetAllModels: writes up to cap model handles and the total number of models to *count
 * (so cap = 0 queries the count). Order is the calbin's order. */
int32_t calrt_get_all_models(calrt_calbin *calbin, calrt_model **out, int32_t cap, int32_t *count);

/* ---- model introspection (no side effects) ------------------------------------------ */

/* Copy the model's name into buf (cap bytes, NUL-terminated); 14 when cap is too small. */
int32_t calrt_model_name(calrt_model *model, char *buf, uint64_t cap);
int32_t calrt_model_num_inputs(calrt_model *model, int32_t *count);
int32_t calrt_model_num_outputs(calrt_model *model, int32_t *count);
/* Tensor info by index; 14 when index is out of range. */
int32_t calrt_model_input_info(calrt_model *model, int32_t index, calrt_tensor_info *out);
int32_t calrt_model_output_info(calrt_model *model, int32_t index, calrt_tensor_info *out);
/* CSR (control/status register) names by index; 14 out of range or cap too small. */
int32_t calrt_model_num_csrs(calrt_model *model, int32_t *count);
int32_t calrt_model_csr_name(calrt_model *model, int32_t index, char *buf, uint64_t cap);
/* Graph metadata: by key (4 when the key is unknown) and by index (14 out of range).
 * Keys of the Qwen3 graphs: logits_tile_d0, max_seq, max_batch, vocab, hidden. */
int32_t calrt_model_meta(calrt_model *model, const char *key, int64_t *out);
int32_t calrt_model_num_meta(calrt_model *model, int32_t *count);
int32_t calrt_model_meta_at(calrt_model *model, int32_t index, char *key, uint64_t cap, int64_t *value);

/* ---- buffers ------------------------------------------------------------------------- */

/* Create the runtime buffers of a model (device-side memory for the outputs). 1 when out
 * of memory. A buffer serves only jobs of its model. */
int32_t calrt_inputbuf_create(calrt_model *model, calrt_inputbuf **out);
int32_t calrt_outputbuf_create(calrt_model *model, calrt_outputbuf **out);
/* Destroy: 17 while a submitted job still uses the buffer or a thread waits on it. */
int32_t calrt_inputbuf_destroy(calrt_inputbuf *buf);
int32_t calrt_outputbuf_destroy(calrt_outputbuf *buf);

/* MapBuf: bind caller-owned host memory to an input tensor. The memory must stay valid and
 * unmoved until the buffer is destroyed or the tensor remapped, and must not be written
 * between infer() and the job's completion: the device reads it at H2D time, not at
 * infer() time. dtype is the element type of the host memory.
 * 4 unknown tensor / NULL host, 21 dtype differs from the tensor's, 14 size > ByteSize,
 * 22 size not a multiple of the element size, 17 while a job of this buffer is in flight.
 * Remapping replaces the previous mapping and clears the tensor's slice. */
int32_t calrt_inputbuf_map(calrt_inputbuf *buf, const char *tensor, int32_t dtype, void *host, uint64_t size);

/* MapBuf for an output tensor: the device writes it at D2H time. Same rules and codes. */
int32_t calrt_outputbuf_map(calrt_outputbuf *buf, const char *tensor, int32_t dtype, void *host, uint64_t size);

/* SliceTensor: the valid region the device reads is elements [offset, offset + count) of
 * the flattened tensor. The device reads whole rows (a row is shape[2] * ... * shape[rank-1]
 * elements, 1 for rank 2), so offset and count must both be multiples of the row.
 * 4 unknown tensor, count 0, or offset/count not a whole number of rows; 27 tensor not
 * sliceable; 14 region beyond the tensor (overflow-safe; checked before the rows).
 * The slice stays active until UndoSlice or a remap; a pooled buffer returned with an
 * active slice is a caller bug (see calrt_emu.h). */
int32_t calrt_inputbuf_slice(calrt_inputbuf *buf, const char *tensor, uint64_t offset_elems, uint64_t count_elems);
/* UndoSlice: the whole tensor is valid again. 4 unknown tensor; no-op without a slice. */
int32_t calrt_inputbuf_undo_slice(calrt_inputbuf *buf, const char *tensor);

/* SetCsrByName: value is latched into the buffer and snapshotted by infer(). 4 unknown name.
 * Every model has cur_seq_len (tokens in the job) and total_seq_len (past + cur). */
int32_t calrt_inputbuf_set_csr(calrt_inputbuf *buf, const char *name, int64_t value);

/* ---- KV manager ---------------------------------------------------------------------- */

/* Create the device's KV manager for a calbin's models. Capacity and block size come from
 * the device config. At most one per device: a second returns 2. Destroy: 17 while a
 * submitted job uses it. */
int32_t calrt_kv_create(calrt_device *dev, calrt_calbin *calbin, calrt_kv **out);
int32_t calrt_kv_destroy(calrt_kv *kv);
/* Geometry: block size in tokens, total blocks, free blocks, sequence slots. */
int32_t calrt_kv_geometry(calrt_kv *kv, uint32_t *block_size, uint32_t *capacity_blocks, uint32_t *free_blocks, int32_t *max_seqs);

/* canAllocate: 1 when n_blocks free blocks exist now, else 0 (also 0 for a bad handle).
 * Returns a bool, not a code, exactly as 0.7.6. */
int32_t calrt_kv_can_allocate(calrt_kv *kv, uint32_t n_blocks);

/* Apply: make seq's reservation exactly ceil(target_len / block_size) blocks (grow or
 * shrink). Shrinking below the committed length truncates the committed length to
 * target_len. Returns 1 on success, 0 on any failure (not enough free blocks, bad seq,
 * target beyond max_seq, bad handle) with NO reason, exactly as 0.7.6.
 * The device (not Apply) advances the committed length to past + cur when a job executes
 * successfully; a job whose past + cur exceeds the reservation ends DONE_CCU_EXCEPTION,
 * and so does a job whose past_len exceeds the committed length. A job with
 * past_len < committed length rewinds: it continues from the state at past_len. */
int32_t calrt_kv_apply(calrt_kv *kv, int32_t seq, uint32_t target_len);

/* Device-committed length of seq (4 bad seq). */
int32_t calrt_kv_seq_len(calrt_kv *kv, int32_t seq, uint32_t *len);
/* Free seq: reservation and committed length become 0 (4 bad seq). */
int32_t calrt_kv_release(calrt_kv *kv, int32_t seq);

/* ---- jobs ---------------------------------------------------------------------------- */

/* infer: validate, snapshot the CSRs / slices / mappings into a job descriptor, enqueue on
 * an engine and RETURN BEFORE EXECUTION. The engine is 0 (PING) unless parallel mode is on,
 * then the engine with fewer queued jobs. past_len of the job = total_seq_len - cur_seq_len.
 * Codes: 4 stale/NULL handles, handles of another device or model, seq out of range,
 * unmapped tensor, CSR missing or inconsistent (cur >= 1, total >= cur);
 * 16 device not configured; 5 model/KV not from the configured calbin;
 * 14 total beyond max_seq, cur beyond the model's rows, valid region smaller than cur rows
 * or beyond the mapped host memory; 22 output mapping smaller than ByteSize;
 * 17 the output buffer already has a job in flight or the engine queue is full.
 * The device later checks positions[i] == past_len + i and the KV rules (calrt_kv_apply);
 * violations end the job DONE_CCU_EXCEPTION, not an infer() error. */
int32_t calrt_infer(calrt_device *dev, calrt_model *model, calrt_kv *kv, int32_t seq,
                    calrt_inputbuf *inbuf, calrt_outputbuf *outbuf);

/* infer on a fixed engine: task_type PING (0) or PONG (1); 4 other values,
 * 27 PONG while parallel mode is off. Otherwise as calrt_infer. */
int32_t calrt_infer_with_fixed_task_type(calrt_device *dev, calrt_model *model, calrt_kv *kv, int32_t seq,
                                         calrt_inputbuf *inbuf, calrt_outputbuf *outbuf, int32_t task_type);

/* Wait for the last job submitted on outbuf. timeout_us < 0 waits forever, 0 polls.
 * 0 when the job has finished (any final status, check calrt_get_status), 13 timeout
 * (the job keeps running; Wait may be called again), 4 bad handle or no job ever submitted,
 * 18 the device was closed while waiting. Blocks in C without holding any lock (the cffi
 * module releases the GIL). */
int32_t calrt_wait(calrt_outputbuf *outbuf, int64_t timeout_us);

/* Status of the last job submitted on outbuf (calrt_job_status). */
int32_t calrt_get_status(calrt_outputbuf *outbuf, int32_t *status);

/* Bytes of the output the device actually wrote for the last finished job (== the tensor's
 * ByteSize for a normal job, 0 before completion or on a CCU exception). A short value means
 * the device produced less than the full tensor; bytes past it are stale host content. */
int32_t calrt_outputbuf_valid_bytes(calrt_outputbuf *outbuf, uint64_t *bytes);

/* ---- device control ------------------------------------------------------------------ */

/* EnableParallelMode: on != 0 lets engine 1 (PONG) run jobs beside engine 0.
 * Turning it off while engine 1 has jobs returns 17. */
int32_t calrt_enable_parallel_mode(calrt_device *dev, int32_t on);

/* Resets. What each one does to in-flight jobs, the KV of every sequence and the
 * configuration is vendor-unconfirmed (spec section 14); the emulator's default is:
 *   calrt_reset_ccu:           aborts queued and running jobs (status ABORTED), keeps KV
 *                              and configuration;
 *   calrt_reset_configuration: aborts jobs and unconfigures; keeps KV;
 *   calrt_reset:               aborts jobs, releases every sequence's KV, unconfigures.
 * (calrt_emu.h makes each scope configurable.) All return after the device finished the
 * stage it was in; the aborted jobs' host buffers are not touched again (unless the
 * emulator's stale-completion fault is armed). */
int32_t calrt_reset_ccu(calrt_device *dev);
int32_t calrt_reset_configuration(calrt_device *dev);
int32_t calrt_reset(calrt_device *dev);

#endif
