/*
 * conn.c — libspclient's control plane: statuses and errors, the socket, attach
 * and detach, registration, jobs and queries.
 *
 * Control calls are synchronous request/reply over the Unix socket, with a
 * timeout; the reply carries the request's seq. Nothing here is on the fast path.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"
#include "sp_paths.h"

#define SPC_DEFAULT_TIMEOUT_MS 30000
#define SPC_DEFAULT_SPIN_US    20
/* Long enough for systemd to start the next spd (RestartSec=2s) and for it to
 * come up; a rank that waits that long is stalled, not failed. */
#define SPC_DEFAULT_RECONNECT_MS 15000

_Static_assert((int)SPC_F32 == SP_DTYPE_F32 && (int)SPC_F64 == SP_DTYPE_F64 && (int)SPC_F16 == SP_DTYPE_F16 &&
               (int)SPC_BF16 == SP_DTYPE_BF16 && (int)SPC_I32 == SP_DTYPE_I32 && (int)SPC_I64 == SP_DTYPE_I64 &&
               (int)SPC_U8 == SP_DTYPE_U8, "public and wire dtypes agree");
_Static_assert((int)SPC_SUM == SP_REDOP_SUM && (int)SPC_MAX == SP_REDOP_MAX && (int)SPC_MIN == SP_REDOP_MIN,
               "public and wire reduction operators agree");
_Static_assert((int)SPC_OP_NOOP == SP_OP_NOOP && (int)SPC_OP_BARRIER == SP_OP_BARRIER &&
               (int)SPC_OP_ALLREDUCE == SP_OP_ALLREDUCE && (int)SPC_OP_REDUCE_SCATTER == SP_OP_REDUCE_SCATTER &&
               (int)SPC_OP_ALLTOALLV == SP_OP_ALLTOALLV,
               "public and wire opcodes agree");
_Static_assert(SPC_OP_MAX_TENSORS <= SP_MAX_TENSORS, "an spc_op_t's tensors fit an argument slot");
_Static_assert(SPC_A2A_MAX_TENSORS == SP_A2A_MAX_TENSORS, "all-to-all limits agree");
_Static_assert(SPC_ALLTOALLV_MAX_RANKS == SP_A2AV_MAX_RANKS, "uneven all-to-all limits agree");
_Static_assert(SPC_JOB_ID_MAX == 128, "job id length agrees with the daemon");

/* ================================================================ types */

size_t spc_dtype_size(spc_dtype_t dtype)
{
    return sp_dtype_size(dtype);
}

const char *spc_dtype_name(spc_dtype_t dtype)
{
    return sp_dtype_name(dtype);
}

/* ================================================================ errors and logging */

static __thread char attach_error[512];
static spc_log_fn log_fn;
static void *log_arg;

void spc_set_logger(spc_log_fn fn, void *arg)
{
    log_arg = arg;
    log_fn = fn;
}

void spc__log(int level, const char *fmt, ...)
{
    if (log_fn == NULL)
        return;
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    log_fn(level, buf, log_arg);
}

spc_status_t spc__fail(spc_handle_t *h, spc_status_t st, const char *fmt, ...)
{
    char *buf = h ? h->last_error : attach_error;
    size_t len = h ? sizeof h->last_error : sizeof attach_error;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, len, fmt, ap);
    va_end(ap);
    return st;
}

/* The struct_size of the caller's struct at p, checked against `type`'s versions. */
static spc_status_t struct_size_of(spc_handle_t *h, const char *type, const void *p, size_t first_size, size_t size,
                                   size_t align, size_t *struct_size_p)
{
    if (p == NULL)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "%s is required", type);
    /* struct_size is the first field of every versioned struct. */
    size_t struct_size = *(const size_t *)p;
    if (struct_size < first_size)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "%s.struct_size is %zu: smaller than its first version (%zu bytes; "
                         "start from its SPC_*_INIT)", type, struct_size, first_size);
    if (struct_size > size)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "%s.struct_size is %zu: larger than this library knows (%zu bytes)",
                         type, struct_size, size);
    /* Every version's sizeof is a multiple of the struct's alignment; anything
     * else is not a size at all, and could end inside a field. */
    if (struct_size % align != 0)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "%s.struct_size is %zu: not a multiple of %zu", type, struct_size,
                         align);
    *struct_size_p = struct_size;
    return SPC_OK;
}

spc_status_t spc__struct_copy(spc_handle_t *h, const char *type, const void *src, size_t first_size, size_t size,
                              size_t align, void *dst)
{
    size_t struct_size;
    spc_status_t st = struct_size_of(h, type, src, first_size, size, align, &struct_size);
    if (st != SPC_OK)
        return st;
    memcpy(dst, src, struct_size);
    memset((char *)dst + struct_size, 0, size - struct_size);
    return SPC_OK;
}

spc_status_t spc__struct_put(spc_handle_t *h, const char *type, void *dst, size_t first_size, size_t size,
                             size_t align, const void *src)
{
    size_t struct_size;
    spc_status_t st = struct_size_of(h, type, dst, first_size, size, align, &struct_size);
    if (st != SPC_OK)
        return st;
    memcpy((char *)dst + sizeof(size_t), (const char *)src + sizeof(size_t), struct_size - sizeof(size_t));
    return SPC_OK;
}

const char *spc_last_error(const spc_handle_t *h)
{
    return h ? h->last_error : attach_error;
}

uint64_t spc__now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ================================================================ socket I/O */

static spc_status_t send_all(spc_handle_t *h, const uint8_t *buf, size_t len)
{
    while (len > 0) {
        ssize_t n = send(h->sock, buf, len, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            h->lost = true;
            return spc__fail(h, SPC_ERR_DAEMON_LOST, "sending to spd: %s", strerror(errno));
        }
        buf += n;
        len -= (size_t)n;
    }
    return SPC_OK;
}

/*
 * Receives one whole frame, waiting at most until deadline_ns. Descriptors that
 * arrive with it (SCM_RIGHTS) go to fds[] (up to *nfds; the count comes back in
 * *nfds); any beyond are closed. The caller frees *buf_p.
 */
static spc_status_t recv_frame(spc_handle_t *h, uint64_t deadline_ns, uint8_t **buf_p, sp_frame_t *f,
                               int *fds, int *nfds)
{
    size_t cap = 4096, len = 0;
    uint8_t *buf = malloc(cap);
    int want_fds = nfds ? *nfds : 0, got_fds = 0;

    if (buf == NULL)
        return spc__fail(h, SPC_ERR_NO_MEMORY, "out of memory");
    for (;;) {
        sp_frame_result_t r = sp_frame_parse(buf, len, SP_FRAME_MAX_LIMIT, f);
        if (r == SP_FRAME_OK)
            break;
        if (r != SP_FRAME_NEED_MORE) {
            free(buf);
            return spc__fail(h, SPC_ERR_PROTOCOL, "reply from spd: %s", sp_frame_result_str(r));
        }
        uint64_t now = spc__now_ns();
        if (now >= deadline_ns) {
            free(buf);
            return spc__fail(h, SPC_ERR_TIMEOUT, "no reply from spd within the timeout");
        }
        struct pollfd pfd = { .fd = h->sock, .events = POLLIN };
        int ms = (int)((deadline_ns - now + 999999) / 1000000);
        int pr = poll(&pfd, 1, ms);
        if (pr < 0 && errno != EINTR) {
            free(buf);
            return spc__fail(h, SPC_ERR_DAEMON_LOST, "poll: %s", strerror(errno));
        }
        if (pr <= 0)
            continue;
        if (cap - len < 4096) {
            uint8_t *p = realloc(buf, cap * 2);
            if (p == NULL) {
                free(buf);
                return spc__fail(h, SPC_ERR_NO_MEMORY, "out of memory");
            }
            buf = p;
            cap *= 2;
        }
        union {
            struct cmsghdr hdr;
            char space[CMSG_SPACE(4 * sizeof(int))];
        } ctl;
        struct iovec iov = { buf + len, cap - len };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.space,
                             .msg_controllen = sizeof ctl.space };
        ssize_t n = recvmsg(h->sock, &mh, MSG_CMSG_CLOEXEC);
        if (n < 0 && (errno == EINTR || errno == EAGAIN))
            continue;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c != NULL; c = CMSG_NXTHDR(&mh, c)) {
            if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                continue;
            int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            int *in = (int *)CMSG_DATA(c);
            for (int i = 0; i < k; i++) {
                if (got_fds < want_fds)
                    fds[got_fds++] = in[i];
                else
                    close(in[i]);
            }
        }
        if (n <= 0) {
            free(buf);
            for (int i = 0; i < got_fds; i++)
                close(fds[i]);
            h->lost = true;
            return spc__fail(h, SPC_ERR_DAEMON_LOST, "spd closed the connection%s%s",
                             n < 0 ? ": " : "", n < 0 ? strerror(errno) : "");
        }
        len += (size_t)n;
    }
    if (nfds)
        *nfds = got_fds;
    *buf_p = buf;
    return SPC_OK;
}

static spc_status_t call_once(spc_handle_t *h, Spd__Msg *req, int timeout_ms, Spd__Msg **rep_p, int *fds,
                              int *nfds)
{
    uint8_t *out, *in = NULL;
    size_t outlen;
    sp_frame_t f;

    if (h->lost)
        return spc__fail(h, SPC_ERR_DAEMON_LOST, "connection to spd was lost earlier");
    req->seq = ++h->seq;
    if (sp_msg_encode(req, &out, &outlen) != 0)
        return spc__fail(h, SPC_ERR_NO_MEMORY, "cannot encode the request");
    spc_status_t st = send_all(h, out, outlen);
    free(out);
    /* A refused peer may find the socket closed before its hello went out; the
     * daemon's answer may still be waiting to be read. */
    if (st != SPC_OK && !(st == SPC_ERR_DAEMON_LOST && (h->seq == 1 || h->resuming)))
        return st;

    uint64_t deadline = spc__now_ns() + (uint64_t)(timeout_ms > 0 ? timeout_ms : h->timeout_ms) * 1000000ull;
    for (;;) {
        spc_status_t rst = recv_frame(h, deadline, &in, &f, fds, nfds);
        if (rst != SPC_OK)
            return st != SPC_OK ? st : rst;
        Spd__Msg *rep = sp_msg_decode(&f);
        free(in);
        if (rep == NULL)
            return spc__fail(h, SPC_ERR_PROTOCOL, "undecodable reply from spd");
        /* seq 0 is a daemon-initiated error (a protocol violation it saw). */
        if (rep->seq != req->seq && rep->seq != 0) {
            sp_msg_free(rep);
            continue;   /* a late reply to an earlier call that timed out */
        }
        if (rep->body_case == SPD__MSG__BODY_ERROR) {
            spc_status_t est = (spc_status_t)rep->error->status;
            if (est >= 0)
                est = SPC_ERR_PROTOCOL;
            spc__fail(h, est, "%s", rep->error->detail);
            sp_msg_free(rep);
            return est;
        }
        *rep_p = rep;
        return SPC_OK;
    }
}

/* One call, and once more after the client went over to the next spd, where
 * its spd went during the call: the new spd holds what the client brought it,
 * nothing of what the old one may have done with the request, so the request
 * goes again. A hello (no segment yet) and a resume's own calls are not repeated. */
spc_status_t spc__call_fds(spc_handle_t *h, Spd__Msg *req, int timeout_ms, Spd__Msg **rep_p, int *fds, int *nfds)
{
    bool had_spd = !h->lost;
    spc_status_t st = call_once(h, req, timeout_ms, rep_p, fds, nfds);
    if (st != SPC_ERR_DAEMON_LOST || !had_spd || h->resuming || h->seg == NULL)
        return st;
    char why[256];
    snprintf(why, sizeof why, "%s", h->last_error);
    if (!spc__conn_lost(h, why))
        return SPC_ERR_DAEMON_LOST;
    return call_once(h, req, timeout_ms, rep_p, fds, nfds);
}

spc_status_t spc__call(spc_handle_t *h, Spd__Msg *req, int timeout_ms, Spd__Msg **rep_p)
{
    return spc__call_fds(h, req, timeout_ms, rep_p, NULL, NULL);
}

/* Checks that the reply is of the expected kind. */
static spc_status_t expect(spc_handle_t *h, Spd__Msg *rep, Spd__Msg__BodyCase want)
{
    if (rep->body_case == want)
        return SPC_OK;
    spc__fail(h, SPC_ERR_PROTOCOL, "spd answered '%s' to this request", sp_msg_body_name(rep));
    sp_msg_free(rep);
    return SPC_ERR_PROTOCOL;
}

/* ================================================================ attach */

static const char *program_name(void)
{
    extern char *program_invocation_short_name;
    return program_invocation_short_name;
}

static uint64_t env_u64(const char *name, uint64_t dflt)
{
    const char *v = getenv(name);
    if (v == NULL || *v == '\0')
        return dflt;
    char *end;
    unsigned long long x = strtoull(v, &end, 10);
    switch (*end) {
    case 'K': case 'k': x <<= 10; break;
    case 'M': case 'm': x <<= 20; break;
    case 'G': case 'g': x <<= 30; break;
    default: break;
    }
    return x;
}

static void resolve_socket(const char *path, char *buf, size_t len)
{
    const char *env = getenv("SPC_SOCKET");
    if (path != NULL && *path != '\0')
        snprintf(buf, len, "%s", path);
    else if (env != NULL && *env != '\0')
        snprintf(buf, len, "%s", env);
    else
        sp_default_socket_path(buf, len);
}

const char *spc_socket_path(const spc_handle_t *h)
{
    static __thread char buf[108];
    if (h != NULL)
        return h->socket_path;
    resolve_socket(NULL, buf, sizeof buf);
    return buf;
}

const char *spc_daemon_version(const spc_handle_t *h)
{
    return h->daemon_version;
}

int spc_daemon_pid(const spc_handle_t *h)
{
    return h->daemon_pid;
}

/* Maps the segment and checks its header against the layout both sides
 * compute. The header names its layout, any this library knows: spd picks it
 * for the protocol the hello chose, and an spd from before protocol 2 gave
 * layout 4 or 5 under protocol 1 (proto/sp_msg.h). */
static spc_status_t map_segment(spc_handle_t *h, int seg_fd, uint64_t seg_bytes)
{
    struct stat st;
    if (fstat(seg_fd, &st) != 0 || (uint64_t)st.st_size != seg_bytes)
        return spc__fail(NULL, SPC_ERR_PROTOCOL, "segment is %lld bytes, welcome said %llu",
                         (long long)st.st_size, (unsigned long long)seg_bytes);
    void *seg = mmap(NULL, seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, seg_fd, 0);
    if (seg == MAP_FAILED)
        return spc__fail(NULL, SPC_ERR_NO_MEMORY, "mapping the %llu-byte segment: %s",
                         (unsigned long long)seg_bytes, strerror(errno));
    struct sp_seg_hdr hdr, want;
    memcpy(&hdr, seg, sizeof hdr);
    if (hdr.magic != SP_SEG_MAGIC || hdr.version < SP_SEG_VERSION_MIN || hdr.version > SP_SEG_VERSION ||
        hdr.sq_entries < SP_SQ_MIN_ENTRIES || hdr.sq_entries > SP_SQ_MAX_ENTRIES ||
        (hdr.sq_entries & (hdr.sq_entries - 1)) != 0) {
        munmap(seg, seg_bytes);
        return spc__fail(NULL, SPC_ERR_PROTOCOL, "segment header not understood (layout %u; this library knows %u "
                         "to %u)", hdr.version, SP_SEG_VERSION_MIN, SP_SEG_VERSION);
    }
    sp_seg_layout(&want, hdr.version, hdr.sq_entries, hdr.arena_bytes);
    want.client_id = hdr.client_id;
    if (memcmp(&want, &hdr, sizeof hdr) != 0 || want.segment_bytes != seg_bytes) {
        munmap(seg, seg_bytes);
        return spc__fail(NULL, SPC_ERR_PROTOCOL, "segment layout differs from this library's");
    }
    h->seg = seg;
    h->layout = hdr;
    sp_seg_view_init(&h->v, seg, &hdr);
    h->sq_mask = hdr.sq_entries - 1;
    h->cq_mask = hdr.cq_entries - 1;
    return SPC_OK;
}

static spc_status_t init_requests(spc_handle_t *h)
{
    uint32_t n = h->layout.cq_entries;
    h->reqs = calloc(n, sizeof *h->reqs);
    if (h->reqs == NULL)
        return spc__fail(NULL, SPC_ERR_NO_MEMORY, "out of memory for %u requests", n);
    for (uint32_t i = 0; i < n; i++) {
        h->reqs[i].h = h;
        h->reqs[i].index = i;
        h->reqs[i].next_free = i + 1 < n ? i + 1 : UINT32_MAX;
    }
    h->free_head = 0;
    return SPC_OK;
}

static void handle_free(spc_handle_t *h)
{
    spc__streams_detach(h);   /* before the segment goes: CUDA streams may wait on it */
    if (h->sock >= 0)
        close(h->sock);
    if (h->seg_fd >= 0)
        close(h->seg_fd);
    if (h->seg != NULL)
        munmap(h->seg, h->layout.segment_bytes);
    if (h->wake_fd >= 0)
        close(h->wake_fd);
    spc__arena_cleanup(&h->arena);
    free(h->regions);
    spc__devcache_free(h->devcache);
    for (uint32_t i = 0; i < h->ngroups; i++)
        free(h->groups[i].ranks);
    free(h->groups);
    free(h->reqs);
    pthread_mutex_destroy(&h->lock);
    free(h);
}

spc_status_t spc_attach(const spc_attach_params_t *params, spc_handle_t **h_p)
{
    spc_attach_params_t p = { 0 };
    spc_status_t st;

    attach_error[0] = '\0';
    if (h_p == NULL)
        return spc__fail(NULL, SPC_ERR_INVALID_ARG, "h_p is NULL");
    if (params != NULL && (st = spc__struct_read(NULL, spc_attach_params_t, params, struct_size, &p)) != SPC_OK)
        return st;

    spc_handle_t *h = calloc(1, sizeof *h);
    if (h == NULL)
        return spc__fail(NULL, SPC_ERR_NO_MEMORY, "out of memory");
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_settype(&ma, PTHREAD_MUTEX_RECURSIVE);
    pthread_mutex_init(&h->lock, &ma);
    pthread_mutexattr_destroy(&ma);
    h->sock = -1;
    h->wake_fd = -1;
    h->seg_fd = -1;
    h->timeout_ms = p.timeout_ms > 0 ? p.timeout_ms : SPC_DEFAULT_TIMEOUT_MS;
    h->reconnect_ms = p.reconnect_ms < 0 ? 0 : p.reconnect_ms > 0 ? p.reconnect_ms
                    : (int)env_u64("SPC_RECONNECT_MS", SPC_DEFAULT_RECONNECT_MS);
    h->control_only = (p.flags & SPC_ATTACH_CONTROL_ONLY) != 0;
    h->spin_us = (int)env_u64("SPC_SPIN_US", SPC_DEFAULT_SPIN_US);
    resolve_socket(p.socket_path, h->socket_path, sizeof h->socket_path);

    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    if (strlen(h->socket_path) >= sizeof sa.sun_path) {
        st = spc__fail(NULL, SPC_ERR_INVALID_ARG, "socket path too long: %s", h->socket_path);
        goto fail;
    }
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", h->socket_path);
    h->sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (h->sock < 0 || connect(h->sock, (struct sockaddr *)&sa, sizeof sa) != 0) {
        st = spc__fail(NULL, SPC_ERR_CONNECT, "cannot connect to spd at %s: %s (is spd running? set SPC_SOCKET)",
                       h->socket_path, strerror(errno));
        goto fail;
    }

    Spd__Msg req = SPD__MSG__INIT, *rep = NULL;
    Spd__Hello hello = SPD__HELLO__INIT;
    /* Every protocol this library speaks, the lowest where a daemon from
     * before ranges looks (spd.proto, Hello); SPC_PROTOCOL_MAX narrows it. */
    uint32_t offer = (uint32_t)env_u64("SPC_PROTOCOL_MAX", SP_PROTOCOL_VERSION);
    if (offer < SP_PROTOCOL_MIN || offer > SP_PROTOCOL_VERSION)
        offer = SP_PROTOCOL_VERSION;
    hello.protocol = SP_PROTOCOL_MIN;
    hello.protocol_max = offer;
    hello.role = h->control_only ? SPD__HELLO__ROLE__CONTROL : SPD__HELLO__ROLE__CLIENT;
    hello.name = (char *)(p.name ? p.name : program_name());
    hello.sq_entries = p.sq_entries ? p.sq_entries : (uint32_t)env_u64("SPC_SQ_ENTRIES", 0);
    hello.arena_bytes = p.arena_bytes ? p.arena_bytes : env_u64("SPC_ARENA_BYTES", 0);
    req.body_case = SPD__MSG__BODY_HELLO;
    req.hello = &hello;

    int fds[2] = { -1, -1 }, nfds = 2;
    st = spc__call_fds(h, &req, 0, &rep, fds, &nfds);
    if (st != SPC_OK) {
        spc__fail(NULL, st, "%s", h->last_error);
        goto fail;
    }
    if (rep->body_case != SPD__MSG__BODY_WELCOME) {
        st = spc__fail(NULL, SPC_ERR_PROTOCOL, "spd answered '%s' to hello", sp_msg_body_name(rep));
        sp_msg_free(rep);
        goto fail_fds;
    }
    Spd__Welcome *w = rep->welcome;
    if (w->protocol < SP_PROTOCOL_MIN || w->protocol > offer) {
        st = spc__fail(NULL, SPC_ERR_PROTOCOL, "spd %s chose protocol %u; this library offered %u to %u", w->version,
                       w->protocol, SP_PROTOCOL_MIN, offer);
        sp_msg_free(rep);
        goto fail_fds;
    }
    h->protocol = w->protocol;
    h->client_id = w->client_id;
    h->daemon_pid = w->daemon_pid;
    snprintf(h->daemon_version, sizeof h->daemon_version, "%s", w->version);
    uint64_t seg_bytes = w->segment_bytes;
    sp_msg_free(rep);

    if (!h->control_only) {
        if (nfds != 2) {
            st = spc__fail(NULL, SPC_ERR_PROTOCOL, "welcome carried %d descriptors, expected 2", nfds);
            goto fail_fds;
        }
        st = map_segment(h, fds[0], seg_bytes);
        if (st != SPC_OK)
            goto fail_fds;
        /* The mapping keeps the memory; the descriptor is what the next spd
         * takes, should this one go (resume.c). */
        h->seg_fd = fds[0];
        h->wake_fd = fds[1];
        if ((st = init_requests(h)) != SPC_OK)
            goto fail;
        if (spc__arena_init(&h->arena, h->layout.arena_bytes) != 0) {
            st = spc__fail(NULL, SPC_ERR_NO_MEMORY, "out of memory");
            goto fail;
        }
    }
    spc__log(2, "attached to spd %s (pid %d) at %s as client %llu", h->daemon_version, h->daemon_pid,
             h->socket_path, (unsigned long long)h->client_id);
    *h_p = h;
    return SPC_OK;

fail_fds:
    for (int i = 0; i < nfds && i < 2; i++)
        if (fds[i] >= 0)
            close(fds[i]);
fail:
    handle_free(h);
    return st;
}

void spc_detach(spc_handle_t *h)
{
    if (h == NULL)
        return;
    /* A handle that goes has nothing for the next spd to take over. */
    spc__lock(h);
    h->reconnect_ms = 0;
    if (!h->lost && h->sock >= 0) {
        Spd__Msg req = SPD__MSG__INIT, *rep = NULL;
        Spd__Bye bye = SPD__BYE__INIT;
        req.body_case = SPD__MSG__BODY_BYE;
        req.bye = &bye;
        /* Best effort with a short wait: the daemon also notices the close. */
        if (spc__call(h, &req, 2000, &rep) == SPC_OK)
            sp_msg_free(rep);
    }
    spc__unlock(h);
    handle_free(h);   /* unlocked: it stops the stream watcher, which may wait for the lock */
}

/* ================================================================ memory */

void *spc_alloc(spc_handle_t *h, size_t bytes)
{
    if (h == NULL || h->seg == NULL) {
        if (h)
            spc__fail(h, SPC_ERR_INVALID_ARG, "control-only handles have no arena");
        return NULL;
    }
    uint64_t align = bytes >= 65536 ? 4096 : 64;
    uint64_t off = spc__arena_alloc(&h->arena, bytes, align);
    if (off == UINT64_MAX) {
        spc__fail(h, SPC_ERR_NO_MEMORY, "arena full: %zu bytes asked, %llu of %llu in use (raise SPC_ARENA_BYTES)",
                  bytes, (unsigned long long)h->arena.used, (unsigned long long)h->arena.size);
        return NULL;
    }
    return h->v.arena + off;
}

void spc_free(spc_handle_t *h, void *ptr)
{
    if (h == NULL || ptr == NULL || h->seg == NULL)
        return;
    uint8_t *p = ptr;
    if (p < h->v.arena || p >= h->v.arena + h->layout.arena_bytes ||
        spc__arena_free(&h->arena, (uint64_t)(p - h->v.arena)) != 0)
        spc__fail(h, SPC_ERR_INVALID_ARG, "spc_free(%p): not an arena allocation", ptr);
}

void spc_arena_usage(const spc_handle_t *h, uint64_t *size_p, uint64_t *used_p)
{
    if (size_p)
        *size_p = h->arena.size;
    if (used_p)
        *used_p = h->arena.used;
}

/* Records a region the daemon granted, so ops can name pointers inside it. */
static spc_status_t region_remember(spc_handle_t *h, spc_region_t id, uintptr_t addr, uint64_t length, bool device,
                                    spc_region_t *region_p)
{
    /* The daemon refuses overlapping registrations, so one it granted over an
     * older region means it dropped that one (a GPU allocation freed and made
     * again at the same address): forget it here too. */
    for (uint32_t i = h->nregions; i-- > 0;) {
        if (addr < h->regions[i].addr + h->regions[i].length && h->regions[i].addr < addr + length) {
            spc__devcache_forget(h, h->regions[i].id);
            h->regions[i] = h->regions[--h->nregions];
        }
    }
    if (h->nregions == h->regions_cap) {
        uint32_t cap = h->regions_cap ? h->regions_cap * 2 : 8;
        spc__region_t *p = realloc(h->regions, cap * sizeof *p);
        if (p == NULL)
            return spc__fail(h, SPC_ERR_NO_MEMORY, "out of memory");   /* the daemon frees it on detach */
        h->regions = p;
        h->regions_cap = cap;
    }
    h->regions[h->nregions++] = (spc__region_t){ .id = id, .addr = addr, .length = length, .device = device };
    *region_p = id;
    return SPC_OK;
}

/* Where Yama restricts ptrace (scope 1), the daemon's cross-memory attach to
 * registered host memory, and its pidfd_getfd of cuMem descriptors, need our
 * consent. */
static void allow_daemon_ptrace(spc_handle_t *h)
{
    if (!h->ptracer_set) {
        prctl(PR_SET_PTRACER, (unsigned long)h->daemon_pid, 0, 0, 0);
        h->ptracer_set = true;
    }
}

/* The public calls that talk to spd hold the handle's lock throughout
 * (internal.h), so that a take-over by the stream watcher never falls between
 * spd's answer and what the handle records of it. */
static spc_status_t register_locked(spc_handle_t *h, void *addr, size_t length, spc_region_t *region_p)
{
    if (h == NULL || addr == NULL || length == 0 || region_p == NULL)
        return h ? spc__fail(h, SPC_ERR_INVALID_ARG, "register needs an address, a length and region_p")
                 : SPC_ERR_INVALID_ARG;
    if (h->control_only)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "control-only handles cannot register memory");
    uintptr_t a = (uintptr_t)addr;
    uintptr_t arena = (uintptr_t)h->v.arena;
    if (a < arena + h->layout.arena_bytes && arena < a + length)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "the range overlaps the arena, which needs no registration");

    allow_daemon_ptrace(h);
    Spd__Msg req = SPD__MSG__INIT, *rep = NULL;
    Spd__RegisterReq r = SPD__REGISTER_REQ__INIT;
    r.addr = a;
    r.length = length;
    req.body_case = SPD__MSG__BODY_REGISTER_REQ;
    req.register_req = &r;
    spc_status_t st = spc__call(h, &req, 0, &rep);
    if (st != SPC_OK || (st = expect(h, rep, SPD__MSG__BODY_REGISTER_REP)) != SPC_OK)
        return st;
    spc_region_t id = rep->register_rep->region;
    sp_msg_free(rep);
    return region_remember(h, id, a, length, false, region_p);
}

spc_status_t spc_register(spc_handle_t *h, void *addr, size_t length, spc_region_t *region_p)
{
    if (h == NULL)
        return SPC_ERR_INVALID_ARG;
    spc__lock(h);
    spc_status_t st = register_locked(h, addr, length, region_p);
    spc__unlock(h);
    return st;
}

spc_status_t spc__register_device_as(spc_handle_t *h, const void *dptr, size_t bytes, spc_region_t want,
                                     spc_region_t *region_p)
{
    spc__device_export_t x;

    spc_status_t st = spc__cuda_export(h, dptr, bytes, &x);
    if (st != SPC_OK)
        return st;

    Spd__Msg req = SPD__MSG__INIT, *rep = NULL;
    Spd__RegisterDeviceReq r = SPD__REGISTER_DEVICE_REQ__INIT;
    Spd__DeviceChunk *chunks = NULL, **chunk_ptrs = NULL;
    if (x.nchunks > 0) {
        /* cuMem memory: spd takes the chunks' descriptors out of this process. */
        allow_daemon_ptrace(h);
        chunks = calloc(x.nchunks, sizeof *chunks);
        chunk_ptrs = calloc(x.nchunks, sizeof *chunk_ptrs);
        if (chunks == NULL || chunk_ptrs == NULL) {
            free(chunks);
            free(chunk_ptrs);
            spc__cuda_export_release(&x);
            return spc__fail(h, SPC_ERR_NO_MEMORY, "out of memory");
        }
        for (uint32_t i = 0; i < x.nchunks; i++) {
            spd__device_chunk__init(&chunks[i]);
            chunks[i].offset = x.chunks[i].offset;
            chunks[i].size = x.chunks[i].size;
            chunks[i].buffer_id = x.chunks[i].buffer_id;
            chunks[i].block_id = x.chunks[i].block_id;
            chunks[i].fd = x.chunks[i].fd;
            chunk_ptrs[i] = &chunks[i];
        }
        r.n_chunks = x.nchunks;
        r.chunks = chunk_ptrs;
    } else {
        r.ipc_handle.data = x.ipc_handle;
        r.ipc_handle.len = sizeof x.ipc_handle;
        r.buffer_id = x.buffer_id;
    }
    r.alloc_base = x.base;
    r.alloc_size = x.size;
    r.pci_bus_id = x.pci_bus_id;
    r.uuid.data = x.uuid;
    r.uuid.len = sizeof x.uuid;
    r.device = x.device;
    r.offset = (uintptr_t)dptr - x.base;
    r.length = bytes;
    r.region = want;
    req.body_case = SPD__MSG__BODY_REGISTER_DEVICE_REQ;
    req.register_device_req = &r;
    st = spc__call(h, &req, 0, &rep);
    /* spd has taken its own copies of the descriptors by the time it answers,
     * or will never take them: ours close now, whatever the answer. */
    free(chunks);
    free(chunk_ptrs);
    spc__cuda_export_release(&x);
    if (st != SPC_OK || (st = expect(h, rep, SPD__MSG__BODY_REGISTER_REP)) != SPC_OK)
        return st;
    *region_p = rep->register_rep->region;
    sp_msg_free(rep);
    return SPC_OK;
}

static spc_status_t register_device_locked(spc_handle_t *h, const void *dptr, size_t bytes, spc_region_t *region_p)
{
    spc_region_t id;

    if (h == NULL || dptr == NULL || bytes == 0 || region_p == NULL)
        return h ? spc__fail(h, SPC_ERR_INVALID_ARG, "register_device needs a device pointer, a length and region_p")
                 : SPC_ERR_INVALID_ARG;
    if (h->control_only)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "control-only handles cannot register memory");
    spc_status_t st = spc__register_device_as(h, dptr, bytes, 0, &id);
    if (st != SPC_OK)
        return st;
    /* Device and host addresses share one address space (unified addressing),
     * so ops find a device pointer's region as they find a host one's. */
    return region_remember(h, id, (uintptr_t)dptr, bytes, true, region_p);
}

spc_status_t spc_register_device(spc_handle_t *h, const void *dptr, size_t bytes, spc_region_t *region_p)
{
    if (h == NULL)
        return SPC_ERR_INVALID_ARG;
    spc__lock(h);
    spc_status_t st = register_device_locked(h, dptr, bytes, region_p);
    spc__unlock(h);
    return st;
}

/* Asks for a stream slot, or one back (r->resume); r is the request, its GPU filled in. */
static spc_status_t stream_slot_call(spc_handle_t *h, Spd__StreamCreateReq *r, uint32_t *slot_p)
{
    Spd__Msg req = SPD__MSG__INIT, *rep = NULL;
    req.body_case = SPD__MSG__BODY_STREAM_CREATE_REQ;
    req.stream_create_req = r;
    spc_status_t st = spc__call(h, &req, 0, &rep);
    if (st != SPC_OK || (st = expect(h, rep, SPD__MSG__BODY_STREAM_CREATE_REP)) != SPC_OK)
        return st;
    uint32_t slot = rep->stream_create_rep->slot;
    bool resumed = rep->stream_create_rep->resumed;
    sp_msg_free(rep);
    if (slot >= SPC_STREAMS_MAX)
        return spc__fail(h, SPC_ERR_PROTOCOL, "spd gave stream slot %u; there are %d", slot, SPC_STREAMS_MAX);
    if (r->resume && (!resumed || slot != r->slot))
        return spc__fail(h, SPC_ERR_PROTOCOL, "spd %s did not give stream slot %u back (an spd from before streams "
                         "were taken over?)", h->daemon_version, r->slot);
    *slot_p = slot;
    return SPC_OK;
}

spc_status_t spc__stream_open_call(spc_handle_t *h, const spc__cuda_stream_info_t *info, uint32_t *slot_p)
{
    Spd__StreamCreateReq r = SPD__STREAM_CREATE_REQ__INIT;
    r.pci_bus_id = (char *)info->pci_bus_id;
    r.uuid.data = (uint8_t *)info->uuid;
    r.uuid.len = sizeof info->uuid;
    r.device = info->device;
    return stream_slot_call(h, &r, slot_p);
}

spc_status_t spc__stream_resume_call(spc_handle_t *h, const spc_stream_t *s, uint64_t ready, uint64_t done,
                                     uint64_t *settled, size_t nsettled)
{
    /* Its GPU as it was made: the thread here (the stream watcher, often) may
     * have no CUDA context current to ask the driver with. */
    Spd__StreamCreateReq r = SPD__STREAM_CREATE_REQ__INIT;
    r.pci_bus_id = (char *)s->pci_bus_id;
    r.uuid.data = (uint8_t *)s->uuid;
    r.uuid.len = sizeof s->uuid;
    r.device = s->device;
    r.resume = true;
    r.slot = s->slot;
    r.ready = ready;
    r.done = done;
    r.settled = settled;
    r.n_settled = nsettled;
    uint32_t slot;
    return stream_slot_call(h, &r, &slot);
}

spc_status_t spc__stream_close_call(spc_handle_t *h, uint32_t slot)
{
    Spd__Msg req = SPD__MSG__INIT, *rep = NULL;
    Spd__StreamDestroyReq r = SPD__STREAM_DESTROY_REQ__INIT;
    r.slot = slot;
    req.body_case = SPD__MSG__BODY_STREAM_DESTROY_REQ;
    req.stream_destroy_req = &r;
    spc_status_t st = spc__call(h, &req, 0, &rep);
    if (st == SPC_OK)
        sp_msg_free(rep);
    return st;
}

static spc_status_t deregister_locked(spc_handle_t *h, spc_region_t region)
{
    Spd__Msg req = SPD__MSG__INIT, *rep = NULL;
    Spd__DeregisterReq r = SPD__DEREGISTER_REQ__INIT;
    r.region = region;
    req.body_case = SPD__MSG__BODY_DEREGISTER_REQ;
    req.deregister_req = &r;
    spc_status_t st = spc__call(h, &req, 0, &rep);
    if (st != SPC_OK)
        return st;
    sp_msg_free(rep);
    for (uint32_t i = 0; i < h->nregions; i++) {
        if (h->regions[i].id == region) {
            h->regions[i] = h->regions[--h->nregions];
            break;
        }
    }
    spc__devcache_forget(h, region);
    return SPC_OK;
}

spc_status_t spc_deregister(spc_handle_t *h, spc_region_t region)
{
    if (h == NULL)
        return SPC_ERR_INVALID_ARG;
    spc__lock(h);
    spc_status_t st = deregister_locked(h, region);
    spc__unlock(h);
    return st;
}

/* ================================================================ jobs */

_Static_assert(SPC_JOB_MAX_ALLOW_UIDS == SP_JOB_MAX_ALLOW_UIDS, "the public limit is the protocol's");

spc_status_t spc_job_create(spc_handle_t *h, char *id_buf, size_t id_buf_len)
{
    return spc_job_create_with(h, NULL, id_buf, id_buf_len);
}

static spc_status_t job_create_locked(spc_handle_t *h, const spc_job_params_t *params, char *id_buf, size_t id_buf_len)
{
    spc_job_params_t p = { 0 };
    spc_status_t st;
    if (params != NULL && (st = spc__struct_read(h, spc_job_params_t, params, struct_size, &p)) != SPC_OK)
        return st;
    if (p.nallow_uids > SPC_JOB_MAX_ALLOW_UIDS)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "%u uids allowed to join; a job admits at most %d besides its owner",
                         p.nallow_uids, SPC_JOB_MAX_ALLOW_UIDS);
    if (p.nallow_uids > 0 && p.allow_uids == NULL)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "allow_uids is NULL but nallow_uids is %u", p.nallow_uids);
    Spd__Msg req = SPD__MSG__INIT, *rep = NULL;
    Spd__JobCreateReq r = SPD__JOB_CREATE_REQ__INIT;
    r.n_allow_uids = p.nallow_uids;
    r.allow_uids = (uint32_t *)p.allow_uids;
    req.body_case = SPD__MSG__BODY_JOB_CREATE_REQ;
    req.job_create_req = &r;
    st = spc__call(h, &req, 0, &rep);
    if (st != SPC_OK || (st = expect(h, rep, SPD__MSG__BODY_JOB_CREATE_REP)) != SPC_OK)
        return st;
    size_t need = strlen(rep->job_create_rep->job_id) + 1;
    if (id_buf == NULL || id_buf_len < need) {
        sp_msg_free(rep);
        return spc__fail(h, SPC_ERR_INVALID_ARG, "job id needs %zu bytes", need);
    }
    memcpy(id_buf, rep->job_create_rep->job_id, need);
    sp_msg_free(rep);
    return SPC_OK;
}

spc_status_t spc_job_create_with(spc_handle_t *h, const spc_job_params_t *params, char *id_buf, size_t id_buf_len)
{
    if (h == NULL)
        return SPC_ERR_INVALID_ARG;
    spc__lock(h);
    spc_status_t st = job_create_locked(h, params, id_buf, id_buf_len);
    spc__unlock(h);
    return st;
}

/* Sends the join r (its job named by id or by name) and waits for the world. */
static spc_status_t job_join_call(spc_handle_t *h, Spd__JobJoinReq *r, int timeout_ms, spc_group_t *world_p)
{
    if (timeout_ms <= 0)
        timeout_ms = h->timeout_ms;
    Spd__Msg req = SPD__MSG__INIT, *rep = NULL;
    r->timeout_ms = (uint32_t)timeout_ms;
    /* The rank's GPU, for the placement of meshes (spd.proto, JobJoinReq). */
    char bus[32];
    if (spc__cuda_current_bus_id(bus, sizeof bus))
        r->pci_bus_id = bus;
    req.body_case = SPD__MSG__BODY_JOB_JOIN_REQ;
    req.job_join_req = r;
    /* The daemon answers at its deadline; give the reply a little time to travel. */
    spc__lock(h);
    spc_status_t st = spc__call(h, &req, timeout_ms + 2000, &rep);
    if (st != SPC_OK || (st = expect(h, rep, SPD__MSG__BODY_JOB_JOIN_REP)) != SPC_OK) {
        spc__unlock(h);
        return st;
    }
    const Spd__JobJoinRep *j = rep->job_join_rep;
    *world_p = j->world_group;
    spc__group_learn(h, j->world_group, j->world_size, true);
    h->rank = r->rank;
    h->ticket_len = j->resume_ticket.len <= sizeof h->ticket ? j->resume_ticket.len : 0;
    if (h->ticket_len > 0)
        memcpy(h->ticket, j->resume_ticket.data, h->ticket_len);
    spc__unlock(h);
    sp_msg_free(rep);
    return SPC_OK;
}

spc_status_t spc_job_join(spc_handle_t *h, const char *job_id, uint32_t world_size, uint32_t rank,
                          int timeout_ms, spc_group_t *world_p)
{
    if (job_id == NULL || world_p == NULL)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "job_id and world_p are required");
    Spd__JobJoinReq r = SPD__JOB_JOIN_REQ__INIT;
    r.job_id = (char *)job_id;
    r.world_size = world_size;
    r.rank = rank;
    return job_join_call(h, &r, timeout_ms, world_p);
}

_Static_assert(SPC_JOB_NAME_MAX == SP_JOB_NAME_MAX && SPC_JOB_LAUNCH_MAX == SP_JOB_LAUNCH_MAX,
               "the public bounds are the protocol's");

spc_status_t spc_job_join_named(spc_handle_t *h, const char *name, const char *launch, uint32_t world_size,
                                uint32_t rank, int timeout_ms, spc_group_t *world_p)
{
    const char *bad;
    if (name == NULL || world_p == NULL)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "name and world_p are required");
    if (launch == NULL)
        launch = "";
    /* spd checks the same; here the caller learns it without a round trip. */
    if ((bad = sp_job_name_problem(name)) != NULL)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "job name '%.*s' %s",
                         (int)sp_job_text_plain(name, SPC_JOB_NAME_MAX - 1, SP_JOB_NAME_CHARS), name, bad);
    if ((bad = sp_job_launch_problem(launch)) != NULL)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "launch id '%.*s' %s",
                         (int)sp_job_text_plain(launch, SPC_JOB_LAUNCH_MAX - 1, SP_JOB_LAUNCH_CHARS), launch, bad);
    Spd__JobJoinReq r = SPD__JOB_JOIN_REQ__INIT;
    r.name = (char *)name;
    r.launch = (char *)launch;
    r.world_size = world_size;
    r.rank = rank;
    return job_join_call(h, &r, timeout_ms, world_p);
}

/* ================================================================ meshes */

void spc__group_learn(spc_handle_t *h, spc_group_t id, uint32_t size, bool world)
{
    if (spc__group_size(h, id) != 0)
        return;
    if (h->ngroups == h->groups_cap) {
        uint32_t cap = h->groups_cap ? h->groups_cap * 2 : 8;
        spc__group_t *g = realloc(h->groups, cap * sizeof *g);
        if (g == NULL)
            return;   /* its ops go unchecked here, and a restart cannot take them over (resume.c) */
        h->groups = g;
        h->groups_cap = cap;
    }
    h->groups[h->ngroups++] = (spc__group_t){ .id = id, .wire = id, .size = size, .world = world };
}

/* What spd said of a mesh's group: kept to bring it back to the next spd
 * (resume.c). A group without it is not taken over. */
static void group_members(spc_handle_t *h, const Spd__GroupMembers *gm)
{
    spc__group_t *g = spc__group_find(h, gm->id);
    if (g == NULL || g->ranks != NULL || gm->n_ranks != g->size || gm->kind == NULL)
        return;
    if ((g->ranks = malloc(g->size * sizeof *g->ranks)) == NULL)
        return;
    memcpy(g->ranks, gm->ranks, g->size * sizeof *g->ranks);
    g->index = gm->index;
    snprintf(g->kind, sizeof g->kind, "%s", gm->kind);
}

spc__group_t *spc__group_find(spc_handle_t *h, spc_group_t id)
{
    for (uint32_t i = 0; i < h->ngroups; i++)
        if (h->groups[i].id == id)
            return &h->groups[i];
    return NULL;
}

uint32_t spc__group_size(const spc_handle_t *h, spc_group_t id)
{
    const spc__group_t *g = spc__group_find((spc_handle_t *)h, id);
    return g != NULL ? g->size : 0;
}

static spc_status_t mesh_create_locked(spc_handle_t *h, const spc_mesh_spec_t *spec, spc_mesh_t *mesh_p)
{
    spc_mesh_spec_t s;
    spc_status_t st;
    if (h == NULL)
        return SPC_ERR_INVALID_ARG;
    if (mesh_p == NULL)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "mesh_p is required");
    if ((st = spc__struct_read(h, spc_mesh_spec_t, spec, heads, &s)) != SPC_OK)
        return st;
    Spd__Msg req = SPD__MSG__INIT, *rep = NULL;
    Spd__MeshCreateReq r = SPD__MESH_CREATE_REQ__INIT;
    r.sp = s.sp;
    r.ulysses = s.ulysses;
    r.ring = s.ring;
    r.heads = s.heads;
    r.kv_heads = s.kv_heads;
    req.body_case = SPD__MSG__BODY_MESH_CREATE_REQ;
    req.mesh_create_req = &r;
    st = spc__call(h, &req, 0, &rep);
    if (st != SPC_OK || (st = expect(h, rep, SPD__MSG__BODY_MESH_CREATE_REP)) != SPC_OK)
        return st;
    const Spd__MeshCreateRep *m = rep->mesh_create_rep;
    spc_mesh_t out = {
        .id = m->mesh_id, .dp = m->dp, .sp = m->sp, .ulysses = m->ulysses, .ring = m->ring,
        .dp_group = m->dp_group, .sp_group = m->sp_group, .ulysses_group = m->ulysses_group,
        .ring_group = m->ring_group, .dp_rank = m->dp_rank, .sp_rank = m->sp_rank,
        .ulysses_rank = m->ulysses_rank, .ring_rank = m->ring_rank,
    };
    snprintf(out.explain, sizeof out.explain, "%s", m->explain ? m->explain : "");
    spc__group_learn(h, out.dp_group, out.dp, false);
    spc__group_learn(h, out.sp_group, out.sp, false);
    spc__group_learn(h, out.ulysses_group, out.ulysses, false);
    spc__group_learn(h, out.ring_group, out.ring, false);
    for (size_t k = 0; k < m->n_groups; k++)
        group_members(h, m->groups[k]);
    sp_msg_free(rep);
    *mesh_p = out;
    return SPC_OK;
}

spc_status_t spc_mesh_create(spc_handle_t *h, const spc_mesh_spec_t *spec, spc_mesh_t *mesh_p)
{
    if (h == NULL)
        return SPC_ERR_INVALID_ARG;
    spc__lock(h);
    spc_status_t st = mesh_create_locked(h, spec, mesh_p);
    spc__unlock(h);
    return st;
}

/* ================================================================ queries */

struct spc_query_result {
    Spd__Msg *msg;
};

static spc_status_t query_locked(spc_handle_t *h, const char *topic, const char *arg, spc_query_result_t **result_p)
{
    if (topic == NULL || result_p == NULL)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "topic and result_p are required");
    Spd__Msg req = SPD__MSG__INIT, *rep = NULL;
    Spd__QueryReq q = SPD__QUERY_REQ__INIT;
    q.topic = (char *)topic;
    q.arg = (char *)(arg ? arg : "");
    req.body_case = SPD__MSG__BODY_QUERY_REQ;
    req.query_req = &q;
    spc_status_t st = spc__call(h, &req, 0, &rep);
    if (st != SPC_OK || (st = expect(h, rep, SPD__MSG__BODY_QUERY_REP)) != SPC_OK)
        return st;
    spc_query_result_t *r = malloc(sizeof *r);
    if (r == NULL) {
        sp_msg_free(rep);
        return spc__fail(h, SPC_ERR_NO_MEMORY, "out of memory");
    }
    r->msg = rep;
    *result_p = r;
    return SPC_OK;
}

spc_status_t spc_query(spc_handle_t *h, const char *topic, const char *arg, spc_query_result_t **result_p)
{
    if (h == NULL)
        return SPC_ERR_INVALID_ARG;
    spc__lock(h);
    spc_status_t st = query_locked(h, topic, arg, result_p);
    spc__unlock(h);
    return st;
}

static const Spd__Field *field(const spc_query_result_t *r, size_t record, size_t f)
{
    return r->msg->query_rep->records[record]->fields[f];
}

size_t spc_query_records(const spc_query_result_t *r)
{
    return r->msg->query_rep->n_records;
}

size_t spc_query_fields(const spc_query_result_t *r, size_t record)
{
    return r->msg->query_rep->records[record]->n_fields;
}

const char *spc_query_key(const spc_query_result_t *r, size_t record, size_t f)
{
    return field(r, record, f)->key;
}

spc_value_kind_t spc_query_kind(const spc_query_result_t *r, size_t record, size_t f)
{
    switch (field(r, record, f)->value_case) {
    case SPD__FIELD__VALUE_I: return SPC_VALUE_INT;
    case SPD__FIELD__VALUE_D: return SPC_VALUE_DOUBLE;
    default: return SPC_VALUE_STRING;
    }
}

const char *spc_query_str(const spc_query_result_t *r, size_t record, size_t f)
{
    const Spd__Field *fl = field(r, record, f);
    return fl->value_case == SPD__FIELD__VALUE_S ? fl->s : "";
}

int64_t spc_query_int(const spc_query_result_t *r, size_t record, size_t f)
{
    const Spd__Field *fl = field(r, record, f);
    return fl->value_case == SPD__FIELD__VALUE_I ? fl->i : fl->value_case == SPD__FIELD__VALUE_D ? (int64_t)fl->d : 0;
}

double spc_query_double(const spc_query_result_t *r, size_t record, size_t f)
{
    const Spd__Field *fl = field(r, record, f);
    return fl->value_case == SPD__FIELD__VALUE_D ? fl->d : fl->value_case == SPD__FIELD__VALUE_I ? (double)fl->i : 0;
}

long spc_query_find(const spc_query_result_t *r, size_t record, const char *key)
{
    if (record >= spc_query_records(r))
        return -1;
    for (size_t i = 0; i < spc_query_fields(r, record); i++)
        if (strcmp(spc_query_key(r, record, i), key) == 0)
            return (long)i;
    return -1;
}

void spc_query_free(spc_query_result_t *r)
{
    if (r == NULL)
        return;
    sp_msg_free(r->msg);
    free(r);
}
