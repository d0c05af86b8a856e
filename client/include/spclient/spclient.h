/*
 * spclient.h — libspclient, the client library of spd.
 *
 * A training process attaches to the spd daemon of its node, joins a job with the
 * other ranks, and submits collective operations. Control calls (attach, register,
 * jobs, queries) go over a Unix socket; operations go through shared-memory rings
 * and never touch a socket.
 *
 *   spc_handle_t *h;
 *   spc_launch_t l = SPC_LAUNCH_INIT;                 // under torchrun, srun or mpirun:
 *   spc_init_from_env(NULL, 60000, &l, &h);           // attach, join the launch's job
 *   spc_group_t world = l.world;
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
 * Versioned structs: a parameter struct whose first field is struct_size
 * (spc_attach_params_t, spc_job_params_t, spc_mesh_spec_t, spc_op_t,
 * spc_alltoall_desc_t, spc_alltoallv_desc_t, spc_shift_desc_t,
 * spc_lse_merge_desc_t; spc_device_cache_info_t and spc_launch_t, which the
 * library writes)
 * starts from its SPC_*_INIT initializer, which sets struct_size = sizeof and
 * every other field to zero, its default:
 *
 *   spc_op_t op = SPC_OP_INIT;
 *
 * Fields are only ever appended, each at or past the previous version's
 * sizeof, so a binary built against an older, smaller struct keeps working:
 * the fields its struct lacks take their defaults. Each struct's comment names
 * the last field of its first version; a struct_size that does not reach it,
 * is larger than this library's struct (a newer header), or is not a multiple
 * of the struct's alignment is refused with SPC_ERR_INVALID_ARG naming the struct.
 *
 * Time limits are of two kinds:
 *   - the match deadline, the `timeout_ms` field of spc_op_t,
 *     spc_alltoall_desc_t and spc_shift_desc_t: how long spd waits for every
 *     rank of the group to submit the op; past it spd fails the op with
 *     SPC_ERR_TIMEOUT on every rank, the detail naming the missing ranks. 0:
 *     spd's op_timeout_ms.
 *   - the wait of a call, the `wait_ms` argument of spc_wait and of the
 *     blocking forms (spc_allreduce, spc_alltoall, ...; < 0: forever), and
 *     spc_attach_params_t.timeout_ms for control calls: how long this process
 *     waits for the answer; the op itself goes on. spc_wait then returns
 *     SPC_IN_PROGRESS, a blocking form SPC_ERR_TIMEOUT whose detail says the
 *     op stays queued in spd.
 * spc_job_join's timeout_ms is both: spd's deadline for the ranks to join, and
 * this call's wait. (The fields keep the name timeout_ms for the sources that
 * set them.)
 *
 * Environment: SPC_SOCKET (daemon socket path), SPC_ARENA_BYTES, SPC_SQ_ENTRIES,
 * SPC_SPIN_US (how long a wait spins before it sleeps), SPC_JOB (the job name
 * spc_init_from_env joins), SPC_PROTOCOL_MAX (offer spd no protocol above this
 * one: speak as an older library would), SPC_RECONNECT_MS (how long to wait for
 * the next spd once spd goes; 0: fail at once; see "Restarts").
 */
#ifndef SPCLIENT_H
#define SPCLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "spclient/status.h"

/* The SPC_*_INIT initializers (see "Versioned structs" above): the struct
 * zeroed, struct_size set. C++ before C++20 has no designated initializers. */
#ifdef __cplusplus
template <typename T> static inline T spc__sized_init() { T s = T(); s.struct_size = sizeof(T); return s; }
#define SPC__SIZED_INIT(type) spc__sized_init<type>()
#else
#define SPC__SIZED_INIT(type) { .struct_size = sizeof(type) }
#endif

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

/** A group of ranks an operation runs on: a job's world or a mesh group. */
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
    SPC_OP_ALLTOALL  = 3,   /**< use spc_ialltoall() */
    SPC_OP_SHIFT     = 4,   /**< use spc_ishift() */
    SPC_OP_ALLGATHER = 5,   /**< tensors[0] send (count), tensors[1] receive (group size x count) */
    SPC_OP_BROADCAST = 6,   /**< tensors[0] the buffer; root's contents go to every rank */
    SPC_OP_REDUCE_SCATTER = 7,   /**< tensors[0] send (group size x count), tensors[1] receive (count) */
    SPC_OP_ALLTOALLV = 8,   /**< use spc_ialltoallv() */
} spc_opcode_t;

/* ------------------------------------------------------------------ attach */

/** Flags of spc_attach_params_t. */
/** No data-plane segment: queries only (spctl). spd closes a control-only
 *  session that sends nothing for its session_idle_ms (10 s by default); its
 *  next call then fails, and the caller attaches again. */
#define SPC_ATTACH_CONTROL_ONLY 1u

/**
 * Parameters of spc_attach(). Start from SPC_ATTACH_PARAMS_INIT, then set what
 * you need; zero fields take their defaults. First version: struct_size alone
 * (every field has a default).
 */
typedef struct spc_attach_params {
    size_t      struct_size;
    const char *socket_path;   /**< NULL: $SPC_SOCKET, else the default runtime dir */
    const char *name;          /**< shown by `spctl clients`; NULL: the program name */
    uint32_t    flags;         /**< SPC_ATTACH_* */
    uint32_t    sq_entries;    /**< 0: $SPC_SQ_ENTRIES or the daemon default */
    uint64_t    arena_bytes;   /**< 0: $SPC_ARENA_BYTES or the daemon default */
    int         timeout_ms;    /**< control calls' wait for spd's answer; 0: 30000 */
    /** How long, once spd goes (killed, crashed, stopped for a restart), the
     *  client waits for the next spd on the socket to take it over with its
     *  job and its ops in flight (see "Restarts" below); 0: $SPC_RECONNECT_MS,
     *  else 15000; < 0: never (every call says SPC_ERR_DAEMON_LOST at once). */
    int         reconnect_ms;
} spc_attach_params_t;

#define SPC_ATTACH_PARAMS_INIT SPC__SIZED_INIT(spc_attach_params_t)

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
 * The detail of the last failed call on this handle, or, when h is NULL, of
 * the last failed spc_attach(), spc_lse_merge(), spc_launch_from_env() or
 * spc_init_from_env() of the calling thread.
 * Never NULL; "" when there is none. Valid until the next call on the same
 * handle (or the next of those calls in this thread).
 */
SPC_API const char *spc_last_error(const spc_handle_t *h);

/** The socket path a handle attached to (or would attach to, when h is NULL). */
SPC_API const char *spc_socket_path(const spc_handle_t *h);

/** The daemon's version string and pid, from the welcome. */
SPC_API const char *spc_daemon_version(const spc_handle_t *h);
SPC_API int spc_daemon_pid(const spc_handle_t *h);

/*
 * Restarts. When spd goes without saying it shut down for good (killed,
 * crashed, out of memory, or stopped for an upgrade with SIGUSR2; SIGTERM's
 * drain is for good), the call that notices waits up to reconnect_ms
 * (spc_attach_params_t) for the next spd on the socket and hands the client
 * over: its arena and buffers stay where they are, its registrations (host and
 * GPU memory) keep their ids, its job and world group theirs, and every op in flight is
 * submitted again and completes as if nothing happened, with two exceptions
 * that fail instead: a collective the old spd may have run in part whose
 * outputs overlap its inputs (an all-reduce in place: SPC_ERR_RESTARTED, "not
 * retried (in place)"), and one that some ranks saw complete and others did
 * not (SPC_ERR_RESTARTED naming the rank that saw it). Meshes come back with
 * their groups, and CUDA streams open with their slots: while one is open, a
 * thread of the library hands the client over even when the application's
 * thread waits in the CUDA driver, and the ops queued on a stream run once, in
 * its order, before the work enqueued after them (so the handle's calls take
 * a lock of its own). A client whose job spans daemons is taken over when the
 * daemons set peer_restart_grace_ms (the others then take the job back from
 * the new spd); without it, or past it, its ops fail with SPC_ERR_PEER_LOST
 * saying why. A client the next spd refuses (a job its uid may not claim, a
 * ticket spd did not issue) or that no spd takes within reconnect_ms hears
 * SPC_ERR_DAEMON_LOST, saying why; its streams are then released, their
 * waits passed, and report that error.
 */

/** What restarts of spd did to a handle (spc_resume_info). The library writes
 *  it; first version: last_gap_ms. */
typedef struct spc_resume_info {
    size_t   struct_size;
    uint32_t resumes;       /**< times a new spd took this handle over */
    uint64_t replayed;      /**< ops submitted again to a new spd, in all */
    uint64_t retried;       /**< of them, ops the old spd had taken, which may have run */
    uint64_t last_gap_ms;   /**< the last take-over: from noticing spd gone to the ops resubmitted */
} spc_resume_info_t;

#define SPC_RESUME_INFO_INIT SPC__SIZED_INIT(spc_resume_info_t)

/** Fills *info (from SPC_RESUME_INFO_INIT). SPC_OK, or SPC_ERR_INVALID_ARG. */
SPC_API spc_status_t spc_resume_info(const spc_handle_t *h, spc_resume_info_t *info);

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
 * with process_vm_readv/writev, or (when it holds CAP_SYS_PTRACE) through the
 * /proc/<pid>/mem it opened at attach: one extra copy compared with the arena,
 * through a staging buffer of at most its staging_bytes: a larger all-reduce,
 * all-gather, broadcast or shift streams through it in pieces, with the same
 * result; a larger all-to-all, or a tensor the daemon would send whole to
 * another daemon, fails with SPC_ERR_LIMIT (the detail names the bytes and the
 * option). Operations may then name pointers inside the range. Registrations
 * belong to the program that attached: once this process execs, every op on
 * them and every new registration on the handle (from a forked child that kept
 * it) fails with SPC_ERR_PERMISSION and the daemon closes the session; attach
 * again instead.
 * @return SPC_OK; SPC_ERR_BAD_REGION (range not mapped), SPC_ERR_INVALID_ARG
 *         (overlaps the arena or another registration), SPC_ERR_LIMIT,
 *         SPC_ERR_PERMISSION (the daemon may not reach this process's memory:
 *         another user; a process that is not dumpable, as one that dropped
 *         privileges itself is until it calls prctl(PR_SET_DUMPABLE, 1); or
 *         the process exec'd since it attached).
 */
SPC_API spc_status_t spc_register(spc_handle_t *h, void *addr, size_t length, spc_region_t *region_p);

/**
 * Registers [dptr, dptr + bytes) of GPU memory of this process, of one of two
 * kinds:
 *
 *   - one allocation made with cudaMalloc (or cuMemAlloc, or PyTorch's caching
 *     allocator without expandable segments), which the range must lie in. The
 *     daemon imports the whole allocation (CUDA IPC);
 *   - cuMem (virtual memory management) memory, such as PyTorch's caching
 *     allocator makes with expandable_segments:True: physical allocations
 *     ("chunks") mapped into a reserved range. The range may span up to 1024
 *     chunks mapped back to back, and must be mapped throughout. Each chunk
 *     must have been created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in
 *     CUmemAllocationProp.requestedHandleTypes; it is exported as a file
 *     descriptor, which the daemon takes out of this process with
 *     pidfd_getfd(2) (the ptrace access it also needs for spc_register; this
 *     call gives the consent Yama asks for) and which is closed here before the
 *     call returns. The process needs room for one descriptor per chunk
 *     meanwhile (RLIMIT_NOFILE). The daemon maps the chunks back to back in a
 *     range of its own, and its mapping keeps them alive, whatever this process
 *     unmaps or frees, until no region names them any more.
 *
 * The daemon imports memory once and reuses the import for later
 * registrations of it. Memory freed and made again at the same address (a
 * cudaMalloc allocation of another buffer id; a chunk unmapped and mapped anew)
 * is told apart and imported afresh, and the regions of the old memory are
 * dropped. Operations may then name pointers inside the range; an operation's
 * tensors must be all in device memory (on one GPU) or all in host memory. Ops
 * on device regions are host-synchronous for now: the daemon's GPU work is
 * finished when the op completes, and the caller must have finished writing
 * its inputs (cudaStreamSynchronize) before it submits.
 *
 * spc_device_cover (below) makes and keeps such registrations for the spans
 * of each op, so a program need not.
 *
 * libspclient does not link the CUDA driver: it (libcuda.so.1) is loaded on the
 * first call. Thread-safe as spc_register is (one call at a time per handle).
 * @return SPC_OK; SPC_ERR_NO_DEVICE (no driver on this machine, or cuInit failed:
 *         the detail says which; also when the daemon has none); SPC_ERR_INVALID_ARG
 *         (not device memory: host and managed memory go to spc_register; the
 *         range overlaps another registration, or spans cuMem memory of another
 *         GPU); SPC_ERR_UNSUPPORTED (memory neither CUDA IPC nor a descriptor can
 *         export: cuMem memory created without the POSIX descriptor handle type,
 *         the detail saying what to set, or stream-ordered pool memory; a
 *         kernel without pidfd_getfd, before Linux 5.6);
 *         SPC_ERR_OUT_OF_BOUNDS (the range runs past its allocation, or into
 *         address space with nothing mapped); SPC_ERR_PERMISSION (the daemon may
 *         not take this process's descriptors: another user, or pidfd_getfd
 *         refused); SPC_ERR_DEVICE (the driver failed; detail has its message);
 *         SPC_ERR_LIMIT (too many registrations, or more than 1024 chunks).
 */
SPC_API spc_status_t spc_register_device(spc_handle_t *h, const void *dptr, size_t bytes, spc_region_t *region_p);

/** Forgets a registration. @return SPC_OK or SPC_ERR_BAD_REGION. */
SPC_API spc_status_t spc_deregister(spc_handle_t *h, spc_region_t region);

/* ------------------------------------------------------------------ device memory cache */

/**
 * The handle's cache of device registrations: instead of registering GPU
 * memory itself, a program calls spc_device_cover() with the device spans of
 * each op before submitting it, and the cache keeps spc_register_device()
 * registrations that hold them, never two that overlap:
 *
 *   - cudaMalloc memory (PyTorch's caching allocator by default: a segment of
 *     many tensors) is registered whole, once per allocation, so views that
 *     overlap share it; an allocation freed and made again at the same
 *     address (another buffer id) is registered afresh;
 *   - cuMem memory (expandable segments: chunks mapped on demand into a large
 *     reservation) is registered as the run of mapped chunks under a span; a
 *     span across the edge of registrations already made gets one over all
 *     their chunks, which replaces them (a span over more than the 1024
 *     chunks of one registration gets its own run instead). A chunk unmapped,
 *     or unmapped and mapped anew, is caught by its buffer id and memory
 *     block id: for the chunks under a span on every cover, for every
 *     registration on each miss.
 *
 * Each miss first drops the registrations whose memory is gone. A
 * registration is replaced (merge) or evicted (past the limit, least recently
 * used first) only once no request in flight names it: the cover waits for
 * such requests (released ones and stream ops included), which were submitted
 * before the op being covered, so on ranks that submit in one order they
 * complete without it; their outcome stays for spc_wait. Eviction never
 * takes a registration the op's spans use, and takes those no request in
 * flight names first.
 *
 * Do not register or deregister by hand memory the cache covers (a region
 * deregistered by hand is forgotten by the cache). Thread-safety as for every
 * call on the handle.
 */
typedef struct spc_device_span {
    const void *ptr;
    uint64_t    bytes;     /**< 0: nothing to cover */
} spc_device_span_t;

/**
 * Covers the device spans an op will name with registrations of the cache.
 * @param regions_p  NULL, or nspans entries: the region holding each span (0
 *                   for an empty one).
 * @return SPC_OK; SPC_ERR_INVALID_ARG (a span not in device memory: host and
 *         managed memory go to spc_register); SPC_ERR_OUT_OF_BOUNDS (a span
 *         runs past its cudaMalloc allocation, or into cuMem address space
 *         with nothing mapped, the detail naming the address); SPC_ERR_LIMIT
 *         (two spans of the op in cuMem registrations that one of at most
 *         1024 chunks cannot hold together); and what spc_register_device and
 *         spc_deregister return. After an error the spans covered before it
 *         stay registered.
 */
SPC_API spc_status_t spc_device_cover(spc_handle_t *h, const spc_device_span_t *spans, uint32_t nspans,
                                      spc_region_t *regions_p);

/** The most registrations the cache keeps (default 256); applies from the next cover. */
SPC_API spc_status_t spc_device_cache_limit(spc_handle_t *h, uint32_t max_regions);

/**
 * The cache's size and counters. Start from SPC_DEVICE_CACHE_INFO_INIT; the
 * library writes the fields its struct_size covers. First version: up to merged.
 */
typedef struct spc_device_cache_info {
    size_t   struct_size;
    uint32_t regions;        /**< registrations held now */
    uint32_t limit;          /**< spc_device_cache_limit */
    uint64_t registrations;  /**< spc_register_device calls made */
    uint64_t dropped;        /**< registrations dropped because their memory went away */
    uint64_t merged;         /**< cuMem registrations replaced by one over a longer run of chunks */
} spc_device_cache_info_t;

#define SPC_DEVICE_CACHE_INFO_INIT SPC__SIZED_INIT(spc_device_cache_info_t)

SPC_API spc_status_t spc_device_cache_info(spc_handle_t *h, spc_device_cache_info_t *info_p);

/** One registration of the cache. */
typedef struct spc_device_entry {
    uint64_t     base, size;
    spc_region_t region;
    uint32_t     chunks;     /**< cuMem chunks it holds; 0 for a cudaMalloc allocation */
} spc_device_entry_t;

/** Writes up to cap registrations, by address, to out (NULL: none); returns how many there are. */
SPC_API uint32_t spc_device_cache_entries(const spc_handle_t *h, spc_device_entry_t *out, uint32_t cap);

/** Deregisters every registration of the cache, each once no request in flight names it. */
SPC_API spc_status_t spc_device_cache_clear(spc_handle_t *h);

/* ------------------------------------------------------------------ GPU streams */

/**
 * Stream order: ops on device regions that run in the order of a CUDA stream of
 * this process, with no host round trip.
 *
 * A stream owns two 64-bit timeline semaphores in the client's shared segment,
 * `ready` and `done`. Submitting an op while the stream is current (spc_set_stream)
 * enqueues "write ready = seq" on the CUDA stream, hands the op to spd, enqueues
 * "wait until done >= seq" on the CUDA stream, and returns at once. spd's own
 * stream waits for every rank's ready, runs the op's kernels and writes each
 * rank's done (cuStreamWaitValue64 / cuStreamWriteValue64). Work the application
 * enqueues after the op therefore sees its result; work enqueued before it is
 * what the op reads.
 *
 * spd starts a stream's ops in the stream's order (an op waits for its
 * predecessors on every rank's stream), so ops on several groups may share a
 * stream. A failed op still advances done, so no stream waits forever; its error
 * goes to its request and to the stream (spc_stream_query). When spd must give
 * up on a stream (a rank's stream did not reach an op within the op's timeout,
 * the daemon is shutting down) it writes SPC_STREAM_POISON to done, which
 * releases every wait; the stream is then broken and refuses further ops.
 */
typedef struct spc_stream spc_stream_t;

/** done's value once spd has given up on a stream: any wait passes. */
#define SPC_STREAM_POISON (UINT64_C(1) << 63)
/** Streams one handle may have at once. */
#define SPC_STREAMS_MAX 32

/**
 * Makes a stream for CUDA stream `cu_stream` (a CUstream or cudaStream_t of this
 * process; NULL is the legacy default stream of the current context).
 * @return SPC_OK; SPC_ERR_NO_DEVICE (no driver, or spd does not see the GPU);
 *         SPC_ERR_UNSUPPORTED (the GPU cannot wait on 64-bit values in host
 *         memory); SPC_ERR_LIMIT (SPC_STREAMS_MAX); SPC_ERR_DEVICE.
 */
SPC_API spc_status_t spc_stream_create(spc_handle_t *h, void *cu_stream, spc_stream_t **s_p);

/**
 * Synchronizes the CUDA stream, waits for the completions of its ops and frees
 * the stream (it stops being current). Returns what spc_stream_synchronize would.
 * Accepts NULL.
 */
SPC_API spc_status_t spc_stream_destroy(spc_stream_t *s);

/**
 * Makes s the stream that ops on device regions follow from now on (NULL: none;
 * device ops are then host-synchronous). Host-memory ops never follow a stream.
 *
 * With a current stream, the blocking forms (spc_allreduce, spc_alltoall, ...)
 * return once the op is enqueued; errors spd finds later are kept by the stream.
 * The i-forms give a request that completes when spd's work for the op is done.
 */
SPC_API spc_status_t spc_set_stream(spc_handle_t *h, spc_stream_t *s);

/** The handle's current stream, or NULL. */
SPC_API spc_stream_t *spc_get_stream(const spc_handle_t *h);

/**
 * Reaps the stream's completions without blocking. @return SPC_OK, or the first
 * error of its ops since the last call (detail in spc_last_error), or
 * SPC_ERR_DAEMON_LOST. A broken stream keeps returning its error.
 */
SPC_API spc_status_t spc_stream_query(spc_stream_t *s);

/**
 * cuStreamSynchronize, then waits for the completions of every op submitted on
 * the stream, and returns what spc_stream_query then returns.
 */
SPC_API spc_status_t spc_stream_synchronize(spc_stream_t *s);

/** Ops submitted on the stream so far (its last seq). */
SPC_API uint64_t spc_stream_seq(const spc_stream_t *s);

/* ------------------------------------------------------------------ jobs */

/** The most other users one job may admit (spc_job_params_t.allow_uids). */
#define SPC_JOB_MAX_ALLOW_UIDS 16

/**
 * Parameters of spc_job_create_with(). Start from SPC_JOB_PARAMS_INIT, then set
 * what you need; zero fields take their defaults. First version: struct_size
 * alone (every field has a default).
 */
typedef struct spc_job_params {
    size_t          struct_size;
    const uint32_t *allow_uids;    /**< other users whose processes may join the job and see its id */
    uint32_t        nallow_uids;   /**< entries of allow_uids, at most SPC_JOB_MAX_ALLOW_UIDS */
} spc_job_params_t;

#define SPC_JOB_PARAMS_INIT SPC__SIZED_INIT(spc_job_params_t)

/**
 * Creates a job on this node's daemon and writes its id (a NUL-terminated string,
 * at most SPC_JOB_ID_MAX bytes) to id_buf. Rank 0 calls this and hands the id to
 * the other ranks (environment, file, launcher).
 *
 * The job belongs to the user (uid) of the calling process: only processes of
 * that uid may join it, on this node or another, and only they see its id in
 * queries, besides spd's own user and root. Users that share one spd through
 * its allow_group option therefore never see nor join each other's jobs.
 * @return SPC_OK; SPC_ERR_INVALID_ARG (id_buf too small).
 */
SPC_API spc_status_t spc_job_create(spc_handle_t *h, char *id_buf, size_t id_buf_len);

/**
 * spc_job_create() with parameters: `params->allow_uids` names other users
 * whose processes may join the job too (and see it). Uids are compared as
 * numbers on every node the job spans. params NULL is spc_job_create().
 * @return SPC_OK; SPC_ERR_INVALID_ARG (struct_size unknown, more than
 *         SPC_JOB_MAX_ALLOW_UIDS uids, allow_uids NULL with nallow_uids set,
 *         id_buf too small).
 */
SPC_API spc_status_t spc_job_create_with(spc_handle_t *h, const spc_job_params_t *params, char *id_buf,
                                         size_t id_buf_len);

/**
 * Joins job `job_id` as `rank` of `world_size`. Returns when every rank has joined,
 * with the id of the world group in *world_p.
 * A job lives while its creator or one of its ranks is attached; once every rank
 * of a started job has left, it ends even if its creator stays.
 * Where the calling thread has a current CUDA context (as after
 * torch.cuda.set_device or cudaSetDevice), its GPU is the rank's, as NCCL's
 * communicators take the current device: meshes of a job on one node put
 * Ulysses groups on the GPUs with the best links between them.
 * @return SPC_OK; SPC_ERR_NOT_FOUND (no such job), SPC_ERR_PERMISSION (the job
 *         belongs to another user who did not grant this one), SPC_ERR_MISMATCH
 *         (world size differs from other ranks'), SPC_ERR_BUSY (rank taken, this
 *         handle is already in a job, or the job has started or ended: create a
 *         new one), SPC_ERR_TIMEOUT (detail names the missing ranks).
 */
SPC_API spc_status_t spc_job_join(spc_handle_t *h, const char *job_id, uint32_t world_size,
                          uint32_t rank, int timeout_ms, spc_group_t *world_p);

/** Longest job name and launch id of spc_job_join_named(), each with its NUL. */
#define SPC_JOB_NAME_MAX   64
#define SPC_JOB_LAUNCH_MAX 128

/**
 * Joins the job named `name` as `rank` of `world_size`, as spc_job_join() does
 * a job id, with no job to create first: every rank of a launch joins the same
 * name, the first join makes the job (rank 0's, where spd has peers), and it
 * ends when its last rank leaves.
 * No rank hands anything to another, and no handle has to stay attached for the
 * others. The job lives on the spd where its rank 0 joined, its home; a rank
 * that joins on another node's spd is joined there by the daemons, which find
 * the home among the daemons linked to theirs (peers), asking again while
 * rank 0 has not joined, until timeout_ms.
 *
 * Names are the calling user's own: another user's job of the same name is
 * another job. A name is 1 to SPC_JOB_NAME_MAX - 1 bytes of letters, digits,
 * '.', '_' and '-', beginning with a letter or a digit. `launch` tells one
 * launch of the ranks from another (spc_launch_from_env() makes one from the
 * launcher's run id): while a job of that name lives, a join of another launch
 * or another world size is refused, naming the job that holds the name, as is
 * a rank that joins twice. NULL or "" is no launch id: then only the world size
 * and a started job tell launches apart. At most SPC_JOB_LAUNCH_MAX - 1
 * printable bytes: letters, digits and "._-:@/+=".
 * @return SPC_OK; SPC_ERR_INVALID_ARG (a malformed name or launch id),
 *         SPC_ERR_BUSY (the name is held by another launch, here or on a
 *         linked spd, or by this one and started, or by two spd at once; the
 *         rank is taken; this handle is already in a job),
 *         SPC_ERR_MISMATCH (world size differs from the other ranks'),
 *         SPC_ERR_LIMIT (spd's max_named_jobs_per_user or max_name_lookups),
 *         SPC_ERR_TIMEOUT (detail names the missing ranks, or says that no
 *         spd is the home yet: rank 0 has not joined).
 */
SPC_API spc_status_t spc_job_join_named(spc_handle_t *h, const char *name, const char *launch, uint32_t world_size,
                                        uint32_t rank, int timeout_ms, spc_group_t *world_p);

/**
 * What a launcher's environment says about this process, filled by
 * spc_launch_from_env() (set struct_size first: SPC_LAUNCH_INIT). First
 * version: world.
 */
typedef struct spc_launch {
    size_t      struct_size;
    uint32_t    rank;                          /**< this process's rank in the launch */
    uint32_t    world_size;                    /**< ranks in the launch */
    uint32_t    local_rank;                    /**< its rank among this node's */
    uint32_t    local_world_size;              /**< ranks on this node; 0: the launcher does not say */
    uint32_t    nodes;                         /**< nodes the ranks are on; 0: the launcher does not say */
    char        launcher[16];                  /**< "torchrun", "openmpi" or "slurm" */
    char        job[SPC_JOB_NAME_MAX];         /**< the job name the ranks join */
    char        launch[SPC_JOB_LAUNCH_MAX];    /**< the launch id (spc_job_join_named) */
    spc_group_t world;                         /**< the world group, once spc_init_from_env() joined */
} spc_launch_t;

#define SPC_LAUNCH_INIT SPC__SIZED_INIT(spc_launch_t)

/**
 * Reads the launcher's environment, the first of these that is set:
 *   - torchrun (and launchers that set what it sets): RANK, WORLD_SIZE,
 *     LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_WORLD_SIZE; the launch is TORCHELASTIC_RUN_ID,
 *     TORCHELASTIC_RESTART_COUNT, MASTER_ADDR and MASTER_PORT;
 *   - OpenMPI's mpirun: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK,
 *     _LOCAL_SIZE; the launch is PMIX_NAMESPACE (or OMPI_MCA_ess_base_jobid);
 *   - SLURM's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
 *     SLURM_STEP_NUM_NODES (or SLURM_NNODES), SLURM_NTASKS_PER_NODE; the
 *     launch is SLURM_JOB_ID and SLURM_STEP_ID.
 * torchrun comes first because it may run under srun or mpirun, and mpirun
 * before SLURM because an sbatch script's SLURM_PROCID reaches what mpirun starts.
 * The job name is $SPC_JOB when set (checked as spc_job_join_named checks it),
 * else the launcher's name and its launch id ("slurm-<job>.<step>"; torchrun's
 * run id rather than the launch id where --rdzv-id or --standalone gave one),
 * each byte outside the name's alphabet made '-', cut at SPC_JOB_NAME_MAX - 1
 * bytes.
 * Writes *launch_p only on success; the detail of a failure goes to
 * spc_last_error(NULL).
 * @return SPC_OK; SPC_ERR_NOT_FOUND (no launcher's variables; the detail
 *         names them), SPC_ERR_INVALID_ARG (a variable that is not a number, a
 *         rank not below the world size, a bad $SPC_JOB, an unknown struct_size).
 */
SPC_API spc_status_t spc_launch_from_env(spc_launch_t *launch_p);

/**
 * Starts a rank of a launch in one call: spc_launch_from_env(), spc_attach()
 * with params (NULL: defaults), then spc_job_join_named() with the job name,
 * launch id, rank and world size read, waiting timeout_ms (<= 0: the handle's
 * timeout) for the other ranks. *launch_p receives what was read and the world
 * group; *h_p the handle, which the caller detaches. On failure nothing stays
 * attached and the detail goes to spc_last_error(NULL).
 * Ranks on several nodes each attach to their own node's spd; the spd of the
 * nodes must be linked as peers, and the job lives on the one where rank 0
 * joined (spc_job_join_named).
 * @return what those calls return.
 */
SPC_API spc_status_t spc_init_from_env(const spc_attach_params_t *params, int timeout_ms, spc_launch_t *launch_p,
                                       spc_handle_t **h_p);

/* ------------------------------------------------------------------ meshes */

/**
 * A job's ranks arranged for sequence parallelism: world = dp x sp and
 * sp = ring x ulysses. On one node the ranks are laid out ulysses-innermost:
 *
 *   rank = dp_rank * sp + ring_rank * ulysses + ulysses_rank
 *
 * so a Ulysses group is `ulysses` consecutive ranks, a ring group takes one rank
 * of each Ulysses group of the same sp group, and a dp group takes the same
 * sp_rank from every sp group. Where ranks announced different GPUs when they
 * joined (spc_job_join), the same layout runs over the ranks sorted by the
 * links between their GPUs (NVLink before one PCIe switch before one host
 * bridge before across sockets, then GPU index, then rank) instead of by rank:
 * the mesh's coordinates say where each rank landed, and `explain` names the
 * slowest GPU link inside the Ulysses groups.
 *
 * Start from SPC_MESH_SPEC_INIT. First version: up to heads.
 */
typedef struct spc_mesh_spec {
    size_t   struct_size;  /**< sizeof(spc_mesh_spec_t) */
    uint32_t sp;           /**< sequence-parallel degree; divides the world size */
    uint32_t ulysses;      /**< 0: auto (from the head counts), else divides sp */
    uint32_t ring;         /**< 0: auto (sp / ulysses) */
    uint32_t heads;        /**< attention (query) heads */
    uint32_t kv_heads;     /**< key/value heads; 0: heads. Divides heads. */
} spc_mesh_spec_t;

#define SPC_MESH_SPEC_INIT SPC__SIZED_INIT(spc_mesh_spec_t)

typedef struct spc_mesh {
    uint32_t    id;
    uint32_t    dp, sp, ulysses, ring;                   /**< degrees */
    spc_group_t dp_group, sp_group, ulysses_group, ring_group;
    uint32_t    dp_rank, sp_rank, ulysses_rank, ring_rank; /**< this rank's coordinates */
    char        explain[256];                             /**< why these degrees */
} spc_mesh_t;

/**
 * Creates (or, for every rank after the first, finds) the job's next mesh. Every
 * rank calls it with the same spec, in the same order as its other mesh
 * creations; it returns at once with this rank's groups.
 *
 * Auto degrees: with ulysses = 0 and ring = 0, ulysses is the largest divisor of
 * sp that divides the query heads and is a multiple or a divisor of kv_heads (no
 * dummy heads, at most replicated KV heads); the ring takes the rest. That is
 * the choice on one node; where the ranks span nodes, the degree whose
 * all-to-all stays inside a node and sends the fewest bytes between nodes wins,
 * a few dummy heads allowed (the placement rules are in common/sp_place.h).
 * @return SPC_OK; SPC_ERR_INVALID_ARG with the reason (sp does not divide the
 *         world, ulysses x ring != sp, kv_heads does not divide heads, ...);
 *         SPC_ERR_MISMATCH when this rank's spec differs from the mesh the first
 *         rank created (the detail names the fields); SPC_ERR_INVALID_ARG when the
 *         handle is in no complete job.
 */
SPC_API spc_status_t spc_mesh_create(spc_handle_t *h, const spc_mesh_spec_t *spec, spc_mesh_t *mesh_p);

/* ------------------------------------------------------------------ operations */

/**
 * A buffer an operation names: either a pointer inside the arena or a registered
 * region (set ptr, leave region/offset zero), or an explicit region and offset
 * (ptr NULL).
 *
 * Extent: what the buffer holds from its start, which must cover what the op
 * reads or writes there (the daemon computes that from the op: padded heads
 * and rows of an all-to-all, every rank's part of an all-gather). In the arena
 * it is at most what the spc_alloc() holding the buffer was asked for, from the
 * buffer's start; in a registered region, what the region holds. An op that
 * needs more is refused on every rank before anything moves: SPC_ERR_INVALID_ARG
 * naming the tensor, the bytes needed and the bytes held (SPC_ERR_OUT_OF_BOUNDS
 * past a registered region).
 */
typedef struct spc_tensor {
    void        *ptr;
    spc_region_t region;
    uint64_t     offset;
    uint64_t     bytes;      /**< extent; 0: what the operation needs (see above) */
} spc_tensor_t;

/**
 * One operation for spc_submit(). Start from SPC_OP_INIT. The helpers below
 * (spc_iallreduce, ...) fill it for you. First version: up to tensors.
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
    uint32_t      timeout_ms;   /**< match deadline: how long spd waits for the other ranks; 0: its op_timeout_ms */
    uint32_t      flags;        /**< op-specific (SPC_SHIFT_*) */
    uint32_t      channel;      /**< < SPC_CHANNELS: independent order of ops on one group */
    uint32_t      root;         /**< broadcast: the group rank that sends */
    const void   *params;       /**< op-specific descriptor copied into the request (all-to-all) */
    uint32_t      param_bytes;
} spc_op_t;

#define SPC_OP_INIT SPC__SIZED_INIT(spc_op_t)

/** Channels of a group: ops on different channels are matched independently. */
#define SPC_CHANNELS 4

/**
 * Submits an operation without waiting. Several may be in flight; on a group
 * they complete in submission order. The request stays valid until
 * spc_request_release().
 * @return SPC_OK; SPC_ERR_RING_FULL (back-pressure: wait for earlier requests and
 *         submit again; nothing was queued), SPC_ERR_BAD_REGION (a pointer outside
 *         the arena and registrations, or in no live arena allocation),
 *         SPC_ERR_INVALID_ARG, SPC_ERR_DAEMON_LOST.
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
 * Waits up to wait_ms (< 0: forever) for a request. Spins for SPC_SPIN_US,
 * then sleeps.
 * @return the request's final status, or SPC_IN_PROGRESS when the time ran out
 *         first (the request is still in flight). SPC_ERR_DAEMON_LOST when the
 *         daemon went away; that is noticed within about 50 ms.
 */
SPC_API spc_status_t spc_wait(spc_request_t *req, int wait_ms);

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
SPC_API spc_status_t spc_noop(spc_handle_t *h, int wait_ms);

SPC_API spc_status_t spc_ibarrier(spc_handle_t *h, spc_group_t group, spc_request_t **req_p);
SPC_API spc_status_t spc_barrier(spc_handle_t *h, spc_group_t group, int wait_ms);

/**
 * Element-wise reduction of `count` elements across the group. Sums are taken in
 * rank order, so every rank gets the same bits, run after run; 16-bit types
 * accumulate in fp32 and are rounded once at the end. SPC_SUM/MAX/MIN over
 * SPC_F32, SPC_F64, SPC_F16, SPC_BF16, SPC_I32 and SPC_I64 (integer sums wrap).
 * send may equal recv.
 */
SPC_API spc_status_t spc_iallreduce(spc_handle_t *h, spc_group_t group, const void *send, void *recv,
                            uint64_t count, spc_dtype_t dtype, spc_redop_t op,
                            spc_request_t **req_p);
SPC_API spc_status_t spc_allreduce(spc_handle_t *h, spc_group_t group, const void *send, void *recv,
                           uint64_t count, spc_dtype_t dtype, spc_redop_t op, int wait_ms);

/**
 * Reduces every rank's send (group size x `count` elements) element-wise, as
 * spc_allreduce does, and leaves block r of the result, elements
 * [r count, (r + 1) count), in rank r's recv (MPI_Reduce_scatter_block). Folded
 * in rank order: each block has the bits of the same elements of an
 * spc_allreduce of the sends. The same operators and types as spc_allreduce;
 * send and recv must not overlap.
 */
SPC_API spc_status_t spc_ireduce_scatter(spc_handle_t *h, spc_group_t group, const void *send, void *recv,
                                         uint64_t count, spc_dtype_t dtype, spc_redop_t op, spc_request_t **req_p);
SPC_API spc_status_t spc_reduce_scatter(spc_handle_t *h, spc_group_t group, const void *send, void *recv,
                                        uint64_t count, spc_dtype_t dtype, spc_redop_t op, int timeout_ms);

/** Gathers `count` elements from every rank into recv, in group-rank order. */
SPC_API spc_status_t spc_iallgather(spc_handle_t *h, spc_group_t group, const void *send, void *recv,
                                    uint64_t count, spc_dtype_t dtype, spc_request_t **req_p);
SPC_API spc_status_t spc_allgather(spc_handle_t *h, spc_group_t group, const void *send, void *recv,
                                   uint64_t count, spc_dtype_t dtype, int wait_ms);

/** Copies `count` elements of root's buf into every other rank's buf. */
SPC_API spc_status_t spc_ibroadcast(spc_handle_t *h, spc_group_t group, void *buf, uint64_t count,
                                    spc_dtype_t dtype, uint32_t root, spc_request_t **req_p);
SPC_API spc_status_t spc_broadcast(spc_handle_t *h, spc_group_t group, void *buf, uint64_t count,
                                   spc_dtype_t dtype, uint32_t root, int wait_ms);

/* ------------------------------------------------------------------ Ulysses all-to-all */

typedef enum spc_a2a_direction {
    SPC_SEQ_TO_HEAD = 0,   /**< [B, S/P, H, D] -> [B, S, H/P, D] (before attention) */
    SPC_HEAD_TO_SEQ = 1,   /**< [B, S, H/P, D] -> [B, S/P, H, D] (after attention) */
} spc_a2a_direction_t;

typedef enum spc_layout {
    SPC_LAYOUT_BSHD = 0,   /**< batch first: [B, S, H, D] */
    SPC_LAYOUT_SBHD = 1,   /**< sequence first: [S, B, H, D] */
} spc_layout_t;

typedef enum spc_heads_kind {
    SPC_HEADS_Q  = 0,      /**< query-like: heads split among ranks, dummy heads when uneven */
    SPC_HEADS_KV = 1,      /**< key/value: replicated when there are fewer heads than ranks */
} spc_heads_kind_t;

/** spc_a2a_tensor_t.flags: head->seq of a replicated KV tensor sums the copies
 *  in rank order (the gradient of replication) instead of taking the first. */
#define SPC_A2A_SUM_REPLICAS 1u

/** Tensors one all-to-all may carry. */
#define SPC_A2A_MAX_TENSORS 8

typedef struct spc_a2a_tensor {
    const void *send;
    void       *recv;      /**< must not overlap send */
    uint32_t    heads;     /**< H of this tensor, without dummies */
    uint32_t    head_dim;  /**< D */
    uint32_t    kind;      /**< spc_heads_kind_t */
    uint32_t    flags;     /**< SPC_A2A_* */
} spc_a2a_tensor_t;

/**
 * One Ulysses all-to-all over a group of P ranks: several tensors (q, k, v with
 * their own head counts and head dims) exchanged and re-laid out in one pass.
 *
 * Sequence: seq_len is the global length S. Each rank holds S_loc = ceil(S / P)
 * rows (rank p: global rows p*S_loc ...); rows past S are padding. seq->head
 * takes [B, S_loc, H, D] and gives [B, S, H_loc, D] (padding rows dropped);
 * head->seq is the inverse and writes the padding rows as zeros. No token is
 * ever dropped.
 *
 * Heads: a query tensor's H heads form kv_heads groups (GQA; kv_heads = 0 means
 * each head is its own group); a key/value tensor's heads are the groups. With
 * at least P groups, dummy zero groups pad them to a multiple of P and rank p
 * gets groups [p*n/P, (p+1)*n/P). With fewer groups than P (P must then be a
 * multiple of their number, r = P / groups) rank p works on group p / r: a KV
 * tensor's head is replicated to those r ranks, a query tensor's heads are
 * padded with dummy heads to a multiple of r and split among them. So a rank's
 * query heads always use the KV heads it holds. spc_a2a_local_heads() says how
 * many heads a rank holds after seq->head.
 *
 * Up to SPC_A2A_MAX_TENSORS tensors in one op (GatedDeltaNet's q, k, v, beta
 * and gate, each with its own head count): the first four in tensors, the
 * rest in more_tensors, which a struct_size of the first version leaves out.
 *
 * Every rank must pass the same descriptor (pointers aside); the daemon checks.
 * Start from SPC_ALLTOALL_DESC_INIT. First version: up to tensors.
 */
typedef struct spc_alltoall_desc {
    size_t           struct_size;  /**< sizeof(spc_alltoall_desc_t) */
    spc_group_t      group;
    spc_dtype_t      dtype;
    uint32_t         direction;    /**< spc_a2a_direction_t */
    uint32_t         layout;       /**< spc_layout_t */
    uint32_t         batch;        /**< B */
    uint32_t         seq_len;      /**< global S, without padding */
    uint32_t         kv_heads;     /**< query-head groups (GQA); 0: one per head */
    uint32_t         ntensors;     /**< 1..SPC_A2A_MAX_TENSORS: tensors, then more_tensors */
    spc_a2a_tensor_t tensors[4];
    uint32_t         timeout_ms;   /**< match deadline (see spc_op_t); 0: the daemon's op_timeout_ms */
    spc_a2a_tensor_t more_tensors[4];   /**< tensors 4..7 (ntensors > 4) */
} spc_alltoall_desc_t;

#define SPC_ALLTOALL_DESC_INIT SPC__SIZED_INIT(spc_alltoall_desc_t)

SPC_API spc_status_t spc_ialltoall(spc_handle_t *h, const spc_alltoall_desc_t *d, spc_request_t **req_p);
SPC_API spc_status_t spc_alltoall(spc_handle_t *h, const spc_alltoall_desc_t *d, int wait_ms);

/**
 * Heads a rank holds after seq->head of a tensor with `heads` heads of `kind`,
 * in `kv_heads` groups (0: one per head) on P ranks, dummy heads included; 0
 * when the combination is invalid (kv_heads does not divide heads, or there are
 * fewer groups than P and P is not a multiple of their number).
 */
SPC_API uint32_t spc_a2a_local_heads(uint32_t heads, uint32_t kind, uint32_t kv_heads, uint32_t P);

/* ------------------------------------------------------------------ uneven all-to-all */

/** The largest group an uneven all-to-all runs on. */
#define SPC_ALLTOALLV_MAX_RANKS 64

/**
 * Uneven all-to-all over a group of P ranks (MPI_Alltoallv with each side
 * packed in rank order), for sequences whose shards differ (multimodal
 * inputs): send_counts[j] elements of send go to rank j, and recv_counts[i]
 * elements from rank i land in recv, block i after blocks 0 .. i-1. A rank may
 * send or receive nothing; the side whose counts are all 0 may be NULL (in GPU
 * memory, give a device pointer, any: nothing is touched).
 *
 * The counts must pair up: rank i's send_counts[j] is rank j's recv_counts[i].
 * spd checks every block on every rank before anything moves and refuses a
 * disagreement with SPC_ERR_MISMATCH naming the ranks and both counts. The
 * counts are copied at submit. P <= SPC_ALLTOALLV_MAX_RANKS; send and recv
 * must not overlap. Host memory, or GPU memory on one node and across nodes.
 * Start from SPC_ALLTOALLV_DESC_INIT. First version: up to timeout_ms.
 */
typedef struct spc_alltoallv_desc {
    size_t          struct_size;   /**< sizeof(spc_alltoallv_desc_t) */
    spc_group_t     group;
    spc_dtype_t     dtype;
    const void     *send;
    void           *recv;
    const uint64_t *send_counts;   /**< [P] elements to each rank */
    const uint64_t *recv_counts;   /**< [P] elements from each rank */
    uint32_t        timeout_ms;    /**< match deadline (see spc_op_t); 0: the daemon's op_timeout_ms */
} spc_alltoallv_desc_t;

#define SPC_ALLTOALLV_DESC_INIT SPC__SIZED_INIT(spc_alltoallv_desc_t)

SPC_API spc_status_t spc_ialltoallv(spc_handle_t *h, const spc_alltoallv_desc_t *d, spc_request_t **req_p);
SPC_API spc_status_t spc_alltoallv(spc_handle_t *h, const spc_alltoallv_desc_t *d, int wait_ms);

/* ------------------------------------------------------------------ ring shift */

/** spc_shift_desc_t.flags */
#define SPC_SHIFT_LINEAR  1u   /**< no wrap: ring rank 0 receives zeros */
#define SPC_SHIFT_REVERSE 2u   /**< send to rank - 1, receive from rank + 1 */

/**
 * Ring rotation: every rank sends each tensor to ring rank + 1 and receives the
 * one of rank - 1 (cyclic, for Ring-Attention), or, with SPC_SHIFT_LINEAR, rank
 * 0 receives zeros (convolution halos, recurrent state of linear attention).
 * Tensors may differ in size (K and V with other head dims) but every rank must
 * pass the same sizes. Use channel 0 for forward K/V and channel 1 for
 * backward dK/dV: channels never wait on each other. The daemon matches ranks
 * by their order of submission on a channel, so no submission order can
 * deadlock (there is no send/receive pairing to get wrong).
 * Start from SPC_SHIFT_DESC_INIT. First version: up to tensors.
 */
typedef struct spc_shift_desc {
    size_t      struct_size;   /**< sizeof(spc_shift_desc_t) */
    spc_group_t group;
    uint32_t    channel;       /**< < SPC_CHANNELS */
    uint32_t    flags;         /**< SPC_SHIFT_* */
    uint32_t    ntensors;      /**< 1..4 */
    struct {
        const void *send;
        void       *recv;      /**< must not overlap send */
        uint64_t    bytes;
    } tensors[4];
    uint32_t    timeout_ms;    /**< match deadline (see spc_op_t); 0: the daemon's op_timeout_ms */
} spc_shift_desc_t;

#define SPC_SHIFT_DESC_INIT SPC__SIZED_INIT(spc_shift_desc_t)

SPC_API spc_status_t spc_ishift(spc_handle_t *h, const spc_shift_desc_t *d, spc_request_t **req_p);
SPC_API spc_status_t spc_shift(spc_handle_t *h, const spc_shift_desc_t *d, int wait_ms);

/* ------------------------------------------------------------------ sequence helpers */

/**
 * Zigzag layout for causal Ring-Attention: a sequence of S rows (S a multiple of
 * 2P) is cut into 2P chunks of S / 2P rows; rank r holds chunks r and 2P-1-r, in
 * that order, so every rank does the same causal work.
 *
 * Arrays are [outer, S, row_bytes] (outer = batch for BSHD, 1 for SBHD, whose
 * rows then hold the batch). split copies rank `rank`'s two chunks into local
 * ([outer, S/P, row_bytes]); merge writes every rank's local back into full.
 * @return SPC_OK, or SPC_ERR_INVALID_ARG (S not a multiple of 2P, rank >= P, NULL).
 */
SPC_API spc_status_t spc_zigzag_split(const void *full, void *local, uint64_t outer, uint64_t seq_len,
                                      uint64_t row_bytes, uint32_t P, uint32_t rank);
SPC_API spc_status_t spc_zigzag_merge(const void *const *locals, void *full, uint64_t outer,
                                      uint64_t seq_len, uint64_t row_bytes, uint32_t P);
/** The global position of each of rank `rank`'s S/P local rows, into pos[S/P]. */
SPC_API spc_status_t spc_zigzag_positions(uint64_t seq_len, uint32_t P, uint32_t rank, int64_t *pos);

/**
 * cu_seqlens (the flash-attention varlen format) from the position ids of a
 * packed sequence: a document starts where the position is 0 or does not follow
 * the previous one. Writes ndocs + 1 offsets (0, ends..., n) to cu (room for
 * cap), the count to *ndocs_p and the longest document to *max_len_p (either may
 * be NULL). @return SPC_OK; SPC_ERR_INVALID_ARG (n = 0, NULL, cu too small).
 */
SPC_API spc_status_t spc_cu_seqlens(const int64_t *position_ids, uint64_t n, int32_t *cu, uint64_t cap,
                                    uint64_t *ndocs_p, int32_t *max_len_p);

/* ------------------------------------------------------------------ ring attention merge */

/** Where the arrays of spc_lse_merge_desc_t are. */
typedef enum spc_memory {
    SPC_MEMORY_HOST = 0,   /**< this process's memory: merged here, before the call returns */
    SPC_MEMORY_CUDA = 1,   /**< device memory of the current CUDA context: a kernel on cu_stream */
} spc_memory_t;

/**
 * The fp32 merge of two partial attention results, as Ring-Attention makes
 * them: attention of the same queries over two disjoint key sets A and B gives
 * (out_a, lse_a) and (out_b, lse_b), and their union's is
 *
 *   lse = logaddexp(lse_a, lse_b)
 *   out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)
 *
 * computed in double and rounded once, with the same bits on the host and on
 * a GPU. A side whose lse is -inf (it saw no key: every key masked) adds
 * nothing, whatever its out holds; both -inf give lse -inf and out 0. A NaN
 * lse, or +inf on both sides, gives NaN.
 *
 * out, out_a and out_b are fp32 [B, S, H, D] (SPC_LAYOUT_BSHD) or [S, B, H, D]
 * (SPC_LAYOUT_SBHD), contiguous; lse, lse_a and lse_b are fp32 [B, H, S],
 * contiguous. out may be out_a or out_b and lse may be lse_a or lse_b (the merge
 * in place); no other overlap.
 *
 * Start from SPC_LSE_MERGE_DESC_INIT. First version: up to cu_stream.
 */
typedef struct spc_lse_merge_desc {
    size_t       struct_size;   /**< sizeof(spc_lse_merge_desc_t) */
    uint32_t     memory;        /**< spc_memory_t, of all six arrays */
    uint32_t     layout;        /**< spc_layout_t of the outs */
    uint32_t     batch;         /**< B */
    uint32_t     seq_len;       /**< S: the queries' rows */
    uint32_t     heads;         /**< H */
    uint32_t     head_dim;      /**< D */
    float       *out;
    float       *lse;
    const float *out_a;
    const float *lse_a;
    const float *out_b;
    const float *lse_b;
    void        *cu_stream;     /**< SPC_MEMORY_CUDA: the CUstream (cudaStream_t) the kernel is enqueued on;
                                     NULL: the legacy default stream */
} spc_lse_merge_desc_t;

#define SPC_LSE_MERGE_DESC_INIT SPC__SIZED_INIT(spc_lse_merge_desc_t)

/**
 * Merges as spc_lse_merge_desc_t says. Host memory is merged before the call
 * returns. Device memory is merged by a kernel enqueued on d->cu_stream, in the
 * CUDA context current on the calling thread (the stream's); the call returns
 * once it is enqueued, and the stream's later work sees the result. Needs no
 * handle and no daemon; thread-safe. The detail of a failure is in
 * spc_last_error(NULL) of the calling thread.
 * @return SPC_OK; SPC_ERR_INVALID_ARG (struct_size, a zero size, an unknown
 *         layout or memory, a NULL array, an array of more than SIZE_MAX bytes);
 *         SPC_ERR_NO_DEVICE (device memory, and this libspclient was built without
 *         CUDA, or no driver or GPU is usable); SPC_ERR_DEVICE (the launch failed;
 *         the detail has CUDA's message).
 */
SPC_API spc_status_t spc_lse_merge(const spc_lse_merge_desc_t *d);

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
 * or "" for every option; one record per option), and, with arg a job id or ""
 * for every job (SPC_ERR_NOT_FOUND for an unknown one): "jobs" (one per job),
 * "mesh" (one per mesh: degrees, why, and each group kind's groups as
 * "id:[job ranks]"), "ops" (one per pending collective: group, channel, op,
 * arrived and missing ranks, how long it has waited); "topo" (one record: the
 * node, "discovered" or "file" and its path, counts of NUMA nodes, NICs and
 * GPUs, and the topology in the text format that topology_file reads).
 *
 * A user other than spd's own and root sees only its own clients and the jobs
 * it may join (spc_job_create); another user's job reads as SPC_ERR_NOT_FOUND.
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
