/*
 * spclient.h — libspclient, the client library of spd.
 *
 * A training process attaches to the spd daemon of its node, joins a job with the
 * other ranks, and submits collective operations. Control calls (attach, register,
 * jobs, queries) go over a Unix socket; operations go through shared-memory rings
 * and never touch a socket.
 *
 *   spc_handle_t *h;
 *   spc_attach(NULL, &h);                             // socket from SPC_SOCKET or the default
 *   spc_group_t world;
 *   spc_job_join(h, job_id, world_size, rank, 60000, &world);
 *   double *x = spc_alloc(h, n * sizeof *x);          // in the shared arena: zero copy
 *   spc_allreduce(h, world, x, x, n, SPC_F64, SPC_SUM, 10000);
 *   spc_detach(h);
 *
 * Threads: a handle is used by one thread at a time (serialize calls, or attach
 * one handle per thread). Different handles are independent.
 *
 * Processes: a handle belongs to the process that attached it. A child made by
 * fork() attaches its own handle and leaves the parent's alone (spdemo does so).
 * The daemon knows each client by the pid that connected.
 *
 * Errors: every call returns spc_status_t (spclient/status.h). When a call fails,
 * spc_last_error(h) holds a detail message ("rank 3 lost (pid 4711)").
 * Output parameters (`*_p`) are set only on success.
 *
 * Environment: SPC_SOCKET (daemon socket path), SPC_ARENA_BYTES, SPC_SQ_ENTRIES,
 * SPC_SPIN_US (how long a wait spins before it sleeps).
 */
#ifndef SPCLIENT_H
#define SPCLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "spclient/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define SPC_VERSION_MAJOR 0
#define SPC_VERSION_MINOR 1
#define SPC_VERSION_PATCH 0

/** Longest job id, including its NUL. */
#define SPC_JOB_ID_MAX 128
/** Most tensors one operation may name. */
#define SPC_OP_MAX_TENSORS 8

typedef struct spc_handle spc_handle_t;
typedef struct spc_request spc_request_t;

/** A registered memory region; 0 is the handle's own arena. */
typedef uint32_t spc_region_t;
#define SPC_REGION_ARENA ((spc_region_t)0)

/** A group of ranks an operation runs on (a job's world, later mesh groups). */
typedef uint32_t spc_group_t;

typedef enum spc_dtype {
    SPC_F32  = 1,
    SPC_F64  = 2,
    SPC_F16  = 3,
    SPC_BF16 = 4,
    SPC_I32  = 5,
    SPC_I64  = 6,
    SPC_U8   = 7,
} spc_dtype_t;

typedef enum spc_redop {
    SPC_SUM = 0,
    SPC_MAX = 1,
    SPC_MIN = 2,
} spc_redop_t;

typedef enum spc_opcode {
    SPC_OP_NOOP      = 0,   /**< completes at once; measures the round trip */
    SPC_OP_BARRIER   = 1,
    SPC_OP_ALLREDUCE = 2,   /**< tensors[0] send, tensors[1] receive (may be the same) */
} spc_opcode_t;

/* ------------------------------------------------------------------ attach */

/** Flags of spc_attach_params_t. */
#define SPC_ATTACH_CONTROL_ONLY 1u   /**< no data-plane segment: queries only (spctl) */

/**
 * Parameters of spc_attach(). Zero-initialise, set struct_size = sizeof(spc_attach_params_t),
 * then set what you need; zero fields take their defaults. New fields are only
 * ever appended, so old binaries keep working.
 */
typedef struct spc_attach_params {
    size_t      struct_size;
    const char *socket_path;   /**< NULL: $SPC_SOCKET, else the default runtime dir */
    const char *name;          /**< shown by `spctl clients`; NULL: the program name */
    uint32_t    flags;         /**< SPC_ATTACH_* */
    uint32_t    sq_entries;    /**< 0: $SPC_SQ_ENTRIES or the daemon default */
    uint64_t    arena_bytes;   /**< 0: $SPC_ARENA_BYTES or the daemon default */
    int         timeout_ms;    /**< control calls' timeout; 0: 30000 */
} spc_attach_params_t;

/**
 * Connects to spd, says hello and (unless SPC_ATTACH_CONTROL_ONLY) maps the
 * segment the daemon made for this client.
 *
 * @param params  NULL for all defaults.
 * @param h_p     receives the handle on success.
 * @return SPC_OK; SPC_ERR_CONNECT (no daemon at the path), SPC_ERR_PERMISSION
 *         (refused: another user), SPC_ERR_PROTOCOL (version mismatch),
 *         SPC_ERR_LIMIT (daemon at max_clients), SPC_ERR_NO_MEMORY, SPC_ERR_INVALID_ARG.
 *         On failure *h_p is untouched and the detail goes to spc_last_error(NULL).
 */
SPC_API spc_status_t spc_attach(const spc_attach_params_t *params, spc_handle_t **h_p);

/**
 * Says goodbye and releases everything: requests, arena, registrations. Requests
 * still in flight are abandoned (their ranks' peers see this rank leave).
 * Accepts NULL.
 */
SPC_API void spc_detach(spc_handle_t *h);

/**
 * The detail of the last failed call on this handle, or of the last failed
 * spc_attach() when h is NULL. Never NULL; "" when there is none. Valid until the
 * next call on the same handle (or the next spc_attach() in this thread).
 */
SPC_API const char *spc_last_error(const spc_handle_t *h);

/** The socket path a handle attached to (or would attach to, when h is NULL). */
SPC_API const char *spc_socket_path(const spc_handle_t *h);

/** The daemon's version string and pid, from the welcome. */
SPC_API const char *spc_daemon_version(const spc_handle_t *h);
SPC_API int spc_daemon_pid(const spc_handle_t *h);

/* ------------------------------------------------------------------ memory */

/**
 * Allocates `bytes` in the shared arena, 64-byte aligned (4 KiB aligned from
 * 64 KiB up). The daemon reads and writes arena buffers in place: no copy, no
 * registration. Returns NULL when the arena is full (see SPC_ARENA_BYTES).
 */
SPC_API void *spc_alloc(spc_handle_t *h, size_t bytes);

/** Returns an arena buffer. Accepts NULL. */
SPC_API void spc_free(spc_handle_t *h, void *ptr);

/** Arena size and bytes in use. */
SPC_API void spc_arena_usage(const spc_handle_t *h, uint64_t *size_p, uint64_t *used_p);

/**
 * Registers [addr, addr + length) of this process's memory. The daemon reaches it
 * with process_vm_readv/writev (one extra copy compared with the arena). Operations
 * may then name pointers inside the range.
 * @return SPC_OK; SPC_ERR_BAD_REGION (range not mapped), SPC_ERR_INVALID_ARG
 *         (overlaps the arena or another registration), SPC_ERR_LIMIT.
 */
SPC_API spc_status_t spc_register(spc_handle_t *h, void *addr, size_t length, spc_region_t *region_p);

/** Forgets a registration. @return SPC_OK or SPC_ERR_BAD_REGION. */
SPC_API spc_status_t spc_deregister(spc_handle_t *h, spc_region_t region);

/* ------------------------------------------------------------------ jobs */

/**
 * Creates a job on this node's daemon and writes its id (a NUL-terminated string,
 * at most SPC_JOB_ID_MAX bytes) to id_buf. Rank 0 calls this and hands the id to
 * the other ranks (environment, file, launcher).
 */
SPC_API spc_status_t spc_job_create(spc_handle_t *h, char *id_buf, size_t id_buf_len);

/**
 * Joins job `job_id` as `rank` of `world_size`. Returns when every rank has joined,
 * with the id of the world group in *world_p.
 * @return SPC_OK; SPC_ERR_NOT_FOUND (no such job), SPC_ERR_MISMATCH (world size
 *         differs from other ranks'), SPC_ERR_BUSY (rank taken, or this handle is
 *         already in a job), SPC_ERR_TIMEOUT (detail names the missing ranks).
 */
SPC_API spc_status_t spc_job_join(spc_handle_t *h, const char *job_id, uint32_t world_size,
                          uint32_t rank, int timeout_ms, spc_group_t *world_p);

/* ------------------------------------------------------------------ operations */

/**
 * A buffer an operation names: either a pointer inside the arena or a registered
 * region (set ptr, leave region/offset zero), or an explicit region and offset
 * (ptr NULL).
 */
typedef struct spc_tensor {
    void        *ptr;
    spc_region_t region;
    uint64_t     offset;
    uint64_t     bytes;      /**< extent; 0: what the operation needs */
} spc_tensor_t;

/**
 * One operation for spc_submit(). Zero-initialise and set struct_size =
 * sizeof(spc_op_t). The helpers below (spc_iallreduce, ...) fill it for you.
 */
typedef struct spc_op {
    size_t        struct_size;
    spc_opcode_t  opcode;
    spc_group_t   group;        /**< 0 for SPC_OP_NOOP */
    spc_dtype_t   dtype;
    spc_redop_t   redop;
    uint64_t      count;        /**< elements per rank */
    uint32_t      ntensors;
    spc_tensor_t  tensors[SPC_OP_MAX_TENSORS];
    uint32_t      timeout_ms;   /**< how long the daemon waits for the other ranks; 0: its op_timeout_ms */
} spc_op_t;

/**
 * Submits an operation without waiting. Several may be in flight; on a group
 * they complete in submission order. The request stays valid until
 * spc_request_release().
 * @return SPC_OK; SPC_ERR_RING_FULL (back-pressure: wait for earlier requests and
 *         submit again; nothing was queued), SPC_ERR_BAD_REGION (a pointer outside
 *         the arena and registrations), SPC_ERR_INVALID_ARG, SPC_ERR_DAEMON_LOST.
 *         Errors found by the daemon (mismatch, bounds, peers) come back through
 *         the request, not here.
 */
SPC_API spc_status_t spc_submit(spc_handle_t *h, const spc_op_t *op, spc_request_t **req_p);

/**
 * Polls a request. @return SPC_IN_PROGRESS while it runs, then its final status
 * (repeatable). The detail of a failed request is in spc_request_detail().
 */
SPC_API spc_status_t spc_test(spc_request_t *req);

/**
 * Waits up to timeout_ms (< 0: forever) for a request. Spins for SPC_SPIN_US,
 * then sleeps.
 * @return the request's final status, or SPC_IN_PROGRESS when the time ran out
 *         first (the request is still in flight). SPC_ERR_DAEMON_LOST when the
 *         daemon went away; that is noticed within about 50 ms.
 */
SPC_API spc_status_t spc_wait(spc_request_t *req, int timeout_ms);

/** Error detail of a completed request; "" when none. */
SPC_API const char *spc_request_detail(const spc_request_t *req);

/**
 * Releases a request. A request still in flight is released when it completes
 * (its result is dropped). Accepts NULL.
 */
SPC_API void spc_request_release(spc_request_t *req);

/** Requests submitted and not yet completed on this handle. */
SPC_API uint32_t spc_inflight(const spc_handle_t *h);

/* Helpers: the i-forms submit, the plain forms submit, wait and release. */

SPC_API spc_status_t spc_inoop(spc_handle_t *h, spc_request_t **req_p);
SPC_API spc_status_t spc_noop(spc_handle_t *h, int timeout_ms);

SPC_API spc_status_t spc_ibarrier(spc_handle_t *h, spc_group_t group, spc_request_t **req_p);
SPC_API spc_status_t spc_barrier(spc_handle_t *h, spc_group_t group, int timeout_ms);

/**
 * Element-wise reduction of `count` elements across the group. Sums are taken in
 * rank order, so every rank gets the same bits, run after run; 16-bit types
 * accumulate in fp32. In this version: SPC_SUM/MAX/MIN over SPC_F32 and SPC_F64.
 * send may equal recv.
 */
SPC_API spc_status_t spc_iallreduce(spc_handle_t *h, spc_group_t group, const void *send, void *recv,
                            uint64_t count, spc_dtype_t dtype, spc_redop_t op,
                            spc_request_t **req_p);
SPC_API spc_status_t spc_allreduce(spc_handle_t *h, spc_group_t group, const void *send, void *recv,
                           uint64_t count, spc_dtype_t dtype, spc_redop_t op, int timeout_ms);

/** Bytes of one element of dtype; 0 when unknown. */
SPC_API size_t spc_dtype_size(spc_dtype_t dtype);
/** "fp32", "bf16", ...; "unknown" when unknown. */
SPC_API const char *spc_dtype_name(spc_dtype_t dtype);

/* ------------------------------------------------------------------ queries */

/**
 * Operator questions (what spctl shows). The answer is a list of records, each a
 * list of typed key/value fields.
 *
 * Topics: "status" (one record), "clients" (one per client), "config" (arg: a key,
 * or "" for every option; one record per option).
 */
typedef struct spc_query_result spc_query_result_t;

typedef enum spc_value_kind {
    SPC_VALUE_STRING = 0,
    SPC_VALUE_INT    = 1,
    SPC_VALUE_DOUBLE = 2,
} spc_value_kind_t;

SPC_API spc_status_t spc_query(spc_handle_t *h, const char *topic, const char *arg,
                       spc_query_result_t **result_p);
SPC_API size_t spc_query_records(const spc_query_result_t *r);
SPC_API size_t spc_query_fields(const spc_query_result_t *r, size_t record);
/** Field accessors; record and field must be in range. */
SPC_API const char *spc_query_key(const spc_query_result_t *r, size_t record, size_t field);
SPC_API spc_value_kind_t spc_query_kind(const spc_query_result_t *r, size_t record, size_t field);
SPC_API const char *spc_query_str(const spc_query_result_t *r, size_t record, size_t field);  /**< "" unless a string */
SPC_API int64_t spc_query_int(const spc_query_result_t *r, size_t record, size_t field);
SPC_API double spc_query_double(const spc_query_result_t *r, size_t record, size_t field);
/** Looks a key up in a record; -1 when absent. */
SPC_API long spc_query_find(const spc_query_result_t *r, size_t record, const char *key);
SPC_API void spc_query_free(spc_query_result_t *r);

/* ------------------------------------------------------------------ logging */

/**
 * The library is silent unless the application installs a logger. level: 0 error,
 * 1 warning, 2 info, 3 debug. Process-wide; pass NULL to remove.
 */
typedef void (*spc_log_fn)(int level, const char *message, void *arg);
SPC_API void spc_set_logger(spc_log_fn fn, void *arg);

#ifdef __cplusplus
}
#endif
#endif /* SPCLIENT_H */
