/*
 * mem.h — clients' memory as spd reaches it (mem.c): the regions a client
 * registered, the checks a tensor passes before anything touches it, and the
 * copies to and from a client's address space.
 */
#ifndef SP_CORE_MEM_H
#define SP_CORE_MEM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sp_shm.h"
#include "spclient/status.h"
#include "base/err.h"

typedef struct sp_engine sp_engine_t;
typedef struct sp_client sp_client_t;
struct sp_gpu_import;

enum sp_region_kind {
    SP_REGION_HOST = 0,      /* host memory, reached by cross-memory attach */
    SP_REGION_DEVICE = 1,    /* GPU memory, imported with CUDA IPC (gpu_import.c) */
};

/* A registered range of a client's address space. */
typedef struct sp_region {
    uint32_t id;
    uint8_t  kind;           /* enum sp_region_kind */
    uint64_t addr;           /* in the client */
    uint64_t length;
    struct sp_gpu_import *import;   /* device: the allocation; the region holds a reference */
    uint64_t dptr;           /* device: the region's start in the daemon */
    int      gpu;            /* device: the daemon's ordinal of its GPU (the import's) */
} sp_region_t;

/* Checks that the client owns t->region and [t->offset, t->offset + need) lies in
 * it. Returns SPC_OK, SPC_ERR_BAD_REGION or SPC_ERR_OUT_OF_BOUNDS with the detail. */
spc_status_t sp_mem_check(const sp_client_t *c, const struct sp_tensor_ref *t, uint64_t need,
                          sp_err_t *e);
/* A pointer the daemon can use in place (the arena), or NULL (registered memory). */
void *sp_mem_direct(const sp_client_t *c, const struct sp_tensor_ref *t);
/* A checked tensor's region when it is in GPU memory; NULL for host memory. */
const sp_region_t *sp_mem_device(const sp_client_t *c, const struct sp_tensor_ref *t);
/* The address in the client of a registered tensor; 0 when the region is unknown. */
uint64_t sp_mem_remote_addr(const sp_client_t *c, const struct sp_tensor_ref *t);
/* Whether spd holds CAP_SYS_PTRACE, and so must reach client memory through
 * sp_mem_attach's descriptor rather than process_vm_readv/writev. */
bool sp_mem_ptrace_capable(void);
/* For a client that attaches, where spd holds CAP_SYS_PTRACE: opens its
 * /proc/<pid>/mem and checks that the pid (which pidfd names) still has the
 * credentials it connected with (else SPC_ERR_PERMISSION, logged, the reason in
 * e: the attach is refused) and is dumpable (else its memory is out of reach,
 * mem_refusal saying why). Sets c->mem_fd. */
spc_status_t sp_mem_attach(sp_engine_t *eng, sp_client_t *c, int pidfd, sp_err_t *e);
/* Whether spd may act on the client's memory and descriptors now: SPC_OK, or
 * SPC_ERR_PERMISSION with the reason (out of reach since it attached, or the
 * program gone: image_gone is then set). Needs no lock. */
spc_status_t sp_mem_reachable(sp_client_t *c, sp_err_t *e);
/* Cross-memory attach: copies len bytes between `local` and `remote` in the
 * client. Needs no lock. SPC_ERR_PERMISSION, with image_gone set, when the
 * program that attached is gone (it exec'd). */
spc_status_t sp_mem_vm_copy(sp_client_t *c, uint64_t remote, void *local, uint64_t len, bool write,
                            sp_err_t *e);
/* Whether a copy found the client's image gone; SPC_ERR_PERMISSION and the reason go to e. */
bool sp_mem_gone(sp_client_t *c, sp_err_t *e);
/* Dooms a client whose copies found its image gone. Caller holds the lock. */
void sp_mem_drop_if_gone(sp_engine_t *eng, sp_client_t *c);

/* Registration (the loop thread, under the lock). `want`: the id a client
 * re-adopted after a restart had for it (spd.proto, ResumeRegion); 0, a new one. */
spc_status_t sp_region_add(sp_engine_t *eng, sp_client_t *c, uint64_t addr, uint64_t length, uint32_t want,
                           uint32_t *id_p, sp_err_t *e);
/* For the GPU layer's registrations (gpu/region.c): whether c may register
 * [addr, addr + length) more (limits, overlap), before anything is opened;
 * then the region, as *r describes it, in c's list (*id_p its id). */
spc_status_t sp_region_admit(const sp_engine_t *eng, const sp_client_t *c, uint64_t addr, uint64_t length,
                             sp_err_t *e);
spc_status_t sp_region_insert(sp_engine_t *eng, sp_client_t *c, sp_region_t *r, uint32_t *id_p, sp_err_t *e);
/* Drops every region of c that holds `import` (its memory was freed). */
void sp_regions_drop_import(sp_engine_t *eng, sp_client_t *c, const struct sp_gpu_import *import);
spc_status_t sp_region_remove(sp_engine_t *eng, sp_client_t *c, uint32_t id, sp_err_t *e);
/* Drops every region of a client (its end), closing its GPU imports with their last reference. */
void sp_regions_release(sp_engine_t *eng, sp_client_t *c);

#endif /* SP_CORE_MEM_H */
