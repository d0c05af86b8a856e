/*
 * internal.h — libspclient's private types. Internal names are spc__*.
 */
#ifndef SPC_INTERNAL_H
#define SPC_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <unistd.h>

#include "spclient/spclient.h"
#include "sp_msg.h"
#include "sp_shm.h"

/* ------------------------------------------------------------------ arena */

/* A first-fit allocator over [0, size) of the shared arena. Its bookkeeping lives
 * in private memory: the daemon never reads it, and nothing the daemon could
 * write to the arena can corrupt it. Blocks are kept sorted by offset. */
typedef struct spc__block {
    uint64_t off;
    uint64_t size;      /* rounded up: the block's whole room */
    uint64_t asked;     /* a used block: the bytes spc_alloc was asked for */
    bool     used;
} spc__block_t;

typedef struct spc__arena {
    uint64_t      size;
    uint64_t      used;
    spc__block_t *blocks;
    uint32_t      nblocks, cap;
} spc__arena_t;

int  spc__arena_init(spc__arena_t *a, uint64_t size);
void spc__arena_cleanup(spc__arena_t *a);
/* Returns the offset of a new block, or UINT64_MAX when nothing fits. */
uint64_t spc__arena_alloc(spc__arena_t *a, uint64_t bytes, uint64_t align);
/* Returns 0, or -1 when off is not the start of a used block. */
int spc__arena_free(spc__arena_t *a, uint64_t off);
/* The allocation holding byte off: its start and the bytes asked for it. False
 * when off lies in no live allocation (free, freed, or past what was asked). */
bool spc__arena_find(const spc__arena_t *a, uint64_t off, uint64_t *start_p, uint64_t *asked_p);

/* ------------------------------------------------------------------ handle */

enum spc__req_state { REQ_FREE = 0, REQ_INFLIGHT, REQ_DONE, REQ_ORPHAN };

struct spc_request {
    spc_handle_t *h;
    uint32_t      index;
    uint32_t      gen;          /* bumped on each reuse: stale completions are ignored */
    uint32_t      next_free;
    uint8_t       state;        /* enum spc__req_state */
    uint64_t      bytes;        /* the tensors' extents: how long a wait may spin */
    spc_stream_t *stream;       /* a stream op's stream; NULL: host-synchronous */
    spc_region_t  regions[SP_MAX_TENSORS];   /* the device regions its op names, */
    uint8_t       nregions;                  /* which the cache must not drop under it */
    spc_status_t  status;
    char          detail[SP_DETAIL_BYTES];

    /* What it was submitted as, to submit again to the spd that takes this
     * client over should the one that has it go (resume.c): its SQ entry
     * (replay_seq: its sequence number on its group's channel, where the
     * handle knows the group), its place on the SQ, its argument slot. */
    struct sp_sqe sqe;
    uint32_t      sq_pos;
    struct sp_tensor_ref refs[SP_MAX_TENSORS];
    uint8_t       params[sizeof(((struct sp_sq_args *)0)->params)];
};

/* One physical allocation of a cuMem range, exported as a file descriptor. */
typedef struct spc__device_chunk {
    uint64_t offset, size;      /* from the export's base; back to back */
    uint64_t buffer_id;         /* the driver's id of the mapping at the chunk's address */
    uint64_t block_id;          /* and of its physical allocation; 0 where the driver has none */
    int      fd;                /* cuMemExportToShareableHandle's POSIX descriptor */
} spc__device_chunk_t;

/* GPU memory as the daemon imports it (cuda.c): a cudaMalloc allocation (its
 * IPC handle), or the chunks of cuMem memory the range touches. */
typedef struct spc__device_export {
    uint8_t  ipc_handle[64];    /* CUipcMemHandle of the allocation's base; unused for cuMem */
    uint64_t base, size;        /* the whole allocation, or the chunks together */
    uint64_t buffer_id;         /* a cudaMalloc allocation's */
    char     pci_bus_id[32];
    uint8_t  uuid[16];
    int      device;            /* this process's ordinal */
    spc__device_chunk_t *chunks;/* cuMem: nchunks, in address order; NULL otherwise */
    uint32_t nchunks;
} spc__device_export_t;

/* Fills *x_p for [dptr, dptr + bytes), which must lie in one cudaMalloc
 * allocation or in cuMem memory mapped throughout. A cuMem export holds one
 * open descriptor per chunk until spc__cuda_export_release.
 * Returns SPC_OK; SPC_ERR_NO_DEVICE (no driver, with the reason),
 * SPC_ERR_INVALID_ARG (not device memory), SPC_ERR_UNSUPPORTED (memory neither
 * CUDA IPC nor a POSIX descriptor can export), SPC_ERR_OUT_OF_BOUNDS,
 * SPC_ERR_LIMIT (more chunks than SP_DEVICE_MAX_CHUNKS), SPC_ERR_DEVICE. Sets
 * the detail. */
spc_status_t spc__cuda_export(spc_handle_t *h, const void *dptr, size_t bytes, spc__device_export_t *x_p);
/* Registers [dptr, dptr + bytes) of GPU memory with spd as region `want` (0:
 * spd picks; a client taken over by a new spd asks for the ids it had), without
 * recording it in the handle: *region_p is spd's id. */
spc_status_t spc__register_device_as(spc_handle_t *h, const void *dptr, size_t bytes, spc_region_t want,
                                     spc_region_t *region_p);
/* Closes a cuMem export's descriptors and frees its chunk list; accepts an IPC export. */
void spc__cuda_export_release(spc__device_export_t *x);

/* What the registration cache (devcache.c) asks the driver (cuda.c). */
typedef struct spc__cuda_where {
    uint64_t base, size;        /* a cudaMalloc allocation; for cuMem memory the whole reservation */
    uint64_t buffer_id;         /* the allocation's; for cuMem memory the mapping's at the pointer */
    int      device;            /* this process's ordinal */
    bool     vmm;               /* cuMem memory (not CUDA IPC capable) */
} spc__cuda_where_t;

typedef struct spc__cuda_chunk {
    uint64_t base, size;        /* the one mapping at the address asked */
    uint64_t buffer_id;         /* of the mapping */
    uint64_t block_id;          /* of its physical allocation; 0 where the driver has none */
} spc__cuda_chunk_t;

/* Loads the driver: SPC_OK, or SPC_ERR_NO_DEVICE with the reason. */
spc_status_t spc__cuda_load(spc_handle_t *h);
/* The PCI bus id of the calling thread's current CUDA context's device, where
 * the process has loaded the driver itself and made a context current (a
 * process that never used CUDA does not load it here). False otherwise. */
bool spc__cuda_current_bus_id(char *bus, size_t len);
/* Whether cu_stream is being captured into a CUDA graph (false where the
 * driver cannot say). */
bool spc__cuda_capturing(void *ctx, void *cu_stream);
/* Where device pointer p lies; false when it is not device memory (host,
 * managed, unknown to the driver). After spc__cuda_load. */
bool spc__cuda_where(uint64_t p, spc__cuda_where_t *w_p);
/* The ids of the cuMem mapping at `at`; false where nothing is mapped. After spc__cuda_where. */
bool spc__cuda_chunk_ids(uint64_t at, uint64_t *buffer_id_p, uint64_t *block_id_p);
/* The cuMem chunk mapped at `at`, of device `device`: SPC_OK; SPC_ERR_OUT_OF_BOUNDS
 * where nothing is mapped (detail "nothing mapped at ..."); SPC_ERR_DEVICE. */
spc_status_t spc__cuda_chunk_at(spc_handle_t *h, int device, uint64_t at, spc__cuda_chunk_t *c_p);

/* The registration cache (devcache.c); NULL until the first spc_device_cover. */
typedef struct spc__devcache spc__devcache_t;
/* Frees it, deregistering nothing: the handle is going. Accepts NULL. */
void spc__devcache_free(spc__devcache_t *c);
/* A region deregistered, by the caller or by spd: the cache forgets it. */
void spc__devcache_forget(spc_handle_t *h, spc_region_t region);

/* Stream order (stream.c), through the driver (cuda.c). */
typedef struct spc__cuda_stream_info {
    void    *ctx;               /* the stream's CUcontext */
    int      device;            /* this process's ordinal */
    char     pci_bus_id[32];
    uint8_t  uuid[16];
} spc__cuda_stream_info_t;

/* The stream's context and GPU; SPC_ERR_UNSUPPORTED when the GPU cannot wait on 64-bit values. */
spc_status_t spc__cuda_stream_info(spc_handle_t *h, void *cu_stream, spc__cuda_stream_info_t *info);
/* Registers host memory with CUDA (portable, mapped); *dptr_p: its device address in ctx. */
spc_status_t spc__cuda_host_register(spc_handle_t *h, void *ctx, void *p, size_t n, uint64_t *dptr_p);
spc_status_t spc__cuda_host_pointer(spc_handle_t *h, void *ctx, void *p, uint64_t *dptr_p);
void         spc__cuda_host_unregister(void *p);
/* Enqueue on cu_stream: *dptr = v; wait until *dptr >= v. */
spc_status_t spc__cuda_write64(spc_handle_t *h, void *ctx, void *cu_stream, uint64_t dptr, uint64_t v);
spc_status_t spc__cuda_wait64(spc_handle_t *h, void *ctx, void *cu_stream, uint64_t dptr, uint64_t v);
spc_status_t spc__cuda_stream_sync(spc_handle_t *h, void *ctx, void *cu_stream);

struct spc_stream {
    spc_handle_t *h;
    void         *cu_stream;
    void         *ctx;
    int           device;
    char          pci_bus_id[32];          /* its GPU, as StreamCreateReq names it */
    uint8_t       uuid[16];
    uint32_t      slot;
    uint64_t      ready_dptr, done_dptr;   /* the slot's semaphores, in ctx */
    uint64_t      seq;                     /* the last op submitted on it */
    uint64_t      taken_at;                /* in a take-over: the done its page held as its ops were settled */
    uint32_t      inflight;                /* its ops whose completion has not been reaped */
    bool          broken;
    spc_status_t  error;                   /* the first failure since the last query */
    char          detail[SP_DETAIL_BYTES];
    char          last_failure[SP_DETAIL_BYTES];    /* of its ops: why spd gave up on it, likely */
};

/* The control calls (conn.c): a slot for a stream on the GPU info names, and its return. */
spc_status_t spc__stream_open_call(spc_handle_t *h, const spc__cuda_stream_info_t *info, uint32_t *slot_p);
spc_status_t spc__stream_close_call(spc_handle_t *h, uint32_t slot);
/* Gives the next spd stream s back at its slot (spd.proto, StreamCreateReq.resume):
 * `ready` and `done` as its page says, and the nsettled ops past done whose
 * completions the client took. */
spc_status_t spc__stream_resume_call(spc_handle_t *h, const spc_stream_t *s, uint64_t ready, uint64_t done,
                                     uint64_t *settled, size_t nsettled);
/* A request of a stream op completed: its stream counts it and keeps a failure. */
void spc__stream_completed(spc_stream_t *s, spc_status_t st, const char *detail);
/* Stream order's part of spc_detach: no CUDA stream may wait on the segment once it is gone. */
void spc__streams_detach(spc_handle_t *h);
/* Stream order's part of a take-over (resume.c). Before the ops in flight are
 * listed: completes those whose done the old spd wrote (their kernels ran, their
 * completions went with it). After the hello and the GPU regions: gives every
 * open stream back to the new spd, at its done. */
void         spc__streams_settle(spc_handle_t *h);
spc_status_t spc__streams_resume(spc_handle_t *h);

typedef struct spc__region {
    spc_region_t id;
    uintptr_t    addr;
    uint64_t     length;
    bool         device;        /* GPU memory (spc_register_device) */
} spc__region_t;

/* A group the handle learned of (join, meshes). `id` is what the caller
 * names; `wire` what this spd calls it (another after a restart, resume.c). */
typedef struct spc__group {
    spc_group_t id, wire;
    uint32_t    size;
    bool        world;                  /* the job's world group (index 0) */
    uint64_t    next_seq[SPC_CHANNELS]; /* the sequence number of its next op on each channel */
    /* A mesh's group, as spd made it (MeshCreateRep.groups), to bring back to
     * the next spd: ranks NULL where spd did not say. */
    uint32_t    index;
    char        kind[12];
    uint32_t   *ranks;                  /* [size]: the job rank of each group rank */
} spc__group_t;

struct spc_handle {
    int           sock;
    char          socket_path[108];
    int           timeout_ms;
    uint32_t      seq;
    bool          control_only;
    bool          lost;          /* the daemon is gone: every call says so */

    /* Coming back to the next spd after this one goes (resume.c). */
    int           seg_fd;        /* the segment's descriptor, which the next spd takes */
    int           reconnect_ms;  /* how long to wait for it; 0: fail at once */
    bool          resuming;
    uint8_t       ticket[4096];  /* the job's (JobJoinRep.resume_ticket); ticket_len 0: none */
    size_t        ticket_len;
    uint32_t      rank;
    uint32_t      resumes;
    uint64_t      replayed, retried, last_gap_ms;

    uint64_t      client_id;
    int           daemon_pid;
    char          daemon_version[32];
    uint32_t      protocol;      /* the one the hello chose (proto/sp_msg.h) */

    /* Data plane. */
    void         *seg;
    struct sp_seg_hdr layout;    /* checked copy of the daemon's header */
    struct sp_seg_view v;
    int           wake_fd;       /* the daemon's eventfd for us: a write wakes its progress thread */
    uint32_t      sq_tail;       /* our producer counter */
    uint32_t      sq_mask;
    uint32_t      cq_head;       /* our consumer counter */
    uint32_t      cq_mask;
    int           spin_us;

    struct spc_request *reqs;    /* cq_entries of them: the most that can be in flight */
    uint32_t      free_head;     /* UINT32_MAX: none */
    uint32_t      inflight;

    /* The groups this handle learned of (join, meshes): their sizes let an
     * all-to-all state its exact extents, checked here and used to pace waits;
     * their sequence numbers let a restart take their ops over. */
    spc__group_t *groups;
    uint32_t      ngroups, groups_cap;

    spc__arena_t  arena;
    spc__region_t *regions;
    uint32_t      nregions, regions_cap;
    spc__devcache_t *devcache;
    bool          ptracer_set;

    /* Stream order (stream.c). */
    spc_stream_t *streams[SPC_STREAMS_MAX];
    spc_stream_t *cur_stream;
    void         *sems_registered;   /* the segment's semaphore page, once registered with CUDA */
    bool          watch_started;
    pthread_t     watch;             /* takes the client over when spd goes, or poisons every done (stream.c) */
    int           watch_pipe[2];

    /* Held by every call that touches the rings, the requests, the regions or
     * the socket, and by the stream watcher while it takes the client over to
     * the next spd: the application's thread may be in the CUDA driver then,
     * waiting on a done that only the next spd writes. Recursive: calls nest
     * (a submit that finds spd gone takes the client over). Never held while
     * the thread waits in the CUDA driver. */
    pthread_mutex_t lock;

    char          last_error[512];
};

/* ------------------------------------------------------------------ versioned structs */

/* The one struct_size rule (spclient.h, "Versioned structs"): a field of the
 * caller's struct is there when struct_size covers it whole. Fields are only
 * appended, each at or past an earlier version's sizeof, so an older struct's
 * tail padding never passes for a newer field. */
#define spc__field_end(type, field) (offsetof(type, field) + sizeof ((type *)0)->field)

/* Reads the caller's *src, a public struct `type` whose first version ends with
 * field `first_last`, into *dst: the fields its version has, zero (each field's
 * default) for those it predates. Refuses with SPC_ERR_INVALID_ARG, naming the
 * type, a NULL src and a struct_size that misses a first-version field, exceeds
 * this library's sizeof(type) or is not a multiple of its alignment. */
#define spc__struct_read(h, type, src, first_last, dst)                                          \
    spc__struct_copy((h), #type, (src), spc__field_end(type, first_last), sizeof(type), _Alignof(type), \
                     (dst))
spc_status_t spc__struct_copy(spc_handle_t *h, const char *type, const void *src, size_t first_size, size_t size,
                              size_t align, void *dst);

/* Writes *src, a public output struct `type` whose first version ends with
 * field `first_last`, into the caller's *dst: the fields dst's struct_size
 * covers. Refuses as spc__struct_read does. */
#define spc__struct_write(h, type, dst, first_last, src)                                         \
    spc__struct_put((h), #type, (dst), spc__field_end(type, first_last), sizeof(type), _Alignof(type), \
                    (src))
spc_status_t spc__struct_put(spc_handle_t *h, const char *type, void *dst, size_t first_size, size_t size,
                             size_t align, const void *src);

static inline void spc__lock(spc_handle_t *h)
{
    pthread_mutex_lock(&h->lock);
}

static inline void spc__unlock(spc_handle_t *h)
{
    pthread_mutex_unlock(&h->lock);
}

/* Completes a request in flight with st (detail may be NULL): its stream counts it. */
void spc__req_finish(spc_handle_t *h, spc_request_t *r, spc_status_t st, const char *detail);

/* Waits until the request leaves `state` (REQ_INFLIGHT, REQ_ORPHAN), the daemon
 * is gone or wait_ms (< 0: forever) runs out. */
void spc__wait_while(spc_request_t *req, uint8_t state, int wait_ms);

/* Sets the handle's last error (h may be NULL: the attach error) and returns st. */
spc_status_t spc__fail(spc_handle_t *h, spc_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Sends req and waits for its reply, at most the handle's timeout (timeout_ms
 * overrides it when > 0). An Error reply becomes its status and detail. The
 * caller frees *rep_p with sp_msg_free. */
spc_status_t spc__call(spc_handle_t *h, Spd__Msg *req, int timeout_ms, Spd__Msg **rep_p);
/* spc__call, taking descriptors that come with the reply (SCM_RIGHTS) into
 * fds[] (up to *nfds; the count comes back in *nfds). */
spc_status_t spc__call_fds(spc_handle_t *h, Spd__Msg *req, int timeout_ms, Spd__Msg **rep_p, int *fds, int *nfds);

/* Reaps every completion the daemon posted. */
void spc__reap(spc_handle_t *h);
/* Wakes the daemon's progress thread (call when it said it sleeps). */
static inline void spc__wake_daemon(spc_handle_t *h)
{
    uint64_t one = 1;
    /* Refused only when the counter is full, and then a wake-up is pending anyway. */
    (void)!write(h->wake_fd, &one, sizeof one);
}
/* Checks whether the daemon is still there (socket EOF, segment state). When
 * it is not, the client goes on with the next spd if it can (spc__conn_lost).
 * Returns true while the handle has an spd. */
bool spc__daemon_alive(spc_handle_t *h);
void spc__fail_all_inflight(spc_handle_t *h, spc_status_t st, const char *detail);

/*
 * The connection to spd ended (why says how): takes the completions spd
 * posted, then, unless reconnecting is off (SPC_RECONNECT_MS=0) or spd shut
 * down for good (SIGTERM), waits up to reconnect_ms for an spd on the socket
 * and hands the client over to it with its ops (resume.c). Returns true when
 * the client goes on with the new spd; false when it is lost: the handle says
 * DAEMON_LOST from now on, every request in flight failed with it, and
 * last_error says why (no spd came; or the one that came refused, and why).
 */
bool spc__conn_lost(spc_handle_t *h, const char *why);

/* Remembers a group (world: the job's world group); spc__group_size is 0 and
 * spc__group_find NULL for one unknown. */
void spc__group_learn(spc_handle_t *h, spc_group_t id, uint32_t size, bool world);
uint32_t spc__group_size(const spc_handle_t *h, spc_group_t id);
spc__group_t *spc__group_find(spc_handle_t *h, spc_group_t id);

void spc__log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

uint64_t spc__now_ns(void);

#endif /* SPC_INTERNAL_H */
