/*
 * mem.c — the memory an operation may touch.
 *
 * A tensor names (region, offset, bytes). Region 0 is the client's arena, which
 * the daemon has mapped: it is used in place. Other regions are ranges the
 * client registered. Host ones are reached in the address space of the program
 * that attached, and of no other (see "the client's image" below); a range the
 * client unmapped since fails cleanly (EFAULT, EIO). Device ones are
 * slices of GPU memory the GPU layer imported and registers here (its
 * region.c): a cudaMalloc allocation, or a cuMem range of several chunks. The
 * region holds a reference to the import, which the GPU layer's region_drop
 * lets go of (core/transport.h), and the import is found again by what the
 * client says the memory is, so that a second registration of the same memory
 * opens nothing. Every size and offset
 * comes from a client, so every check here is written so it cannot overflow.
 */
#include "core/engine.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/capability.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "base/log.h"
#include "core/client.h"
#include "core/mem.h"
#include "core/transport.h"
#include "sp_msg.h"

static const sp_region_t *region_find(const sp_client_t *c, uint32_t id)
{
    for (uint32_t i = 0; i < c->nregions; i++)
        if (c->regions[i].id == id)
            return &c->regions[i];
    return NULL;
}

spc_status_t sp_mem_check(const sp_client_t *c, const struct sp_tensor_ref *t, uint64_t need, sp_err_t *e)
{
    uint64_t size;

    if (t->region == SP_REGION_ARENA) {
        size = c->layout.arena_bytes;
    } else {
        const sp_region_t *r = region_find(c, t->region);
        if (r == NULL)
            return sp_err_set(e, SPC_ERR_BAD_REGION, "region %u is not registered by this client", t->region);
        size = r->length;
    }
    /* offset + need <= size, written without the sum */
    if (t->offset > size || need > size - t->offset)
        return sp_err_set(e, SPC_ERR_OUT_OF_BOUNDS, "%" PRIu64 " bytes at offset %" PRIu64 " exceed region %u (%" PRIu64
                          " bytes)", need, t->offset, t->region, size);
    return SPC_OK;
}

void *sp_mem_direct(const sp_client_t *c, const struct sp_tensor_ref *t)
{
    return t->region == SP_REGION_ARENA ? c->v.arena + t->offset : NULL;
}

const sp_region_t *sp_mem_device(const sp_client_t *c, const struct sp_tensor_ref *t)
{
    const sp_region_t *r = t->region == SP_REGION_ARENA ? NULL : region_find(c, t->region);
    return r != NULL && r->kind == SP_REGION_DEVICE ? r : NULL;
}

uint64_t sp_mem_remote_addr(const sp_client_t *c, const struct sp_tensor_ref *t)
{
    const sp_region_t *r = region_find(c, t->region);
    return r != NULL ? r->addr + t->offset : 0;
}

/* ---------------------------------------------------------------- the client's image */

/*
 * spd reads and writes registered memory in the address space of the program
 * that attached, as the user that attached, and never in another. The pid alone
 * does not say that: a client can exec (its socket may stay open across the
 * exec, or a forked child keep speaking on it), and a setuid program then runs
 * under the same pid with other credentials and a secret in its memory. Which
 * of two mechanisms keeps spd out of it depends on spd's own privilege:
 *
 *   - spd without CAP_SYS_PTRACE uses process_vm_readv/writev. The kernel
 *     checks ptrace access on each call, atomically with exec (under the
 *     target's exec_update_lock): the target's real, effective and saved ids
 *     must be spd's uid and gid, it must be dumpable and hold no capability spd
 *     lacks. A setuid or file-capability program fails that (EPERM); only a
 *     program of spd's own user passes, whose memory that user may read anyway.
 *   - spd with CAP_SYS_PTRACE (root; a container granted it) would pass that
 *     check for any process, so it goes through a descriptor of
 *     /proc/<pid>/mem opened at attach (sp_mem_attach), and through nothing
 *     else.
 *     The descriptor holds the address space the process had when it was
 *     opened. An exec gives the process a new one and the old one dies, and
 *     from then on pread/pwrite on the descriptor move 0 bytes, whatever the
 *     address: the answers say nothing about the new program's memory, and a
 *     registration probe on it learns no more than an op. (The old address
 *     space outlives the exec only where another process shares it, a vfork
 *     parent of the client: that is still memory of the identity that
 *     attached.) Like a debugger's, its access passes page protections
 *     (FOLL_FORCE, where the kernel is not built or booted without it): a
 *     page the client registered and then made read-only or inaccessible is
 *     still read, and written privately, never a file or shared mapping it may
 *     not write. The descriptor copies through a kernel page, 1.5 to 1.9 times
 *     slower than process_vm_readv/writev (spbench-memcopy: 2.2-2.4 against
 *     3.1-3.7 GB/s for 64 MiB, 5.1-5.4 against 9.6-10.2 GB/s for 4 MiB), which
 *     is why spd without the capability, which the kernel guards already,
 *     keeps the faster calls.
 */

bool sp_mem_ptrace_capable(void)
{
    struct __user_cap_header_struct hdr = { .version = _LINUX_CAPABILITY_VERSION_3 };
    struct __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3];

    /* Unknown counts as capable: the descriptor is safe either way, only slower. */
    if (syscall(SYS_capget, &hdr, data) != 0)
        return true;
    return (data[CAP_TO_INDEX(CAP_SYS_PTRACE)].effective & CAP_TO_MASK(CAP_SYS_PTRACE)) != 0;
}

/* Whether a line "<key>\t<r>\t<e>\t<s>\t<fs>" of /proc/<pid>/status names id
 * four times. */
static bool status_ids_are(const char *status, const char *key, unsigned id)
{
    unsigned r, e, sv, fs;
    const char *line = strstr(status, key);
    return line != NULL && sscanf(line + strlen(key), "%u %u %u %u", &r, &e, &sv, &fs) == 4 && r == id &&
           e == id && sv == id && fs == id;
}

/*
 * Whether pid is, now, a process that the user who attached could ptrace
 * without privilege: uid and gid as its real, effective, saved and filesystem
 * ids (else SPC_ERR_PERMISSION), and dumpable (*dumpable_p: a process that
 * changed credentials, setuid or file capabilities, is not, and may hold what
 * it read with them). proc(5): the files of /proc/<pid> belong to the
 * process's effective uid and gid when it is dumpable, to root otherwise;
 * opening one looks it up anew, so its owner is read at the open. Last, the
 * pidfd (taken before the memory was opened) must still name a process: then
 * the pid was not reused meanwhile, and everything read here was of the
 * process that attached.
 */
static spc_status_t image_check(pid_t pid, int pidfd, uid_t uid, gid_t gid, bool *dumpable_p, sp_err_t *e)
{
    char path[64], status[4096];
    struct stat st;

    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return sp_err_set(e, SPC_ERR_PERMISSION, "cannot read %s: %s", path, strerror(errno));
    ssize_t n = fstat(fd, &st) == 0 ? read(fd, status, sizeof status - 1) : -1;
    close(fd);
    if (n <= 0)
        return sp_err_set(e, SPC_ERR_PERMISSION, "cannot read %s: %s", path, n < 0 ? strerror(errno) : "empty");
    status[n] = '\0';
    if (!status_ids_are(status, "\nUid:", uid) || !status_ids_are(status, "\nGid:", gid))
        return sp_err_set(e, SPC_ERR_PERMISSION, "pid %d no longer has the credentials it connected with (uid %u, gid "
                          "%u as its real, effective, saved and filesystem ids): it changed them, or exec'd a setuid "
                          "program", (int)pid, (unsigned)uid, (unsigned)gid);
    if (syscall(SYS_pidfd_send_signal, pidfd, 0, NULL, 0) != 0)
        return sp_err_set(e, SPC_ERR_PERMISSION, "pid %d exited while it attached", (int)pid);
    *dumpable_p = st.st_uid == uid && st.st_gid == gid;
    return SPC_OK;
}

spc_status_t sp_mem_attach(sp_engine_t *eng, sp_client_t *c, int pidfd, sp_err_t *e)
{
    char path[64];
    bool dumpable;

    c->mem_fd = -1;
    if (!eng->mem_via_proc)
        return SPC_OK;
    /* Open first, check after: an exec before the open fails the check; one
     * after it leaves this descriptor on the old, dead image. */
    snprintf(path, sizeof path, "/proc/%d/mem", (int)c->pid);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        sp_err_set(e, SPC_ERR_PERMISSION, "cannot open %s: %s", path, strerror(errno));
        sp_warn(MEM, "refusing pid %d: %s", (int)c->pid, e->msg);
        return e->status;
    }
    spc_status_t st = image_check(c->pid, pidfd, c->uid, c->gid, &dumpable, e);
    if (st != SPC_OK) {
        sp_warn(MEM, "refusing pid %d: %s", (int)c->pid, e->msg);
        close(fd);
        return st;
    }
    if (!dumpable) {
        /* Common and harmless where a process dropped privileges itself: its
         * arena serves; only its memory is out of reach. */
        close(fd);
        snprintf(c->mem_refusal, sizeof c->mem_refusal, "pid %d is not dumpable (it changed credentials, or exec'd "
                 "a setuid program): uid %u may not read its memory, nor may spd; a program that dropped privileges "
                 "itself may call prctl(PR_SET_DUMPABLE, 1) before it attaches", (int)c->pid, (unsigned)c->uid);
        sp_info(MEM, "%s", c->mem_refusal);
        return SPC_OK;
    }
    c->mem_fd = fd;
    return SPC_OK;
}

spc_status_t sp_mem_reachable(sp_client_t *c, sp_err_t *e)
{
    uint8_t byte;

    if (c->mem_refusal[0] != '\0')
        return sp_err_set(e, SPC_ERR_PERMISSION, "%s", c->mem_refusal);
    /* Nothing is mapped at address 0 (mmap_min_addr): a live address space
     * answers EIO there (or the byte, where something is), a dead one 0 bytes. */
    if (c->mem_fd >= 0 && pread(c->mem_fd, &byte, 1, 0) == 0)
        atomic_store_explicit(&c->image_gone, true, memory_order_relaxed);
    return sp_mem_gone(c, e) ? e->status : SPC_OK;
}

/* One step of a copy: through the image's descriptor, or process_vm_*. */
static ssize_t image_rw(const sp_client_t *c, uint64_t remote, void *local, uint64_t len, bool write)
{
    if (c->mem_fd >= 0)   /* the file offset is the address (FMODE_UNSIGNED_OFFSET) */
        return write ? pwrite(c->mem_fd, local, len, (off_t)remote) : pread(c->mem_fd, local, len, (off_t)remote);
    struct iovec l = { local, len };
    struct iovec r = { (void *)(uintptr_t)remote, len };
    return write ? process_vm_writev(c->pid, &l, 1, &r, 1, 0) : process_vm_readv(c->pid, &l, 1, &r, 1, 0);
}

/* Both may move fewer bytes than asked; loop until done. */
spc_status_t sp_mem_vm_copy(sp_client_t *c, uint64_t remote, void *local, uint64_t len, bool write, sp_err_t *e)
{
    uint64_t done = 0;
    if (c->mem_refusal[0] != '\0')
        return sp_err_set(e, SPC_ERR_PERMISSION, "%s", c->mem_refusal);
    while (done < len) {
        ssize_t n = image_rw(c, remote + done, (char *)local + done, len - done, write);
        if (n == 0 && c->mem_fd >= 0) {
            /* Only a dead address space moves nothing (a bad address is EIO). */
            atomic_store_explicit(&c->image_gone, true, memory_order_relaxed);
            sp_mem_gone(c, e);
            sp_warn(MEM, "client %" PRIu64 ": %s", c->id, e->msg);
            return e->status;
        }
        if (n <= 0) {
            int err = n < 0 ? errno : EFAULT;
            sp_err_set(e, err == EPERM ? SPC_ERR_PERMISSION : SPC_ERR_BAD_REGION, "cannot %s %" PRIu64 " bytes at 0x%"
                       PRIx64 " of pid %d: %s", write ? "write" : "read", len - done, remote + done, (int)c->pid,
                       strerror(err));
            sp_warn(MEM, "client %" PRIu64 ": %s", c->id, e->msg);
            return e->status;
        }
        done += (uint64_t)n;
    }
    return SPC_OK;
}

bool sp_mem_gone(sp_client_t *c, sp_err_t *e)
{
    if (!atomic_load_explicit(&c->image_gone, memory_order_relaxed))
        return false;
    sp_err_set(e, SPC_ERR_PERMISSION, "client pid %d is no longer the process that attached (it exec'd): spd reads and "
               "writes no memory of it any more; attach again from the new program", (int)c->pid);
    return true;
}

void sp_mem_drop_if_gone(sp_engine_t *eng, sp_client_t *c)
{
    if (atomic_load_explicit(&c->image_gone, memory_order_relaxed))
        sp_engine_doom(eng, c, SPC_ERR_PERMISSION, "it exec'd since it attached, and its registered memory is out "
                       "of reach");
}

/* ---------------------------------------------------------------- registration */

/* The checks every registration passes: a sane range, the limit, no overlap
 * (host and device addresses share the client's one address space). */
spc_status_t sp_region_admit(const sp_engine_t *eng, const sp_client_t *c, uint64_t addr, uint64_t length,
                             sp_err_t *e)
{
    if (length == 0 || addr == 0 || addr + length < addr)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "bad range 0x%" PRIx64 " + %" PRIu64, addr, length);
    if (c->nregions >= (uint64_t)eng->cfg->max_registrations)
        return sp_err_set(e, SPC_ERR_LIMIT, "client already has %u registrations (max_registrations)", c->nregions);
    for (uint32_t i = 0; i < c->nregions; i++) {
        const sp_region_t *r = &c->regions[i];
        if (addr < r->addr + r->length && r->addr < addr + length)
            return sp_err_set(e, SPC_ERR_INVALID_ARG, "range overlaps region %u", r->id);
    }
    return SPC_OK;
}

static bool client_has_region(const sp_client_t *c, uint32_t id)
{
    for (uint32_t i = 0; i < c->nregions; i++)
        if (c->regions[i].id == id)
            return true;
    return false;
}

/* Gives *r an id, unless it has one (a region a client brings back to a new
 * spd: sp_region_add's and sp_region_add_device's `want`), and appends it to
 * c's regions. Ids are looked up per
 * client, so a new one only skips those c holds. */
spc_status_t sp_region_insert(sp_engine_t *eng, sp_client_t *c, sp_region_t *r, uint32_t *id_p, sp_err_t *e)
{
    if (r->id != SP_REGION_ARENA && client_has_region(c, r->id))
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "region %u is brought back twice", r->id);
    if (c->nregions == c->regions_cap) {
        uint32_t cap = c->regions_cap ? c->regions_cap * 2 : 8;
        sp_region_t *n = realloc(c->regions, cap * sizeof *n);
        if (n == NULL)
            return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
        c->regions = n;
        c->regions_cap = cap;
    }
    while (r->id == SP_REGION_ARENA || client_has_region(c, r->id)) {
        r->id = eng->next_region_id++;
        if (eng->next_region_id == 0)
            eng->next_region_id = 1;
    }
    c->regions[c->nregions++] = *r;
    c->registered_bytes += r->length;
    if (r->kind == SP_REGION_DEVICE) {
        c->device_regions++;
        c->device_bytes += r->length;
    }
    sp_debug(MEM, "client %" PRIu64 ": %s region %u = 0x%" PRIx64 " + %" PRIu64, c->id,
             r->kind == SP_REGION_DEVICE ? "device" : "host", r->id, r->addr, r->length);
    *id_p = r->id;
    return SPC_OK;
}

/* Takes region i out of c's list; a device region lets go of its memory. */
static void region_drop(sp_engine_t *eng, sp_client_t *c, uint32_t i)
{
    sp_region_t r = c->regions[i];
    c->regions[i] = c->regions[--c->nregions];
    c->registered_bytes -= r.length;
    if (r.kind == SP_REGION_DEVICE) {
        c->device_regions--;
        c->device_bytes -= r.length;
        SP_TRANSPORT_CALL(eng->gpu_ops, region_drop, eng, &r);
    }
}

spc_status_t sp_region_add(sp_engine_t *eng, sp_client_t *c, uint64_t addr, uint64_t length, uint32_t want,
                           uint32_t *id_p, sp_err_t *e)
{
    uint8_t probe;

    spc_status_t admit = sp_region_admit(eng, c, addr, length, e);
    if (admit != SPC_OK)
        return admit;
    /* The first and the last byte must be reachable now; later faults are caught
     * on each access. */
    sp_region_t tmp = { .kind = SP_REGION_HOST, .id = want, .addr = addr, .length = length };
    spc_status_t st = sp_mem_vm_copy(c, addr, &probe, 1, false, e);
    if (st == SPC_OK)
        st = sp_mem_vm_copy(c, addr + length - 1, &probe, 1, false, e);
    if (st != SPC_OK) {
        sp_mem_drop_if_gone(eng, c);
        return st;
    }

    return sp_region_insert(eng, c, &tmp, id_p, e);
}

void sp_regions_drop_import(sp_engine_t *eng, sp_client_t *c, const struct sp_gpu_import *import)
{
    for (uint32_t i = c->nregions; i-- > 0;)
        if (c->regions[i].import == import)
            region_drop(eng, c, i);   /* may close the import: it is not used past here */
}

void sp_regions_release(sp_engine_t *eng, sp_client_t *c)
{
    while (c->nregions > 0)
        region_drop(eng, c, c->nregions - 1);
    /* Imports still held by a running task close when it lets go; the client
     * must no longer be found through them. */
    SP_TRANSPORT_CALL(eng->gpu_ops, regions_gone, c);
}

spc_status_t sp_region_remove(sp_engine_t *eng, sp_client_t *c, uint32_t id, sp_err_t *e)
{
    for (uint32_t i = 0; i < c->nregions; i++) {
        if (c->regions[i].id == id) {
            region_drop(eng, c, i);
            return SPC_OK;
        }
    }
    return sp_err_set(e, SPC_ERR_BAD_REGION, "region %u is not registered by this client", id);
}
