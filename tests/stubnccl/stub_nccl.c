/*
 * stub_nccl.c — a stand-in for libnccl.so.2, for tests on machines without a
 * GPU: the calls spd makes (cluster/nccl_work.c), with NCCL's names and ABI
 * (compiled against the real nccl.h), between processes over sockets, its
 * transfers stand-in kernels of the stand-in driver (tests/stubcuda). So two
 * spd_stub daemons run device ops across daemons end to end: ids over their
 * peer links, communicators, groups of sends and receives, aborts.
 *
 * What it models:
 *   - ncclGetUniqueId makes a rendezvous, as NCCL's bootstrap root: a thread
 *     listening on an abstract Unix socket whose name, with a random token,
 *     is the id. It waits for every rank of the communicator to say hello,
 *     hands each the others' addresses and ends.
 *   - ncclCommInitRankConfig: each rank listens on a socket of its own, says
 *     hello to the root, then connects to every lower rank and takes the
 *     connections of the higher ones: one socket per pair, carrying both
 *     directions. A non-blocking communicator (config blocking = 0) returns
 *     ncclInProgress and does this on a thread; ncclCommGetAsyncError says
 *     ncclInProgress until it is done, then ncclSuccess or the error.
 *   - ncclSend / ncclRecv between a pair are matched in the order each side
 *     issued them, as NCCL's are; a pair whose sizes disagree breaks the
 *     communicator (ncclInvalidUsage).
 *   - ncclGroupStart / ncclGroupEnd (per thread, nested): the operations of a
 *     group on one communicator and stream become one stand-in kernel
 *     (stub_launch) naming every buffer they touch, so a buffer the stream's
 *     device cannot reach is refused as on hardware (ncclUnhandledCudaError);
 *     the kernel moves them all at once, polling every socket, so a pair that
 *     both send and then receive large buffers does not deadlock. An operation
 *     outside a group is a group of its own.
 *   - Failures: a peer that closes its socket mid-transfer (its process died,
 *     or it aborted) makes the kernel end with ncclRemoteError recorded on the
 *     communicator, which ncclCommGetAsyncError returns from then on, and
 *     every later kernel of it ends at once. ncclCommAbort shuts the sockets
 *     down (its peers see that), stops an init in progress, and the kernels
 *     still queued end with the abort recorded; the memory goes with the last
 *     of them. ncclGetLastError says why, in words.
 *
 * What it does not: collectives (spd sends and receives only), more than one
 * communicator's operations in one kernel (each (communicator, stream) of a
 * group is a kernel of its own), NCCL's timeouts and environment variables,
 * ncclCommDestroy's wait for outstanding work (the queued kernels finish on
 * their own), devices: a communicator is not tied to one, only its streams are.
 */
#include <errno.h>
#include <nccl.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "stub_cuda.h"

#define ID_MAGIC    0x6e63636cu   /* "nccl" */
#define NAME_BYTES  100
#define TOKEN_BYTES 16
#define POLL_MS     50            /* between looks at the abort flag */

/* What a unique id holds: where the root listens, and the secret ranks show it. */
typedef struct id_body {
    uint32_t magic;
    uint8_t  token[TOKEN_BYTES];
    char     name[NAME_BYTES];    /* abstract socket name, NUL-terminated */
} id_body_t;
_Static_assert(sizeof(id_body_t) <= sizeof(ncclUniqueId), "an id fits ncclUniqueId");

/* A rank's hello to the root, and to each peer it connects to. */
typedef struct hello {
    uint32_t magic;
    uint8_t  token[TOKEN_BYTES];
    int32_t  nranks, rank;
    char     name[NAME_BYTES];    /* where the rank listens for its higher peers */
} hello_t;

/* ================================================================ errors */

static pthread_mutex_t last_lock = PTHREAD_MUTEX_INITIALIZER;
static char last_error[256];

typedef struct op op_t;

struct ncclComm {
    pthread_mutex_t lock;
    int             refs;             /* the caller's until destroy or abort, and each kernel's */
    int             nranks, rank;
    id_body_t       id;
    int             listen_fd;
    int            *fds;              /* [nranks]: the socket to each peer; -1 for self */
    bool            aborted;
    ncclResult_t    async;            /* ncclInProgress while init runs; then the first error */
    char            why[256];
    pthread_t       init_thread;
    bool            init_running;
};

/* Records r with its reason on c (the first error stays) and as the process's last. */
static ncclResult_t fail(ncclComm_t c, ncclResult_t r, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static ncclResult_t fail(ncclComm_t c, ncclResult_t r, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&last_lock);
    snprintf(last_error, sizeof last_error, "%s", msg);
    pthread_mutex_unlock(&last_lock);
    if (c != NULL) {
        pthread_mutex_lock(&c->lock);
        if (c->async == ncclSuccess || c->async == ncclInProgress) {
            c->async = r;
            snprintf(c->why, sizeof c->why, "%s", msg);
        }
        pthread_mutex_unlock(&c->lock);
    }
    return r;
}

const char *ncclGetErrorString(ncclResult_t r)
{
    switch (r) {
    case ncclSuccess:            return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError:        return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError:      return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument:    return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage:       return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError:        return "remote process exited or there was a network error";
    case ncclInProgress:         return "NCCL operation in progress";
    default:                     return "unknown result code";
    }
}

/* The communicator's reason when it has one, else the process's last (NCCL's
 * own ignores comm; spd asks right after a call failed, so either is it). */
const char *ncclGetLastError(ncclComm_t comm)
{
    if (comm != NULL && comm->why[0] != '\0')
        return comm->why;
    return last_error;
}

ncclResult_t ncclGetVersion(int *version)
{
    if (version == NULL)
        return ncclInvalidArgument;
    *version = NCCL_VERSION_CODE;   /* the nccl.h it was built against: its ABI */
    return ncclSuccess;
}

/* ================================================================ sockets */

static socklen_t abstract_addr(struct sockaddr_un *a, const char *name)
{
    memset(a, 0, sizeof *a);
    a->sun_family = AF_UNIX;
    size_t n = strnlen(name, sizeof a->sun_path - 2);
    memcpy(a->sun_path + 1, name, n);   /* sun_path[0] = 0: the abstract namespace */
    return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

/* A listening socket under a fresh random name (written into name). */
static int listen_new(const char *what, char *name)
{
    static unsigned counter;
    uint64_t r = 0;
    if (getrandom(&r, sizeof r, 0) != (ssize_t)sizeof r)
        return -1;
    snprintf(name, NAME_BYTES, "spd-stub-nccl/%s/%d/%u/%016llx", what, (int)getpid(),
             __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED), (unsigned long long)r);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un a;
    socklen_t len = abstract_addr(&a, name);
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, len) != 0 || listen(fd, 64) != 0) {
        if (fd >= 0)
            close(fd);
        return -1;
    }
    return fd;
}

static int dial(const char *name)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un a;
    socklen_t len = abstract_addr(&a, name);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, len) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

static bool aborted(ncclComm_t c)
{
    return c != NULL && __atomic_load_n(&c->aborted, __ATOMIC_ACQUIRE);
}

/* Waits until fd is ready for `events`, looking at c's abort flag between
 * polls (c NULL: the root, which waits as long as it takes). */
static bool wait_fd(ncclComm_t c, int fd, short events)
{
    struct pollfd p = { fd, events, 0 };
    for (;;) {
        if (aborted(c))
            return false;
        int n = poll(&p, 1, POLL_MS);
        if (n > 0)
            return true;
        if (n < 0 && errno != EINTR)
            return false;
    }
}

/* All n bytes, or false (closed, failed, aborted). */
static bool read_all(ncclComm_t c, int fd, void *buf, size_t n)
{
    for (size_t at = 0; at < n;) {
        if (!wait_fd(c, fd, POLLIN))
            return false;
        ssize_t k = recv(fd, (char *)buf + at, n - at, MSG_DONTWAIT);
        if (k == 0 || (k < 0 && errno != EAGAIN && errno != EINTR))
            return false;
        at += k > 0 ? (size_t)k : 0;
    }
    return true;
}

static bool write_all(ncclComm_t c, int fd, const void *buf, size_t n)
{
    for (size_t at = 0; at < n;) {
        if (!wait_fd(c, fd, POLLOUT))
            return false;
        ssize_t k = send(fd, (const char *)buf + at, n - at, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (k < 0 && errno != EAGAIN && errno != EINTR)
            return false;
        at += k > 0 ? (size_t)k : 0;
    }
    return true;
}

/* ================================================================ the root */

typedef struct root {
    int       fd;
    id_body_t id;
} root_t;

/* Takes hellos until every rank of the communicator came, then tells each
 * where the others listen. A connection without the token is dropped. */
static void *root_main(void *arg)
{
    root_t *r = arg;
    int nranks = 0, came = 0;
    int *fds = NULL;
    hello_t *who = NULL;
    while (nranks == 0 || came < nranks) {
        int fd = accept4(r->fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            break;
        }
        hello_t h;
        bool ok = read_all(NULL, fd, &h, sizeof h) && h.magic == ID_MAGIC &&
                  memcmp(h.token, r->id.token, TOKEN_BYTES) == 0 && h.nranks > 0 && h.rank >= 0 &&
                  h.rank < h.nranks && (nranks == 0 || h.nranks == nranks);
        if (ok && nranks == 0) {
            nranks = h.nranks;
            fds = calloc((size_t)nranks, sizeof *fds);
            who = calloc((size_t)nranks, sizeof *who);
            if (fds == NULL || who == NULL)
                break;
            for (int i = 0; i < nranks; i++)
                fds[i] = -1;
        }
        if (!ok || fds[h.rank] >= 0) {   /* a stranger, or a rank twice */
            close(fd);
            continue;
        }
        fds[h.rank] = fd;
        who[h.rank] = h;
        came++;
    }
    if (nranks > 0 && came == nranks) {
        for (int i = 0; i < nranks; i++)
            write_all(NULL, fds[i], who, (size_t)nranks * sizeof *who);
    }
    for (int i = 0; fds != NULL && i < nranks; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    free(fds);
    free(who);
    close(r->fd);
    free(r);
    return NULL;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *uid)
{
    if (uid == NULL)
        return fail(NULL, ncclInvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
    root_t *r = calloc(1, sizeof *r);
    if (r == NULL)
        return fail(NULL, ncclSystemError, "ncclGetUniqueId: out of memory");
    r->id.magic = ID_MAGIC;
    if (getrandom(r->id.token, TOKEN_BYTES, 0) != TOKEN_BYTES || (r->fd = listen_new("root", r->id.name)) < 0) {
        free(r);
        return fail(NULL, ncclSystemError, "ncclGetUniqueId: no rendezvous socket: %s", strerror(errno));
    }
    memset(uid, 0, sizeof *uid);
    memcpy(uid, &r->id, sizeof r->id);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&t, &attr, root_main, r);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        close(r->fd);
        free(r);
        return fail(NULL, ncclSystemError, "ncclGetUniqueId: no thread for the rendezvous");
    }
    return ncclSuccess;
}

/* ================================================================ communicators */

static void comm_unref(ncclComm_t c)
{
    pthread_mutex_lock(&c->lock);
    int left = --c->refs;
    pthread_mutex_unlock(&c->lock);
    if (left > 0)
        return;
    for (int i = 0; i < c->nranks; i++)
        if (c->fds[i] >= 0)
            close(c->fds[i]);
    if (c->listen_fd >= 0)
        close(c->listen_fd);
    pthread_mutex_destroy(&c->lock);
    free(c->fds);
    free(c);
}

/* Under the lock: an abort shuts down the sockets there are. */
static void comm_set_fd(ncclComm_t c, int peer, int fd)
{
    pthread_mutex_lock(&c->lock);
    c->fds[peer] = fd;
    if (fd >= 0 && c->aborted)
        shutdown(fd, SHUT_RDWR);
    pthread_mutex_unlock(&c->lock);
}

/* The rendezvous and the sockets to every peer. */
static ncclResult_t comm_connect(ncclComm_t c)
{
    hello_t me = { .magic = ID_MAGIC, .nranks = c->nranks, .rank = c->rank };
    memcpy(me.token, c->id.token, TOKEN_BYTES);
    if ((c->listen_fd = listen_new("rank", me.name)) < 0)
        return fail(c, ncclSystemError, "rank %d: no socket to listen on: %s", c->rank, strerror(errno));
    int root = dial(c->id.name);
    if (root < 0)
        return fail(c, ncclRemoteError, "rank %d: the rendezvous %s is gone (its process exited?): %s", c->rank,
                    c->id.name, strerror(errno));
    hello_t *all = calloc((size_t)c->nranks, sizeof *all);
    bool ok = all != NULL && write_all(c, root, &me, sizeof me) &&
              read_all(c, root, all, (size_t)c->nranks * sizeof *all);
    close(root);
    if (!ok) {
        free(all);
        return aborted(c) ? fail(c, ncclInvalidUsage, "rank %d: the communicator was aborted during its init", c->rank)
                          : fail(c, ncclRemoteError, "rank %d: the rendezvous closed before every rank came", c->rank);
    }
    /* Connect to the lower ranks, take the higher ones' connections. */
    for (int p = 0; p < c->rank && ok; p++) {
        int fd = dial(all[p].name);
        comm_set_fd(c, p, fd);
        ok = fd >= 0 && write_all(c, fd, &me, sizeof me);
    }
    for (int k = c->rank + 1; k < c->nranks && ok; k++) {
        ok = wait_fd(c, c->listen_fd, POLLIN);
        int fd = ok ? accept4(c->listen_fd, NULL, NULL, SOCK_CLOEXEC) : -1;
        hello_t h;
        ok = fd >= 0 && read_all(c, fd, &h, sizeof h) && h.magic == ID_MAGIC &&
             memcmp(h.token, c->id.token, TOKEN_BYTES) == 0 && h.rank > c->rank && h.rank < c->nranks &&
             c->fds[h.rank] < 0;
        if (ok)
            comm_set_fd(c, h.rank, fd);
        else if (fd >= 0)
            close(fd);
    }
    free(all);
    if (!ok)
        return aborted(c) ? fail(c, ncclInvalidUsage, "rank %d: the communicator was aborted during its init", c->rank)
                          : fail(c, ncclRemoteError, "rank %d: connecting to its peers failed", c->rank);
    pthread_mutex_lock(&c->lock);
    if (c->async == ncclInProgress)
        c->async = ncclSuccess;
    pthread_mutex_unlock(&c->lock);
    return ncclSuccess;
}

static void *init_main(void *arg)
{
    comm_connect(arg);
    return NULL;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId uid, int rank, ncclConfig_t *config)
{
    id_body_t id;
    memcpy(&id, &uid, sizeof id);
    if (comm == NULL || nranks < 1 || rank < 0 || rank >= nranks || id.magic != ID_MAGIC)
        return fail(NULL, ncclInvalidArgument, "ncclCommInitRankConfig: rank %d of %d, or an id not made by "
                    "ncclGetUniqueId", rank, nranks);
    if (config != NULL && (config->magic != 0xcafebeef || config->size != sizeof *config))
        return fail(NULL, ncclInvalidArgument, "ncclCommInitRankConfig: the config was not made with "
                    "NCCL_CONFIG_INITIALIZER");
    /* Blocking unless the config says 0, as NCCL's default is. */
    bool blocking = config == NULL || config->blocking != 0;
    ncclComm_t c = calloc(1, sizeof *c);
    int *fds = calloc((size_t)nranks, sizeof *fds);
    if (c == NULL || fds == NULL) {
        free(c);
        free(fds);
        return fail(NULL, ncclSystemError, "ncclCommInitRankConfig: out of memory");
    }
    pthread_mutex_init(&c->lock, NULL);
    c->refs = 1;
    c->nranks = nranks;
    c->rank = rank;
    c->id = id;
    c->listen_fd = -1;
    c->fds = fds;
    for (int i = 0; i < nranks; i++)
        fds[i] = -1;
    c->async = ncclInProgress;
    *comm = c;
    if (blocking)
        return comm_connect(c);
    if (pthread_create(&c->init_thread, NULL, init_main, c) != 0)
        return fail(c, ncclSystemError, "ncclCommInitRankConfig: no thread for the init");
    c->init_running = true;
    return ncclInProgress;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async)
{
    if (comm == NULL || async == NULL)
        return ncclInvalidArgument;
    pthread_mutex_lock(&comm->lock);
    *async = comm->async;
    pthread_mutex_unlock(&comm->lock);
    return ncclSuccess;
}

/* The caller lets go: an init in progress ends first, then the memory goes
 * with the last kernel that holds it. */
static void comm_release(ncclComm_t comm)
{
    if (comm->init_running)
        pthread_join(comm->init_thread, NULL);
    comm->init_running = false;
    comm_unref(comm);
}

/* Its peers see the sockets shut down; an init in progress and the kernels
 * still to run end with the abort recorded. */
ncclResult_t ncclCommAbort(ncclComm_t comm)
{
    if (comm == NULL)
        return ncclSuccess;
    fail(comm, ncclInvalidUsage, "rank %d: the communicator was aborted", comm->rank);
    pthread_mutex_lock(&comm->lock);
    __atomic_store_n(&comm->aborted, true, __ATOMIC_RELEASE);
    for (int i = 0; i < comm->nranks; i++)
        if (comm->fds[i] >= 0)
            shutdown(comm->fds[i], SHUT_RDWR);
    pthread_mutex_unlock(&comm->lock);
    comm_release(comm);
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
    if (comm == NULL)
        return ncclSuccess;
    comm_release(comm);
    return ncclSuccess;
}

/* ================================================================ groups and transfers */

struct op {
    op_t        *next;
    bool         send;
    int          peer;
    char        *buf;
    size_t       bytes;
    size_t       done;        /* of the 8-byte length, then of the bytes */
    uint64_t     len;         /* the length on the wire: ours to send, or the peer's */
};

/* One (communicator, stream) of a group: one kernel. */
typedef struct batch {
    struct batch *next;
    ncclComm_t    comm;
    void         *stream;
    op_t         *head, *tail;
    size_t        nops;
} batch_t;

static __thread int group_depth;
static __thread batch_t *group_batches;
static __thread ncclResult_t group_error;

ncclResult_t ncclGroupStart(void)
{
    group_depth++;
    return ncclSuccess;
}

static size_t type_bytes(ncclDataType_t t)
{
    switch (t) {
    case ncclInt8: case ncclUint8:                  return 1;
    case ncclFloat16: case ncclBfloat16:            return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default:                                        return 0;
    }
}

static void batch_free(batch_t *b)
{
    while (b->head != NULL) {
        op_t *o = b->head;
        b->head = o->next;
        free(o);
    }
    free(b);
}

/* The op's peer's queue head in its direction, in the order they were issued. */
static op_t *first_of(op_t *head, int peer, bool send)
{
    for (op_t *o = head; o != NULL; o = o->next)
        if (o->peer == peer && o->send == send && o->done < o->bytes + 8)
            return o;
    return NULL;
}

/* Moves what the socket takes (or gives) for op o; false on a failure, recorded on c. */
static bool op_step(ncclComm_t c, op_t *o)
{
    int fd = c->fds[o->peer];
    for (;;) {
        if (o->done >= o->bytes + 8)
            return true;
        ssize_t k;
        if (o->send) {
            const char *src = o->done < 8 ? (const char *)&o->len + o->done : o->buf + (o->done - 8);
            size_t want = o->done < 8 ? 8 - o->done : o->bytes - (o->done - 8);
            k = send(fd, src, want, MSG_DONTWAIT | MSG_NOSIGNAL);
        } else {
            char *dst = o->done < 8 ? (char *)&o->len + o->done : o->buf + (o->done - 8);
            size_t want = o->done < 8 ? 8 - o->done : o->bytes - (o->done - 8);
            k = recv(fd, dst, want, MSG_DONTWAIT);
            if (k == 0) {
                fail(c, aborted(c) ? ncclInvalidUsage : ncclRemoteError, "rank %d: rank %d closed its connection "
                     "mid-transfer (%zu of %zu bytes received): the remote process exited, or aborted", c->rank,
                     o->peer, o->done > 8 ? o->done - 8 : 0, o->bytes);
                return false;
            }
        }
        if (k < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)
                return true;
            fail(c, aborted(c) ? ncclInvalidUsage : ncclRemoteError, "rank %d: the connection to rank %d failed "
                 "mid-transfer (%s): the remote process exited, or aborted", c->rank, o->peer, strerror(errno));
            return false;
        }
        size_t before = o->done;
        o->done += (size_t)k;
        if (!o->send && before < 8 && o->done >= 8 && o->len != o->bytes) {
            fail(c, ncclInvalidUsage, "rank %d: rank %d sent %llu bytes where this rank receives %zu: the ranks' "
                 "operations are out of step", c->rank, o->peer, (unsigned long long)o->len, o->bytes);
            return false;
        }
    }
}

/* The kernel: every operation of the batch, each pair's in issue order, all
 * pairs at once. Ends at the first failure (recorded on the communicator). */
static void batch_run(void *arg)
{
    batch_t *b = arg;
    ncclComm_t c = b->comm;
    struct pollfd *pf = calloc((size_t)c->nranks, sizeof *pf);
    ncclResult_t st = ncclSuccess;
    ncclCommGetAsyncError(c, &st);
    bool ok = pf != NULL && st == ncclSuccess && !aborted(c);
    while (ok) {
        int n = 0;
        for (int p = 0; p < c->nranks; p++) {
            op_t *s = first_of(b->head, p, true), *r = first_of(b->head, p, false);
            if (s != NULL && !(ok = op_step(c, s)))
                break;
            if (r != NULL && !(ok = op_step(c, r)))
                break;
            s = first_of(b->head, p, true);
            r = first_of(b->head, p, false);
            if (s != NULL || r != NULL)
                pf[n++] = (struct pollfd){ c->fds[p], (short)((s != NULL ? POLLOUT : 0) | (r != NULL ? POLLIN : 0)),
                                           0 };
        }
        if (!ok || n == 0)
            break;
        if (aborted(c)) {
            ok = false;
            break;
        }
        poll(pf, (nfds_t)n, POLL_MS);
    }
    free(pf);
    comm_unref(c);
    batch_free(b);
}

static ncclResult_t batch_launch(batch_t *b)
{
    ncclComm_t c = b->comm;
    stub_touch_t *t = calloc(b->nops, sizeof *t);
    if (t == NULL)
        return fail(c, ncclSystemError, "out of memory");
    size_t n = 0;
    for (op_t *o = b->head; o != NULL; o = o->next)
        t[n++] = (stub_touch_t){ (stub_ptr_t)(uintptr_t)o->buf, o->bytes };
    pthread_mutex_lock(&c->lock);
    c->refs++;   /* the kernel's */
    pthread_mutex_unlock(&c->lock);
    stub_result_t rc = stub_launch(b->stream, "ncclGroup", t, n, batch_run, b);
    free(t);
    if (rc != STUB_SUCCESS) {
        comm_unref(c);
        return fail(c, ncclUnhandledCudaError, "rank %d: launching its transfers failed: %s (cuda error %d)",
                    c->rank, rc == 700 ? "a buffer its stream's device cannot reach" : "the stream refused it", rc);
    }
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void)
{
    if (group_depth == 0)
        return fail(NULL, ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--group_depth > 0)
        return ncclSuccess;
    ncclResult_t r = group_error;
    batch_t *list = group_batches;
    group_batches = NULL;
    group_error = ncclSuccess;
    while (list != NULL) {
        batch_t *b = list;
        list = b->next;
        if (r == ncclSuccess) {
            r = batch_launch(b);
            if (r == ncclSuccess)
                continue;   /* the kernel frees it */
        }
        batch_free(b);   /* a failed group launches nothing more */
    }
    return r;
}

static ncclResult_t p2p(bool send, void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                        cudaStream_t stream)
{
    size_t es = type_bytes(type);
    ncclResult_t r = ncclSuccess;
    ncclResult_t st = ncclInProgress;
    if (comm != NULL)
        ncclCommGetAsyncError(comm, &st);
    if (comm == NULL || es == 0 || peer < 0 || peer >= comm->nranks || peer == comm->rank || stream == NULL)
        r = fail(NULL, ncclInvalidArgument, "%s: peer %d, type %d, a stream made with cuStreamCreate",
                 send ? "ncclSend" : "ncclRecv", peer, (int)type);
    else if (st != ncclSuccess)
        r = fail(NULL, ncclInvalidUsage, "%s: the communicator is %s", send ? "ncclSend" : "ncclRecv",
                 st == ncclInProgress ? "not initialized yet" : "in error");
    ncclGroupStart();
    batch_t *b = group_batches;
    while (r == ncclSuccess && b != NULL && (b->comm != comm || b->stream != stream))
        b = b->next;
    if (r == ncclSuccess && b == NULL) {
        if ((b = calloc(1, sizeof *b)) == NULL) {
            r = fail(comm, ncclSystemError, "out of memory");
        } else {
            *b = (batch_t){ .next = group_batches, .comm = comm, .stream = stream };
            group_batches = b;
        }
    }
    op_t *o = r == ncclSuccess ? calloc(1, sizeof *o) : NULL;
    if (r == ncclSuccess && o == NULL)
        r = fail(comm, ncclSystemError, "out of memory");
    if (o != NULL) {
        *o = (op_t){ .send = send, .peer = peer, .buf = buf, .bytes = count * es, .len = count * es };
        if (b->tail != NULL)
            b->tail->next = o;
        else
            b->head = o;
        b->tail = o;
        b->nops++;
    }
    if (r != ncclSuccess && group_error == ncclSuccess)
        group_error = r;
    ncclResult_t end = ncclGroupEnd();
    return r != ncclSuccess ? r : end;
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream)
{
    return p2p(true, (void *)sendbuff, count, datatype, peer, comm, stream);
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream)
{
    return p2p(false, recvbuff, count, datatype, peer, comm, stream);
}
