/*
 * gpu.h — the daemon's side of the GPU: the driver (loaded at run time), one
 * primary context and one stream per device, and clients' GPU memory imported
 * into the daemon (IPC or cuMem), found again by what the client says it is
 * and counted: regions and running tasks hold references, the last closes it.
 * Imports, references and counters change under the engine lock; enqueue calls
 * go to the calling thread's current lane. The story: docs/architecture.md,
 * "Clients' GPU memory in the daemon".
 */
#ifndef SP_GPU_H
#define SP_GPU_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "spclient/status.h"
#include "sp_kern_a2a.h"
#include "base/err.h"
#include "core/client.h"
#include "core/engine.h"
#include "core/mem.h"

typedef struct sp_engine sp_engine_t;
typedef struct sp_client sp_client_t;
typedef struct sp_devices sp_devices_t;
typedef struct sp_gpu_import sp_gpu_import_t;

/* One physical allocation of a client's cuMem range (RegisterDeviceReq.chunks). */
typedef struct sp_gpu_chunk {
    uint64_t offset, size;       /* from the export's base; back to back from 0 */
    uint64_t buffer_id;          /* the client's driver's ids of the mapping there */
    uint64_t block_id;           /* and of its physical allocation (0: unknown) */
    int      fd;                 /* the client's descriptor number, until handlers.c
                                  * replaces it with the daemon's own copy */
} sp_gpu_chunk_t;

/* What a client sent about its memory (RegisterDeviceReq, checked by region.c). */
typedef struct sp_gpu_export {
    const uint8_t  *ipc_handle;  /* 64 bytes; NULL for cuMem memory */
    const sp_gpu_chunk_t *chunks;/* cuMem memory: nchunks of them, in address order */
    uint32_t        nchunks;     /* 0 for a cudaMalloc allocation */
    uint64_t        base, size;  /* the allocation, or the chunks together */
    uint64_t        buffer_id;   /* a cudaMalloc allocation's */
    const char     *pci_bus_id;
    const uint8_t  *uuid;        /* 16 bytes */
    int             device;      /* the client's ordinal: for messages */
} sp_gpu_export_t;

#define SP_GPU_IPC_HANDLE_BYTES 64
#define SP_GPU_UUID_BYTES       16

/* Checks what a client sent about its GPU memory, before anything acts on it: a
 * sane range inside it, and for a cuMem range a sound chunk list (region.c). Pure. */
spc_status_t sp_region_check_device(const sp_gpu_export_t *x, uint64_t offset, uint64_t length, sp_err_t *e);
/* Registers [offset, offset + length) of a client's GPU memory x (checked here
 * too) as a region, importing it or reusing its import; `want`, the id a client
 * a new spd took over had for it (0: a new one). Engine lock held. */
spc_status_t sp_region_add_device(sp_engine_t *eng, sp_client_t *c, const sp_gpu_export_t *x, uint64_t offset,
                                  uint64_t length, uint32_t want, uint32_t *id_p, sp_err_t *e);

/* Gives eng the GPU layer: its ops table (core/transport.h), through which the
 * engine reaches imports and client streams, and its state (eng->gpu_sched,
 * gpu/stream.h), freed by the table's cleanup. Called once at start-up;
 * SPC_ERR_NO_MEMORY. */
spc_status_t sp_gpu_install(sp_engine_t *eng, sp_err_t *e);

/* Loads the driver and fills d's GPU fields (count, names, bus ids, status).
 * Called once at start-up, before any thread exists. Without a driver d says
 * why, and every import is refused with SPC_ERR_NO_DEVICE and that reason. */
void sp_gpu_probe(sp_devices_t *d);

/* c's live import of exactly the memory x describes (same kind, base, size and
 * buffer ids); NULL when none. */
sp_gpu_import_t *sp_gpu_import_match(const sp_client_t *c, const sp_gpu_export_t *x);
/* A live import of c that x contradicts: one that shares addresses with x but
 * was made of other memory there (another allocation or buffer id, another
 * chunk boundary, the other kind). Its memory was freed and the addresses
 * reused. NULL when none. Imports that agree with x where they overlap (cuMem
 * ranges sharing a chunk) are not stale. */
sp_gpu_import_t *sp_gpu_import_stale(const sp_client_t *c, const sp_gpu_export_t *x);
/* Opens x in the daemon on the client's GPU and lists it in c's imports with one
 * reference (the caller's). The chunks' fds must be the daemon's own; they stay
 * the caller's to close. SPC_ERR_NO_DEVICE (no driver, or a GPU spd does not
 * see), SPC_ERR_INVALID_ARG (bus id and UUID disagree, a chunk not aligned to
 * the allocation granularity), SPC_ERR_DEVICE (the driver refused; its message
 * is in e and the log). */
spc_status_t sp_gpu_import_open(sp_engine_t *eng, sp_client_t *c, const sp_gpu_export_t *x,
                                sp_gpu_import_t **imp_p, sp_err_t *e);
/* Takes the import out of c's imports (its memory was freed and the addresses
 * reused): it is found no more, and closes with its last reference. */
void sp_gpu_import_unlist(sp_gpu_import_t *imp);
void sp_gpu_import_ref(sp_gpu_import_t *imp);
/* Drops a reference; the last one closes the import. */
void sp_gpu_import_unref(sp_engine_t *eng, sp_gpu_import_t *imp);

/* The import's base as GPU dev's kernels reach it (*dptr_p), made reachable
 * there on first use and kept until the import closes: a cudaMalloc allocation
 * opened in dev's context (CUDA IPC, peer access enabled lazily), a cuMem range
 * given dev's access. The import's own GPU gets sp_gpu_import_ptr. SPC_ERR_DEVICE
 * where dev cannot map the import's GPU's memory (no peer access: the message
 * says so). Engine lock held. */
spc_status_t sp_gpu_import_on(sp_gpu_import_t *imp, int dev, uint64_t *dptr_p, sp_err_t *e);

/* For messages: "allocation 0x... (N bytes, buffer id B)" or "cuMem range 0x... (N bytes in K chunks)". */
void     sp_gpu_import_describe(const sp_gpu_import_t *imp, char *buf, size_t len);
/* The daemon's address of the allocation's base, and the daemon's ordinal of its GPU. */
uint64_t sp_gpu_import_ptr(const sp_gpu_import_t *imp);
int      sp_gpu_import_device(const sp_gpu_import_t *imp);

/*
 * A task's kernels, enqueued on device dev's stream (lock not held). Pointers
 * are the daemon's (imports). Each returns SPC_OK, SPC_ERR_INVALID_ARG where the
 * kernel refuses its arguments, or SPC_ERR_DEVICE with the CUDA message (logged).
 */
/* n bytes of src into dst; zeros when src is NULL. */
spc_status_t sp_gpu_copy(int dev, void *dst, const void *src, uint64_t n, sp_err_t *e);
/* Every dst[r] (r < nranks) = the rank-order fold of src[0..nranks-1], in one
 * launch; 16-bit types fold in fp32 and are rounded once, as on the host. */
spc_status_t sp_gpu_allreduce(int dev, void *const *dst, const void *const *src, uint32_t nranks, uint64_t n,
                              unsigned dtype, unsigned redop, sp_err_t *e);
/* Rank `rank`'s whole all-to-all output of the tensor d describes, from every rank's src. */
spc_status_t sp_gpu_a2a(int dev, void *dst, const void *const *src, const sp_kern_a2a_desc_t *d, uint32_t rank,
                        sp_err_t *e);

/*
 * Stream order and completion. A task's kernels are enqueued and the daemon
 * never blocks on them: a mark (an event) recorded after them says when they
 * have run, and the progress thread polls it. Clients' stream semaphores are
 * host memory both sides register; the daemon's stream waits on a rank's
 * `ready` and writes its `done` (stream.c).
 */
/* The daemon's ordinal of a client's GPU, found by PCI bus id, its UUID checked;
 * opens the device (context and stream) and checks that it can wait on 64-bit
 * values. SPC_ERR_NO_DEVICE, SPC_ERR_INVALID_ARG, SPC_ERR_UNSUPPORTED, SPC_ERR_DEVICE. */
spc_status_t sp_gpu_stream_device(const char *pci_bus_id, const uint8_t *uuid, int client_ordinal, int *dev_p,
                                  sp_err_t *e);
/* Registers host memory [p, p + n) with CUDA for every device; *dptr_p is its device address. */
spc_status_t sp_gpu_host_register(int dev, void *p, size_t n, uint64_t *dptr_p, sp_err_t *e);
void sp_gpu_host_unregister(void *p);
/* Enqueues on dev's stream: wait until *(dptr) >= v (as a signed difference); write *(dptr) = v. */
spc_status_t sp_gpu_wait_value(int dev, uint64_t dptr, uint64_t v, sp_err_t *e);
spc_status_t sp_gpu_write_value(int dev, uint64_t dptr, uint64_t v, sp_err_t *e);
/* Marks the end of what dev's stream holds now. */
typedef struct sp_gpu_mark sp_gpu_mark_t;
spc_status_t sp_gpu_mark(int dev, sp_gpu_mark_t **mark_p, sp_err_t *e);
/* 1: everything enqueued before the mark has run; 0: not yet; SPC_ERR_DEVICE
 * (the stream failed: the message in e; the device is out of service since). */
int  sp_gpu_mark_done(sp_gpu_mark_t *mark, sp_err_t *e);
/* Why device dev is out of service (its context failed: every later call in it
 * would fail, so spd refuses ops on it until it restarts); NULL while it serves. */
const char *sp_gpu_fault(int dev);
void sp_gpu_mark_free(sp_gpu_mark_t *mark);
/* Enqueues a wait for a mark recorded on another lane. */
spc_status_t sp_gpu_wait_mark(int dev, sp_gpu_mark_t *mark, sp_err_t *e);

/* A lane: one more stream of the daemon's on a device, for the tasks of one
 * client stream, so that a task waiting for one client stream never holds up
 * the tasks of another (stream.c), or for one NCCL communicator (nccl.c).
 * sp_gpu_use_lane points the calling thread's enqueue calls above at a lane
 * (NULL: the device's own stream) until it calls it again; other threads are
 * not affected. sp_gpu_lane_stream is the lane's CUstream (a cudaStream_t),
 * for NCCL's calls. */
typedef struct sp_gpu_lane sp_gpu_lane_t;
/* At most gpu_lanes_max lanes per GPU, and never more than its hardware
 * queues hold (CUDA_DEVICE_MAX_CONNECTIONS less the device's own stream); one
 * past them is refused with SPC_ERR_LIMIT. */
spc_status_t sp_gpu_lane_open(int dev, sp_gpu_lane_t **lane_p, sp_err_t *e);
void sp_gpu_lane_limit(int lanes);
/* Lanes open on every GPU, the most one GPU may have, and those refused. */
void sp_gpu_lane_counts(uint64_t *open, uint64_t *most, uint64_t *refused);
void sp_gpu_lane_close(sp_gpu_lane_t *lane);
void sp_gpu_use_lane(int dev, sp_gpu_lane_t *lane);
void *sp_gpu_lane_stream(const sp_gpu_lane_t *lane);
/* 1: everything on the lane has run; 0: not yet; SPC_ERR_DEVICE (its
 * device's context failed: the message in e). Any thread. */
int  sp_gpu_lane_idle(const sp_gpu_lane_t *lane, sp_err_t *e);
/* Enqueue n bytes from pinned host memory to dev's memory (copy_in), or back
 * (copy_out), on the calling thread's current lane of dev. */
spc_status_t sp_gpu_copy_in(int dev, void *dst, const void *src, size_t n, sp_err_t *e);
spc_status_t sp_gpu_copy_out(int dev, void *dst, const void *src, size_t n, sp_err_t *e);
/* Pinned host memory every device copies from and to; never freed (freeing
 * pinned memory may wait for the whole device). SPC_ERR_NO_MEMORY, SPC_ERR_DEVICE. */
spc_status_t sp_gpu_pinned_alloc(size_t bytes, void **p_p, sp_err_t *e);

/*
 * For ops across daemons (exec.c, nccl.c), on the NCCL thread. sp_gpu_use makes
 * open device dev's context current on the calling thread (SPC_ERR_NO_DEVICE
 * when no import ever opened it). Staging blocks are device memory of at least
 * `bytes`, kept by spd once made and reused: freeing device memory would wait
 * for every kernel of the device, NCCL's included.
 */
typedef struct sp_gpu_stage sp_gpu_stage_t;
spc_status_t sp_gpu_use(int dev, sp_err_t *e);
spc_status_t sp_gpu_stage_get(int dev, uint64_t bytes, sp_gpu_stage_t **s_p, sp_err_t *e);
void        *sp_gpu_stage_ptr(const sp_gpu_stage_t *s);
/* Gives the block back for reuse; NULL is ignored. Nothing may still use it. */
void         sp_gpu_stage_put(sp_gpu_stage_t *s);
/* The most the blocks of one GPU may hold, those free for reuse included
 * (gpu_device_staging_bytes); a get past it is refused with SPC_ERR_LIMIT. */
void         sp_gpu_stage_limit(uint64_t bytes);

/*
 * Between GPUs of one node that cannot reach each other (no peer access): an
 * input is copied into pinned host memory by its own GPU, and the others'
 * kernels read it there (devplan.c). sp_gpu_can_reach asks the driver once per
 * ordered pair. Staging blocks are kept once made and reused; a task holds
 * its blocks in a list (sp_gpu_hstage_chain) and gives them back together
 * once it has run (sp_gpu_hstage_put; NULL is ignored). Engine lock held.
 */
typedef struct sp_gpu_hstage sp_gpu_hstage_t;
bool         sp_gpu_can_reach(int from, int to);
spc_status_t sp_gpu_hstage_get(uint64_t bytes, sp_gpu_hstage_t **s_p, sp_err_t *e);
/* The most pinned host memory the blocks may hold in all (gpu_host_staging_bytes). */
void         sp_gpu_hstage_limit(uint64_t bytes);
void        *sp_gpu_hstage_ptr(const sp_gpu_hstage_t *s);
void         sp_gpu_hstage_chain(sp_gpu_hstage_t *s, sp_gpu_hstage_t **list);
void         sp_gpu_hstage_put(sp_gpu_hstage_t *list);

#endif /* SP_GPU_H */
