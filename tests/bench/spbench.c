/*
 * spbench — spd's benchmark. Every figure is printed beside a peer measured in
 * the same run, on the same machine, with the ratio peer time / spd time.
 *
 *   spbench latency  [--ranks N] [--iters K] [--json]
 *   spbench alltoall [--ranks P[,P...]] [--sizes N[,N...]] [--iters K] [--nodes M] [--registered] [--json]
 *   spbench shift    [--ranks P[,P...]] [--sizes N[,N...]] [--iters K] [--nodes M] [--registered] [--json]
 *   spbench reducescatter [the same options as shift]
 *   spbench alltoallv [the same options as shift]
 *
 * latency: the no-op round trip through spd (one client), against a ping-pong of
 * 8 bytes over a Unix socket between two processes (what a socket-based daemon
 * pays per request); and the 8-byte allreduce across N ranks (default 2),
 * against OpenMPI's MPI_Allreduce of 8 bytes on N ranks. Each op is timed on its
 * own; medians and 99th percentiles over K ops (default 10000) after a warm-up.
 *
 * alltoall, shift, reducescatter, alltoallv: bandwidth of the data movers on P ranks
 * (default 2) for N bytes per rank (default 64K 256K 1M 4M 16M 64M), each
 * point beside two references measured in the same run:
 *   - the peer, OpenMPI: MPI_Alltoall of N/P bytes to each rank, MPI_Sendrecv
 *     of N bytes to rank + 1 from rank - 1 around the ring,
 *     MPI_Reduce_scatter_block of N bytes of fp32 summed, N/P to each rank,
 *     or MPI_Alltoallv of the same uneven blocks as spd's;
 *   - the copy bound: the P*N bytes spd must write for the op (every rank
 *     receives N; a reduce-scatter reads them), memcpy'd by as many threads as spd copies with, each thread
 *     between its own source and destination buffers; measured right before
 *     and right after the spd point, the faster kept. spd cannot beat it
 *     (except by noise); bound_ratio = spd_us / copy_bound_us.
 * alltoall is a Ulysses seq->head all-to-all of one fp32 BSHD tensor with B = 1,
 * D = 128 and H = 8P heads, so S_loc = N / (H * D * 4) rows per rank (sizes
 * that do not divide are refused). shift is the cyclic ring shift of one
 * N-byte tensor on channel 0. reducescatter sums N bytes of fp32 per rank
 * and leaves N/P bytes on each (spc_reduce_scatter; N a multiple of 4P).
 * alltoallv (spc_alltoallv) sends and receives N bytes of fp32 per rank in
 * uneven blocks: of E = N/4 elements, the block to rank + k (mod P), k >= 1,
 * holds E (k + 1) / W (W = P (P + 1) / 2), the block to itself the rest; every
 * rank's column holds each k once, so it receives E too (N a multiple of 4).
 *
 * Timing of alltoall and shift, for spd and OpenMPI alike: every iteration
 * begins with a barrier, every rank times its own op, and an iteration counts
 * as the slowest rank's time; medians (and 99th percentiles) over K iterations.
 * K (default: chosen) is sized so a point takes about TARGET_S seconds, from
 * the median of CAL_ITERS warm-up iterations, clamped to [MIN_ITERS, MAX_ITERS];
 * K / 10 (at most 500) more warm-up iterations follow. Bandwidths follow
 * nccl-tests, in GB/s (1e9 bytes/s): alltoall, alltoallv and reducescatter
 * algbw = N / time and busbw = algbw * (P - 1) / P; shift algbw = busbw = N /
 * time.
 *
 * spbench talks to the spd at $SPC_SOCKET (or the default socket). Each rank of
 * alltoall and shift asks for an arena of 2N + ARENA_SLACK bytes: the daemon's
 * max_arena_bytes must allow it.
 *
 * --nodes M (M >= 2): spbench starts M daemons of its own on loopback, each a
 * node with its own socket, linked by peers with a cluster secret, their data
 * path UCX over TCP (UCX_TLS=tcp unless the environment says otherwise), and
 * puts ranks r * M / P .. on node r. The peer is then OpenMPI with TCP only
 * (--mca btl tcp,self), every rank a process on this machine as well. The
 * memcpy bound means nothing between nodes and is left out.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "spclient/spclient.h"

#define WARMUP 1000

/* Iteration counts of alltoall and shift; spbench_mpi.c has the same rule. */
#define CAL_ITERS 5
#define TARGET_S  0.3
#define MIN_ITERS 10
#define MAX_ITERS 10000
#define COPY_TARGET_S 0.15   /* each of the two copy-bound runs of a point */

#define OP_TIMEOUT_MS 60000
#define ARENA_SLACK   (4u << 20)   /* arena beyond send + recv; allocations are 4 KiB aligned */
#define MAX_RANKS     64
#define MAX_SIZES     32

#define MAX_NODES 8

/* The daemons of --nodes; nnodes 0: the spd at $SPC_SOCKET. */
static struct {
    int   nnodes;
    pid_t owner;            /* the process that started them (forked ranks exit too) */
    char  dir[64];
    char  sock[MAX_NODES][128];
    pid_t pid[MAX_NODES];
} cluster;

typedef struct stats {
    double median_us, p99_us;
    int    n;
} stats_t;

typedef struct result {
    const char *op;
    int         bytes, ranks, iters;
    stats_t     spd;
    const char *peer;
    stats_t     peer_stats;
    bool        peer_ok;
    char        peer_note[160];
} result_t;

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static stats_t summarize(double *s, int n)
{
    qsort(s, (size_t)n, sizeof *s, cmp_double);
    stats_t st = { .n = n };
    st.median_us = n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
    int k = (int)ceil(0.99 * n) - 1;
    st.p99_us = s[k < 0 ? 0 : k];
    return st;
}

static void die(const char *what, spc_status_t st, spc_handle_t *h)
{
    fprintf(stderr, "spbench: %s: %s: %s\n", what, spc_status_name(st), spc_last_error(h));
    exit(1);
}

/* ---------------------------------------------------------------- spd */

static stats_t bench_noop(int iters)
{
    spc_handle_t *h;
    spc_status_t st = spc_attach(NULL, &h);
    if (st != SPC_OK)
        die("attach (is spd running? set SPC_SOCKET)", st, NULL);
    double *s = malloc((size_t)iters * sizeof *s);
    for (int i = 0; i < WARMUP + iters; i++) {
        double t0 = now_us();
        if ((st = spc_noop(h, 10000)) != SPC_OK)
            die("noop", st, h);
        if (i >= WARMUP)
            s[i - WARMUP] = now_us() - t0;
    }
    spc_detach(h);
    stats_t r = summarize(s, iters);
    free(s);
    return r;
}

/* Rank 0 times each allreduce; the samples come back through shared memory. */
static stats_t bench_allreduce(int ranks, int iters)
{
    spc_handle_t *owner;
    char job[SPC_JOB_ID_MAX];
    spc_status_t st = spc_attach(NULL, &owner);
    if (st != SPC_OK)
        die("attach (is spd running? set SPC_SOCKET)", st, NULL);
    if ((st = spc_job_create(owner, job, sizeof job)) != SPC_OK)
        die("job create", st, owner);
    double *s = mmap(NULL, (size_t)iters * sizeof *s, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    pid_t *pids = calloc((size_t)ranks, sizeof *pids);
    fflush(stdout);
    for (int r = 0; r < ranks; r++) {
        pids[r] = fork();
        if (pids[r] != 0)
            continue;
        spc_handle_t *h;
        spc_group_t world;
        if ((st = spc_attach(NULL, &h)) != SPC_OK)
            die("attach", st, NULL);
        if ((st = spc_job_join(h, job, (uint32_t)ranks, (uint32_t)r, 30000, &world)) != SPC_OK)
            die("join", st, h);
        double *x = spc_alloc(h, sizeof *x);
        if ((st = spc_barrier(h, world, 30000)) != SPC_OK)
            die("barrier", st, h);
        for (int i = 0; i < WARMUP + iters; i++) {
            *x = r + i;
            double t0 = now_us();
            if ((st = spc_allreduce(h, world, x, x, 1, SPC_F64, SPC_SUM, 30000)) != SPC_OK)
                die("allreduce", st, h);
            if (r == 0 && i >= WARMUP)
                s[i - WARMUP] = now_us() - t0;
        }
        spc_detach(h);
        _exit(0);
    }
    int failed = 0;
    for (int r = 0; r < ranks; r++) {
        int status;
        waitpid(pids[r], &status, 0);
        failed |= !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    }
    spc_detach(owner);
    if (failed) {
        fprintf(stderr, "spbench: a rank failed\n");
        exit(1);
    }
    stats_t out = summarize(s, iters);
    munmap(s, (size_t)iters * sizeof *s);
    free(pids);
    return out;
}

/* ---------------------------------------------------------------- peers */

/* 8 bytes there and back over a Unix stream socket between two processes. */
static stats_t bench_socket_pingpong(int iters)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        perror("socketpair");
        exit(1);
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        close(sv[0]);
        uint64_t v;
        while (read(sv[1], &v, sizeof v) == (ssize_t)sizeof v)
            if (write(sv[1], &v, sizeof v) != (ssize_t)sizeof v)
                break;
        _exit(0);
    }
    close(sv[1]);
    double *s = malloc((size_t)iters * sizeof *s);
    for (int i = 0; i < WARMUP + iters; i++) {
        uint64_t v = (uint64_t)i;
        double t0 = now_us();
        if (write(sv[0], &v, sizeof v) != (ssize_t)sizeof v || read(sv[0], &v, sizeof v) != (ssize_t)sizeof v) {
            perror("ping-pong");
            exit(1);
        }
        if (i >= WARMUP)
            s[i - WARMUP] = now_us() - t0;
    }
    close(sv[0]);
    waitpid(pid, NULL, 0);
    stats_t r = summarize(s, iters);
    free(s);
    return r;
}

/*
 * Runs `spbench-mpi ARGS` on `ranks` ranks under mpirun and parses rank 0's
 * line "TAG v1 v2 ..." into vals[nvals]. On failure, says why in note.
 */
/* Between nodes (--nodes) the peer speaks TCP only, as it would across hosts. */
static const char *mpi_btl = "self,vader";
/* --registered: the ranks' buffers are their own memory, spc_register'ed, which
 * spd reaches by cross-memory attach through its staging, not the arena. */
static bool bw_registered;

static bool run_mpi(int ranks, const char *args, const char *tag, double *vals, int nvals, char *note,
                    size_t notelen)
{
#ifdef SPBENCH_MPI
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=%s "
             "'%s' -np %d --oversubscribe '%s' %s 2>&1",
             mpi_btl, SPBENCH_MPIRUN, ranks, SPBENCH_MPI, args);
    fflush(stdout);
    FILE *p = popen(cmd, "r");
    if (p == NULL) {
        snprintf(note, notelen, "cannot run mpirun");
        return false;
    }
    char line[512], last[512] = "";
    size_t taglen = strlen(tag);
    bool ok = false, own = false;
    while (fgets(line, sizeof line, p) != NULL) {
        if (strncmp(line, tag, taglen) == 0 && line[taglen] == ' ') {
            char *q = line + taglen, *end;
            int k = 0;
            for (; k < nvals; k++, q = end) {
                vals[k] = strtod(q, &end);
                if (end == q)
                    break;
            }
            ok = k == nvals;
        } else if (strncmp(line, "spbench-mpi", 11) == 0 || (!own && line[0] != '\n' && line[0] != '-')) {
            /* The helper's own complaint beats what mpirun says after it. */
            own = strncmp(line, "spbench-mpi", 11) == 0;
            snprintf(last, sizeof last, "%s", line);
        }
    }
    int rc = pclose(p);
    if (!ok || rc != 0) {
        last[strcspn(last, "\n")] = '\0';
        snprintf(note, notelen, "mpirun failed: %s", last);
        return false;
    }
    return true;
#else
    (void)ranks;
    (void)args;
    (void)tag;
    (void)vals;
    (void)nvals;
    snprintf(note, notelen, "built without MPI (install libopenmpi-dev)");
    return false;
#endif
}

/* OpenMPI's 8-byte MPI_Allreduce; spbench-mpi prints "median_us p99_us". */
static bool bench_mpi_allreduce(int ranks, int iters, stats_t *out, char *note, size_t notelen)
{
    char args[64];
    double v[2] = { 0, 0 };
    snprintf(args, sizeof args, "allreduce8 %d %d", iters, WARMUP);
    if (!run_mpi(ranks, args, "mpi_allreduce8", v, 2, note, notelen))
        return false;
    *out = (stats_t){ .median_us = v[0], .p99_us = v[1], .n = iters };
    return true;
}

/* ---------------------------------------------------------------- output */

static void print_text(const result_t *r, int n)
{
    printf("%-10s %6s %5s %7s %10s %9s   %-24s %14s %11s %9s\n", "op", "bytes", "ranks", "iters", "median_us",
           "p99_us", "peer", "peer_median_us", "peer_p99_us", "peer/spd");
    for (int i = 0; i < n; i++) {
        printf("%-10s %6d %5d %7d %10.2f %9.2f   %-24s ", r[i].op, r[i].bytes, r[i].ranks, r[i].iters,
               r[i].spd.median_us, r[i].spd.p99_us, r[i].peer);
        if (r[i].peer_ok)
            printf("%14.2f %11.2f %8.2fx\n", r[i].peer_stats.median_us, r[i].peer_stats.p99_us,
                   r[i].peer_stats.median_us / r[i].spd.median_us);
        else
            printf("%s\n", r[i].peer_note);
    }
}

static void print_json(const result_t *r, int n)
{
    for (int i = 0; i < n; i++) {
        printf("{\"op\":\"%s\",\"bytes\":%d,\"ranks\":%d,\"iters\":%d,\"median_us\":%.3f,\"p99_us\":%.3f,"
               "\"peer\":\"%s\",",
               r[i].op, r[i].bytes, r[i].ranks, r[i].iters, r[i].spd.median_us, r[i].spd.p99_us, r[i].peer);
        if (r[i].peer_ok)
            printf("\"peer_median_us\":%.3f,\"peer_p99_us\":%.3f,\"ratio_vs_peer\":%.3f}\n",
                   r[i].peer_stats.median_us, r[i].peer_stats.p99_us, r[i].peer_stats.median_us / r[i].spd.median_us);
        else
            printf("\"peer_median_us\":null,\"peer_p99_us\":null,\"ratio_vs_peer\":null,\"peer_note\":\"%s\"}\n",
                   r[i].peer_note);
    }
}

static int main_latency(int argc, char **argv);
static int main_bandwidth(int argc, char **argv);

static void usage(FILE *out)
{
    fprintf(out,
            "usage: spbench latency  [--ranks N] [--iters K] [--json]\n"
            "       spbench alltoall [--ranks P[,P...]] [--sizes N[,N...]] [--iters K] [--nodes M] [--registered]\n"
            "                        [--json]\n"
            "       spbench shift    [--ranks P[,P...]] [--sizes N[,N...]] [--iters K] [--nodes M] [--registered]\n"
            "                        [--json]\n"
            "       spbench reducescatter [the options of shift]\n"
            "       spbench alltoallv [the options of shift]\n"
            "  alltoall/shift/reducescatter/alltoallv: P ranks (default 2), N bytes per rank with an optional K, M or G\n"
            "  suffix (default 64K,256K,1M,4M,16M,64M), K timed iterations (default: chosen so a\n"
            "  point takes about %.1f s). Measures against the spd at $SPC_SOCKET (default %s);\n"
            "  --nodes M starts M daemons of its own on loopback (UCX over TCP between them)\n"
            "  against OpenMPI over TCP. --registered: the ranks' buffers are registered host\n"
            "  memory (spc_register) instead of the arena.\n",
            TARGET_S, spc_socket_path(NULL));
}

int main(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "latency") == 0)
        return main_latency(argc, argv);
    if (argc >= 2 && (strcmp(argv[1], "alltoall") == 0 || strcmp(argv[1], "shift") == 0 ||
                      strcmp(argv[1], "reducescatter") == 0 || strcmp(argv[1], "alltoallv") == 0))
        return main_bandwidth(argc, argv);
    bool help = argc >= 2 && strcmp(argv[1], "--help") == 0;
    usage(help ? stdout : stderr);
    return help ? 0 : 2;
}

static int main_latency(int argc, char **argv)
{
    int ranks = 2, iters = 10000, json = 0;
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--ranks") == 0 && i + 1 < argc)
            ranks = atoi(argv[++i]);
        else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc)
            iters = atoi(argv[++i]);
        else if (strcmp(argv[i], "--json") == 0)
            json = 1;
        else {
            usage(stderr);
            return 2;
        }
    }
    if (ranks < 1 || iters < 1) {
        usage(stderr);
        return 2;
    }

    result_t r[2] = {
        { .op = "noop", .bytes = 0, .ranks = 1, .iters = iters, .peer = "unix-socket ping-pong" },
        { .op = "allreduce", .bytes = 8, .ranks = ranks, .iters = iters, .peer = "MPI_Allreduce (OpenMPI)" },
    };
    r[0].spd = bench_noop(iters);
    r[0].peer_stats = bench_socket_pingpong(iters);
    r[0].peer_ok = true;
    r[1].spd = bench_allreduce(ranks, iters);
    r[1].peer_ok = bench_mpi_allreduce(ranks, iters, &r[1].peer_stats, r[1].peer_note, sizeof r[1].peer_note);

    if (json)
        print_json(r, 2);
    else
        print_text(r, 2);
    return 0;
}

/* ================================================================ alltoall and shift */

typedef enum bw_op { BW_ALLTOALL, BW_SHIFT, BW_REDUCE_SCATTER, BW_ALLTOALLV } bw_op_t;

#define A2A_HEAD_DIM     128u
#define A2A_HEADS_PER_P  8u   /* H = 8P: divisible by P, no dummy heads */

typedef struct bw_point {
    bw_op_t  op;
    uint64_t bytes;          /* per rank */
    int      ranks;
    int      iters;
    stats_t  spd;            /* per iteration: the slowest rank's time */
    bool     peer_ok;
    int      peer_iters;
    stats_t  peer;
    char     peer_note[200];
    double   copy_bound_us;  /* median time to memcpy copy_bytes with copy_threads threads */
    uint64_t copy_bytes;
    int      copy_threads;
} bw_point_t;

static const char *bw_name(bw_op_t op)
{
    static const char *const names[] = { "alltoall", "shift", "reducescatter", "alltoallv" };
    return names[op];
}

static const char *bw_peer(bw_op_t op)
{
    static const char *const peers[] = { "openmpi MPI_Alltoall", "openmpi MPI_Sendrecv ring",
                                         "openmpi MPI_Reduce_scatter_block", "openmpi MPI_Alltoallv" };
    static const char *const tcp[] = { "openmpi MPI_Alltoall over TCP", "openmpi MPI_Sendrecv ring over TCP",
                                       "openmpi MPI_Reduce_scatter_block over TCP", "openmpi MPI_Alltoallv over TCP" };
    return cluster.nnodes ? tcp[op] : peers[op];
}

/* The all-to-all's row: one sequence position of all H heads, in bytes. */
static uint64_t a2a_row_bytes(int ranks)
{
    return (uint64_t)A2A_HEADS_PER_P * (uint64_t)ranks * A2A_HEAD_DIM * sizeof(float);
}

/* nccl-tests' bandwidths in GB/s from bytes per rank and microseconds. */
static double algbw(uint64_t bytes, double us)
{
    return (double)bytes / (us * 1e3);
}

static double busbw(bw_op_t op, int ranks, uint64_t bytes, double us)
{
    double a = algbw(bytes, us);
    return op == BW_SHIFT ? a : a * (ranks - 1) / ranks;
}

static uint64_t bw_arena_bytes(uint64_t bytes)
{
    return 2 * bytes + ARENA_SLACK;
}

static void fmt_size(uint64_t n, char *buf, size_t len)
{
    if (n >= (1u << 30) && n % (1u << 30) == 0)
        snprintf(buf, len, "%" PRIu64 "G", n >> 30);
    else if (n >= (1u << 20) && n % (1u << 20) == 0)
        snprintf(buf, len, "%" PRIu64 "M", n >> 20);
    else if (n >= (1u << 10) && n % (1u << 10) == 0)
        snprintf(buf, len, "%" PRIu64 "K", n >> 10);
    else
        snprintf(buf, len, "%" PRIu64, n);
}

/* ---------------------------------------------------------------- the copy bound */

/*
 * The memcpy bound: `bytes` split among `threads` threads, each copying its
 * share between its own source and destination, all started together. Buffers
 * are shared anonymous memory (shmem, like spd's memfd arena, so the same page
 * size) first touched by the thread that copies them. A repetition takes as
 * long as its slowest thread's memcpy: how late a thread wakes is left out (on
 * a busy machine that skew alone can exceed a small op), so this stays a lower
 * bound and the cost of waking copy threads counts against spd. The median of
 * the repetitions is returned.
 */
typedef struct copy_run {
    pthread_barrier_t start, done;
    int               stop;   /* read by the threads after `start`; written by main between `done` and `start` */
    int               cap;    /* room in t0/t1 */
} copy_run_t;

typedef struct copy_thread {
    pthread_t   tid;
    copy_run_t *run;
    size_t      bytes;
    double     *t0, *t1;
} copy_thread_t;

static void *copy_thread_main(void *arg)
{
    copy_thread_t *t = arg;
    char *src = mmap(NULL, t->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    char *dst = mmap(NULL, t->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (src == MAP_FAILED || dst == MAP_FAILED) {
        fprintf(stderr, "spbench: copy bound: mmap of 2 x %zu bytes: %s\n", t->bytes, strerror(errno));
        exit(1);
    }
    memset(src, 0x5a, t->bytes);
    memset(dst, 0, t->bytes);
    for (int rep = 0;; rep++) {
        pthread_barrier_wait(&t->run->start);
        if (t->run->stop)
            break;
        t->t0[rep] = now_us();
        memcpy(dst, src, t->bytes);
        t->t1[rep] = now_us();
        pthread_barrier_wait(&t->run->done);
    }
    munmap(src, t->bytes);
    munmap(dst, t->bytes);
    return NULL;
}

static double copy_bound_us(uint64_t bytes, int threads)
{
    enum { CAL = 3 };
    copy_run_t run = { .cap = CAL + MAX_ITERS };
    copy_thread_t *t = calloc((size_t)threads, sizeof *t);
    double *s = malloc((size_t)run.cap * sizeof *s);
    pthread_barrier_init(&run.start, NULL, (unsigned)threads + 1);
    pthread_barrier_init(&run.done, NULL, (unsigned)threads + 1);
    /* Shares of whole cache lines; the last thread takes the rest. */
    uint64_t share = bytes / (uint64_t)threads / 64 * 64;
    for (int i = 0; i < threads; i++) {
        t[i].run = &run;
        t[i].bytes = (size_t)(i == threads - 1 ? bytes - share * (uint64_t)(threads - 1) : share);
        t[i].t0 = malloc((size_t)run.cap * sizeof(double));
        t[i].t1 = malloc((size_t)run.cap * sizeof(double));
        if (pthread_create(&t[i].tid, NULL, copy_thread_main, &t[i]) != 0) {
            fprintf(stderr, "spbench: copy bound: cannot start thread %d of %d\n", i, threads);
            exit(1);
        }
    }
    /* CAL warm-up repetitions size the run like the op's iterations. */
    int reps = CAL;
    for (int rep = 0;; rep++) {
        run.stop = rep >= reps;
        pthread_barrier_wait(&run.start);
        if (run.stop)
            break;
        pthread_barrier_wait(&run.done);
        s[rep] = 0;
        for (int i = 0; i < threads; i++)
            s[rep] = fmax(s[rep], t[i].t1[rep] - t[i].t0[rep]);
        if (rep == CAL - 1) {
            double median = summarize(s, CAL).median_us;
            double want = ceil(COPY_TARGET_S * 1e6 / fmax(median, 0.01));
            reps = CAL + (want < MIN_ITERS ? MIN_ITERS : want > MAX_ITERS ? MAX_ITERS : (int)want);
        }
    }
    for (int i = 0; i < threads; i++) {
        pthread_join(t[i].tid, NULL);
        free(t[i].t0);
        free(t[i].t1);
    }
    pthread_barrier_destroy(&run.start);
    pthread_barrier_destroy(&run.done);
    double median = summarize(s + CAL, reps - CAL).median_us;
    free(s);
    free(t);
    return median;
}

/* ---------------------------------------------------------------- a loopback cluster */

static const char *rank_socket(int rank, int ranks)
{
    return cluster.nnodes ? cluster.sock[(int64_t)rank * cluster.nnodes / ranks] : NULL;
}

static int64_t status_int(const char *sock, const char *key)
{
    spc_attach_params_t ap = { .struct_size = sizeof ap, .socket_path = sock, .name = "spbench",
                               .flags = SPC_ATTACH_CONTROL_ONLY, .timeout_ms = 2000 };
    spc_handle_t *h;
    spc_query_result_t *q;
    int64_t v = -1;
    if (spc_attach(&ap, &h) != SPC_OK)
        return -1;
    if (spc_query(h, "status", "", &q) == SPC_OK) {
        long f = spc_query_records(q) > 0 ? spc_query_find(q, 0, key) : -1;
        if (f >= 0 && spc_query_kind(q, 0, (size_t)f) == SPC_VALUE_INT)
            v = spc_query_int(q, 0, (size_t)f);
        else if (f >= 0) {
            const char *str = spc_query_str(q, 0, (size_t)f), *colon = strrchr(str, ':');
            v = colon != NULL ? atoll(colon + 1) : -1;
        }
        spc_query_free(q);
    }
    spc_detach(h);
    return v;
}

static void cluster_stop(void)
{
    if (getpid() != cluster.owner)
        return;
    for (int i = 0; i < cluster.nnodes; i++) {
        if (cluster.pid[i] > 0) {
            kill(cluster.pid[i], SIGTERM);
            waitpid(cluster.pid[i], NULL, 0);
        }
    }
    if (cluster.dir[0] != '\0' && getenv("SPBENCH_KEEP") != NULL) {
        fprintf(stderr, "spbench: the daemons' logs are in %s\n", cluster.dir);
    } else if (cluster.dir[0] != '\0') {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", cluster.dir);
        if (system(cmd) != 0)
            fprintf(stderr, "spbench: could not remove %s\n", cluster.dir);
    }
}

/* Starts node i, dialling every node before it; waits until it answers and
 * (for i > 0) its links to them are up. */
static void cluster_start_node(int i, uint64_t max_arena, const int *ports)
{
#ifdef SPBENCH_SPD
    char set[8][256], peers[256] = "";
    size_t off = 0;
    for (int k = 0; k < i; k++)
        off += (size_t)snprintf(peers + off, sizeof peers - off, "%s127.0.0.1:%d", k ? "," : "", ports[k]);
    snprintf(cluster.sock[i], sizeof cluster.sock[i], "%s/node-%d/spd.sock", cluster.dir, i);
    snprintf(set[0], sizeof set[0], "socket=%s", cluster.sock[i]);
    snprintf(set[1], sizeof set[1], "node_name=bench-%d", i);
    snprintf(set[2], sizeof set[2], "peer_listen=127.0.0.1:0");
    snprintf(set[3], sizeof set[3], "peers=%s", peers);
    snprintf(set[4], sizeof set[4], "cluster_secret_file=%s/secret", cluster.dir);
    snprintf(set[5], sizeof set[5], "max_arena_bytes=%" PRIu64, max_arena);
    snprintf(set[6], sizeof set[6], "log_file=%s/node-%d.log", cluster.dir, i);
    snprintf(set[7], sizeof set[7], "log_level=info");
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        setenv("UCX_TLS", getenv("UCX_TLS") ? getenv("UCX_TLS") : "tcp", 1);
        unsetenv("NOTIFY_SOCKET");
        execl(SPBENCH_SPD, SPBENCH_SPD, "--set", set[0], "--set", set[1], "--set", set[2], "--set", set[3], "--set",
              set[4], "--set", set[5], "--set", set[6], "--set", set[7], (char *)NULL);
        _exit(127);
    }
    cluster.pid[i] = pid;
    for (int tries = 0;; tries++) {
        if (status_int(cluster.sock[i], "peers_up") >= i)
            return;
        if (tries == 1000 || waitpid(pid, NULL, WNOHANG) != 0) {
            fprintf(stderr, "spbench: node %d did not come up (see %s/node-%d.log)\n", i, cluster.dir, i);
            cluster_stop();
            exit(1);
        }
        usleep(10000);
    }
#else
    (void)i;
    (void)max_arena;
    (void)ports;
    fprintf(stderr, "spbench: built without the path of spd; --nodes cannot start daemons\n");
    exit(1);
#endif
}

static void cluster_start(int nnodes, uint64_t max_arena)
{
    snprintf(cluster.dir, sizeof cluster.dir, "/tmp/spbench-XXXXXX");
    if (mkdtemp(cluster.dir) == NULL) {
        perror("spbench: mkdtemp");
        exit(1);
    }
    char path[128];
    snprintf(path, sizeof path, "%s/secret", cluster.dir);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    uint8_t key[32];
    char hex[65];
    int rfd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0 || rfd < 0 || read(rfd, key, sizeof key) != (ssize_t)sizeof key) {
        perror("spbench: cluster secret");
        exit(1);
    }
    for (int i = 0; i < 32; i++)
        snprintf(hex + 2 * i, 3, "%02x", key[i]);
    if (write(fd, hex, 64) != 64) {
        perror("spbench: cluster secret");
        exit(1);
    }
    close(fd);
    close(rfd);
    cluster.nnodes = nnodes;
    cluster.owner = getpid();
    int ports[MAX_NODES];
    for (int i = 0; i < nnodes; i++) {
        cluster_start_node(i, max_arena, ports);
        ports[i] = (int)status_int(cluster.sock[i], "peer_listen");
    }
}

/* ---------------------------------------------------------------- spd */

/* What the forked ranks share with the parent: rank 0's choice of K, and every
 * rank's time of every timed iteration, samples[rank * cap + i]. */
typedef struct bw_shared {
    int    iters;
    int    cap;
    double samples[];
} bw_shared_t;

typedef struct bw_rank_ctx {
    bw_op_t        op;
    uint64_t       bytes;
    int            ranks, rank;
    int            fixed_iters;   /* 0: choose */
    spc_handle_t  *h;
    spc_group_t    world;
    void          *send, *recv;
    spc_alltoall_desc_t a2a;
    spc_shift_desc_t    shift;
    spc_alltoallv_desc_t a2av;
    uint64_t       vsend[MAX_RANKS], vrecv[MAX_RANKS];   /* alltoallv's counts */
} bw_rank_ctx_t;

static void rank_die(const bw_rank_ctx_t *c, const char *what, spc_status_t st)
{
    fprintf(stderr, "spbench: %s %" PRIu64 " bytes, rank %d of %d: %s: %s: %s\n", bw_name(c->op), c->bytes,
            c->rank, c->ranks, what, spc_status_name(st), spc_last_error(c->h));
    exit(1);
}

/* Sample values: exact in fp32 (below 2^24) and different for nearby rows, heads
 * and columns, so a misplaced block shows. */
static float a2a_value(uint64_t row, uint32_t head, uint32_t d)
{
    return (float)((row * 977u + head * 131u + d) % 65521u);
}

/* Reduce-scatter values: small integers, so every sum is exact in fp32 whatever its order. */
static float rs_value(int rank, uint64_t i)
{
    return (float)(((uint64_t)rank * 7919u + i) % 1021u);
}

/* alltoallv's elements from rank src to rank dst, of E per rank (the header
 * says the pattern; spbench-mpi's MPI_Alltoallv uses the same). */
static uint64_t v_block(uint64_t E, int P, int src, int dst)
{
    const uint64_t W = (uint64_t)P * (uint64_t)(P + 1) / 2, k = (uint64_t)((dst - src + P) % P);
    if (k != 0)
        return E * (k + 1) / W;
    uint64_t rest = E;
    for (uint64_t j = 1; j < (uint64_t)P; j++)
        rest -= E * (j + 1) / W;
    return rest;
}

/* Fills the send buffer and describes the op. */
static void bw_prepare(bw_rank_ctx_t *c)
{
    memset(c->recv, 0, c->bytes);   /* touch every page before timing */
    if (c->op == BW_ALLTOALL) {
        uint32_t P = (uint32_t)c->ranks, H = A2A_HEADS_PER_P * P, D = A2A_HEAD_DIM;
        uint64_t s_loc = c->bytes / a2a_row_bytes(c->ranks);
        float *x = c->send;
        for (uint64_t s = 0; s < s_loc; s++)
            for (uint32_t hd = 0; hd < H; hd++)
                for (uint32_t d = 0; d < D; d++)
                    x[(s * H + hd) * D + d] = a2a_value((uint64_t)c->rank * s_loc + s, hd, d);
        c->a2a = (spc_alltoall_desc_t){
            .struct_size = sizeof(spc_alltoall_desc_t),
            .group = c->world,
            .dtype = SPC_F32,
            .direction = SPC_SEQ_TO_HEAD,
            .layout = SPC_LAYOUT_BSHD,
            .batch = 1,
            .seq_len = (uint32_t)(s_loc * P),
            .kv_heads = 0,
            .ntensors = 1,
            .tensors = { { .send = c->send, .recv = c->recv, .heads = H, .head_dim = D, .kind = SPC_HEADS_Q } },
            .timeout_ms = OP_TIMEOUT_MS,
        };
    } else if (c->op == BW_REDUCE_SCATTER) {
        float *x = c->send;
        for (uint64_t i = 0; i < c->bytes / 4; i++)
            x[i] = rs_value(c->rank, i);
    } else if (c->op == BW_ALLTOALLV) {
        uint32_t *x = c->send;
        for (uint64_t i = 0; i < c->bytes / 4; i++)
            x[i] = ((uint32_t)c->rank << 24) ^ (uint32_t)i;
        for (int q = 0; q < c->ranks; q++) {
            c->vsend[q] = v_block(c->bytes / 4, c->ranks, c->rank, q);
            c->vrecv[q] = v_block(c->bytes / 4, c->ranks, q, c->rank);
        }
        c->a2av = (spc_alltoallv_desc_t){
            .struct_size = sizeof(spc_alltoallv_desc_t), .group = c->world, .dtype = SPC_F32, .send = c->send,
            .recv = c->recv, .send_counts = c->vsend, .recv_counts = c->vrecv, .timeout_ms = OP_TIMEOUT_MS,
        };
    } else {
        uint32_t *x = c->send;
        for (uint64_t i = 0; i < c->bytes / 4; i++)
            x[i] = ((uint32_t)c->rank << 24) ^ (uint32_t)i;
        c->shift = (spc_shift_desc_t){
            .struct_size = sizeof(spc_shift_desc_t),
            .group = c->world,
            .channel = 0,
            .flags = 0,
            .ntensors = 1,
            .timeout_ms = OP_TIMEOUT_MS,
        };
        c->shift.tensors[0].send = c->send;
        c->shift.tensors[0].recv = c->recv;
        c->shift.tensors[0].bytes = c->bytes;
    }
}

/* After the run: the last iteration's output must be what the op defines. */
static void bw_verify(const bw_rank_ctx_t *c)
{
    if (c->op == BW_ALLTOALL) {
        /* seq->head: this rank holds all S rows of heads [rank * H/P, (rank + 1) * H/P). */
        uint32_t P = (uint32_t)c->ranks, H = A2A_HEADS_PER_P * P, D = A2A_HEAD_DIM, hl = H / P;
        uint64_t S = c->bytes / a2a_row_bytes(c->ranks) * P;
        const float *y = c->recv;
        for (uint64_t s = 0; s < S; s++)
            for (uint32_t k = 0; k < hl; k++)
                for (uint32_t d = 0; d < D; d++) {
                    float want = a2a_value(s, (uint32_t)c->rank * hl + k, d), got = y[(s * hl + k) * D + d];
                    if (got != want) {
                        fprintf(stderr,
                                "spbench: alltoall %" PRIu64 " bytes, rank %d of %d: wrong output at row %" PRIu64
                                ", head %u, column %u: %g, want %g\n",
                                c->bytes, c->rank, c->ranks, s, k, d, (double)got, (double)want);
                        exit(1);
                    }
                }
    } else if (c->op == BW_REDUCE_SCATTER) {
        const uint64_t count = c->bytes / 4 / (uint64_t)c->ranks, base = (uint64_t)c->rank * count;
        const float *y = c->recv;
        for (uint64_t e = 0; e < count; e++) {
            float want = 0;
            for (int q = 0; q < c->ranks; q++)
                want += rs_value(q, base + e);
            if (y[e] != want) {
                fprintf(stderr, "spbench: reducescatter %" PRIu64 " bytes, rank %d of %d: wrong output at element %"
                        PRIu64 ": %g, want %g\n", c->bytes, c->rank, c->ranks, e, (double)y[e], (double)want);
                exit(1);
            }
        }
    } else if (c->op == BW_ALLTOALLV) {
        /* Block src: the words src sent this rank, from where its block to us starts in its send. */
        const uint32_t *y = c->recv;
        uint64_t at = 0;
        for (int src = 0; src < c->ranks; src++) {
            uint64_t from = 0;
            for (int q = 0; q < c->rank; q++)
                from += v_block(c->bytes / 4, c->ranks, src, q);
            for (uint64_t j = 0; j < c->vrecv[src]; j++, at++) {
                uint32_t want = ((uint32_t)src << 24) ^ (uint32_t)(from + j);
                if (y[at] != want) {
                    fprintf(stderr, "spbench: alltoallv %" PRIu64 " bytes, rank %d of %d: wrong output at word %"
                            PRIu64 " (from rank %d): 0x%08x, want 0x%08x\n", c->bytes, c->rank, c->ranks, at, src,
                            y[at], want);
                    exit(1);
                }
            }
        }
    } else {
        uint32_t from = (uint32_t)((c->rank + c->ranks - 1) % c->ranks);
        const uint32_t *y = c->recv;
        for (uint64_t i = 0; i < c->bytes / 4; i++) {
            uint32_t want = (from << 24) ^ (uint32_t)i;
            if (y[i] != want) {
                fprintf(stderr,
                        "spbench: shift %" PRIu64 " bytes, rank %d of %d: wrong output at word %" PRIu64
                        ": 0x%08x, want 0x%08x (rank %u's)\n",
                        c->bytes, c->rank, c->ranks, i, y[i], want, from);
                exit(1);
            }
        }
    }
}

/* One iteration: barrier, then the op. Returns the op's time on this rank; the
 * time from before the barrier goes to *wall_p. */
static double bw_iter(bw_rank_ctx_t *c, double *wall_p)
{
    double tb = now_us();
    spc_status_t st = spc_barrier(c->h, c->world, OP_TIMEOUT_MS);
    if (st != SPC_OK)
        rank_die(c, "barrier", st);
    double t0 = now_us();
    if (c->op == BW_ALLTOALL)
        st = spc_alltoall(c->h, &c->a2a, OP_TIMEOUT_MS);
    else if (c->op == BW_SHIFT)
        st = spc_shift(c->h, &c->shift, OP_TIMEOUT_MS);
    else if (c->op == BW_ALLTOALLV)
        st = spc_alltoallv(c->h, &c->a2av, OP_TIMEOUT_MS);
    else
        st = spc_reduce_scatter(c->h, c->world, c->send, c->recv, c->bytes / 4 / (uint64_t)c->ranks, SPC_F32,
                                SPC_SUM, OP_TIMEOUT_MS);
    double t1 = now_us();
    if (st != SPC_OK)
        rank_die(c, bw_name(c->op), st);
    if (wall_p != NULL)
        *wall_p = t1 - tb;
    return t1 - t0;
}

/* A forked rank: attach, join, allocate in the arena, warm up, choose K (rank
 * 0), time K iterations, check the output. Never returns. */
static void bw_rank(bw_rank_ctx_t *c, const char *job, bw_shared_t *sh)
{
    spc_attach_params_t ap = {
        .struct_size = sizeof ap,
        .socket_path = rank_socket(c->rank, c->ranks),
        .name = "spbench",
        .arena_bytes = bw_arena_bytes(c->bytes),
    };
    spc_status_t st = spc_attach(&ap, &c->h);
    if (st != SPC_OK)
        rank_die(c, "attach", st);
    if ((st = spc_job_join(c->h, job, (uint32_t)c->ranks, (uint32_t)c->rank, 30000, &c->world)) != SPC_OK)
        rank_die(c, "join", st);
    if (bw_registered) {
        spc_region_t rs, rr;
        c->send = mmap(NULL, c->bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        c->recv = mmap(NULL, c->bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (c->send == MAP_FAILED || c->recv == MAP_FAILED)
            rank_die(c, "mmap of send and recv", SPC_ERR_NO_MEMORY);
        if ((st = spc_register(c->h, c->send, c->bytes, &rs)) != SPC_OK ||
            (st = spc_register(c->h, c->recv, c->bytes, &rr)) != SPC_OK)
            rank_die(c, "spc_register of send and recv", st);
    } else {
        c->send = spc_alloc(c->h, c->bytes);
        c->recv = spc_alloc(c->h, c->bytes);
        if (c->send == NULL || c->recv == NULL)
            rank_die(c, "spc_alloc of send and recv", SPC_ERR_NO_MEMORY);
    }
    bw_prepare(c);

    double cal[CAL_ITERS];
    for (int i = 0; i < CAL_ITERS; i++)
        bw_iter(c, &cal[i]);
    if (c->rank == 0) {
        int k = c->fixed_iters;
        if (k == 0) {
            double want = ceil(TARGET_S * 1e6 / fmax(summarize(cal, CAL_ITERS).median_us, 0.01));
            k = want < MIN_ITERS ? MIN_ITERS : want > MAX_ITERS ? MAX_ITERS : (int)want;
        }
        sh->iters = k;
    }
    /* The barrier publishes rank 0's choice: its write precedes its submission,
     * which every other rank's completion follows. */
    if ((st = spc_barrier(c->h, c->world, OP_TIMEOUT_MS)) != SPC_OK)
        rank_die(c, "barrier", st);
    int iters = sh->iters;
    for (int i = 0; i < (iters / 10 < 500 ? iters / 10 : 500); i++)
        bw_iter(c, NULL);
    for (int i = 0; i < iters; i++)
        sh->samples[(size_t)c->rank * (size_t)sh->cap + (size_t)i] = bw_iter(c, NULL);
    bw_verify(c);
    spc_detach(c->h);
    exit(0);
}

/* One spd point: P forked ranks in a new job of `owner`'s daemon. */
static void bench_bw_spd(spc_handle_t *owner, bw_point_t *pt, int fixed_iters)
{
    char job[SPC_JOB_ID_MAX];
    spc_status_t st = spc_job_create(owner, job, sizeof job);
    if (st != SPC_OK)
        die("job create", st, owner);
    int cap = fixed_iters > MAX_ITERS ? fixed_iters : MAX_ITERS;
    size_t shbytes = sizeof(bw_shared_t) + (size_t)pt->ranks * (size_t)cap * sizeof(double);
    bw_shared_t *sh = mmap(NULL, shbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) {
        perror("spbench: mmap");
        exit(1);
    }
    sh->cap = cap;
    pid_t pids[MAX_RANKS];
    fflush(stdout);
    for (int r = 0; r < pt->ranks; r++) {
        pids[r] = fork();
        if (pids[r] == 0) {
            bw_rank_ctx_t c = { .op = pt->op, .bytes = pt->bytes, .ranks = pt->ranks, .rank = r,
                                .fixed_iters = fixed_iters };
            bw_rank(&c, job, sh);
        }
        if (pids[r] < 0) {
            perror("spbench: fork");
            exit(1);
        }
    }
    int failed = 0;
    for (int r = 0; r < pt->ranks; r++) {
        int status;
        waitpid(pids[r], &status, 0);
        failed |= !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    }
    if (failed) {
        fprintf(stderr, "spbench: %s of %" PRIu64 " bytes on %d ranks failed (see above)\n", bw_name(pt->op),
                pt->bytes, pt->ranks);
        exit(1);
    }
    /* An iteration takes as long as its slowest rank. */
    pt->iters = sh->iters;
    double *s = malloc((size_t)pt->iters * sizeof *s);
    for (int i = 0; i < pt->iters; i++) {
        s[i] = sh->samples[i];
        for (int r = 1; r < pt->ranks; r++)
            s[i] = fmax(s[i], sh->samples[(size_t)r * (size_t)cap + (size_t)i]);
    }
    pt->spd = summarize(s, pt->iters);
    free(s);
    munmap(sh, shbytes);
}

/* The OpenMPI point, timed the same way by spbench-mpi. */
static void bench_bw_mpi(bw_point_t *pt, int fixed_iters)
{
    char args[128];
    double v[4] = { 0, 0, 0, 0 };   /* bytes iters median_us p99_us */
    snprintf(args, sizeof args, "%s %" PRIu64 " %d %d", bw_name(pt->op), pt->bytes, fixed_iters, CAL_ITERS);
    char tag[32];
    snprintf(tag, sizeof tag, "mpi_%s", bw_name(pt->op));
    pt->peer_ok = run_mpi(pt->ranks, args, tag, v, 4, pt->peer_note, sizeof pt->peer_note);
    if (pt->peer_ok) {
        pt->peer_iters = (int)v[1];
        pt->peer = (stats_t){ .median_us = v[2], .p99_us = v[3], .n = (int)v[1] };
    }
}

/* The number of threads spd copies with, from its status; 1 when it does not say. */
static int spd_copy_threads(spc_handle_t *h, bool *reported_p)
{
    spc_query_result_t *q;
    int n = 1;
    *reported_p = false;
    if (spc_query(h, "status", "", &q) != SPC_OK)
        return n;
    long f = spc_query_records(q) > 0 ? spc_query_find(q, 0, "copy_threads") : -1;
    if (f >= 0 && spc_query_kind(q, 0, (size_t)f) == SPC_VALUE_INT) {
        int64_t v = spc_query_int(q, 0, (size_t)f);
        if (v >= 1 && v <= 1024) {
            n = (int)v;
            *reported_p = true;
        }
    }
    spc_query_free(q);
    return n;
}

/* ---------------------------------------------------------------- output */

static void bw_print_text_header(bw_op_t op, int threads, bool reported)
{
    printf("# %s: spd against %s (%s) and the memcpy bound: the P*N bytes spd %s,\n"
           "# copied by %d thread%s (%s). Times are medians of the slowest rank per iteration, in us;\n"
           "# bandwidths in GB/s (nccl-tests algbw/busbw); peer/spd > 1 means spd is faster;\n"
           "# spd/bound: 1 is the best spd can do (below 1 only by noise).\n",
           bw_name(op), bw_peer(op),
           op == BW_ALLTOALL ? "N/P bytes to each rank"
           : op == BW_SHIFT  ? "N bytes to rank+1 from rank-1"
           : op == BW_ALLTOALLV ? "N bytes in uneven blocks, the same"
                             : "N bytes of fp32 summed, N/P to each rank",
           op == BW_REDUCE_SCATTER ? "reads" : "writes", threads,
           threads == 1 ? "" : "s", reported ? "spd's copy_threads" : "spd does not report copy_threads");
    printf("%-13s %6s %5s %6s %10s %7s %7s %6s %10s %7s %8s %10s %4s %9s\n", "op", "bytes", "ranks", "iters",
           "spd_us", "algbw", "busbw", "p_iter", "peer_us", "p_busbw", "peer/spd", "bound_us", "thr", "spd/bound");
}

static void bw_print_text(const bw_point_t *p)
{
    char sz[32];
    fmt_size(p->bytes, sz, sizeof sz);
    printf("%-13s %6s %5d %6d %10.1f %7.2f %7.2f ", bw_name(p->op), sz, p->ranks, p->iters, p->spd.median_us,
           algbw(p->bytes, p->spd.median_us), busbw(p->op, p->ranks, p->bytes, p->spd.median_us));
    if (p->peer_ok)
        printf("%6d %10.1f %7.2f %7.2fx ", p->peer_iters, p->peer.median_us,
               busbw(p->op, p->ranks, p->bytes, p->peer.median_us), p->peer.median_us / p->spd.median_us);
    else
        printf("%6s %10s %7s %8s ", "-", "-", "-", "-");
    if (cluster.nnodes)
        printf("%10s %4s %9s\n", "-", "-", "-");
    else
        printf("%10.1f %4d %8.2fx\n", p->copy_bound_us, p->copy_threads, p->spd.median_us / p->copy_bound_us);
    if (!p->peer_ok)
        printf("#   peer unavailable: %s\n", p->peer_note);
}

/* The note may hold anything mpirun printed: keep it valid JSON. */
static void json_string(const char *s)
{
    putchar('"');
    for (; *s != '\0'; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            printf("\\%c", ch);
        else if (ch < 0x20)
            printf("\\u%04x", ch);
        else
            putchar(ch);
    }
    putchar('"');
}

static void bw_print_json(const bw_point_t *p, bool threads_reported)
{
    printf("{\"op\":\"%s\",\"bytes\":%" PRIu64 ",\"ranks\":%d,\"iters\":%d,\"timing\":\"median of max over ranks\","
           "\"spd_us\":%.3f,\"spd_p99_us\":%.3f,\"algbw_GBps\":%.3f,\"busbw_GBps\":%.3f,",
           bw_name(p->op), p->bytes, p->ranks, p->iters, p->spd.median_us, p->spd.p99_us,
           algbw(p->bytes, p->spd.median_us), busbw(p->op, p->ranks, p->bytes, p->spd.median_us));
    if (p->op == BW_ALLTOALL) {
        uint64_t H = (uint64_t)A2A_HEADS_PER_P * (uint64_t)p->ranks;
        printf("\"shape\":\"seq->head fp32 BSHD B=1 S=%" PRIu64 " H=%" PRIu64 " D=%u\",",
               p->bytes / a2a_row_bytes(p->ranks) * (uint64_t)p->ranks, H, A2A_HEAD_DIM);
    } else if (p->op == BW_SHIFT) {
        printf("\"shape\":\"1 tensor, cyclic, channel 0\",");
    } else if (p->op == BW_ALLTOALLV) {
        printf("\"shape\":\"fp32, block to rank+k a share k+1 of %" PRIu64 " elements\",", p->bytes / 4);
    } else {
        printf("\"shape\":\"fp32 sum, %" PRIu64 " elements to each rank\",", p->bytes / 4 / (uint64_t)p->ranks);
    }
    printf("\"peer\":\"%s\",", bw_peer(p->op));
    if (p->peer_ok)
        printf("\"peer_iters\":%d,\"peer_us\":%.3f,\"peer_p99_us\":%.3f,\"peer_busbw_GBps\":%.3f,"
               "\"ratio_vs_peer\":%.3f,",
               p->peer_iters, p->peer.median_us, p->peer.p99_us, busbw(p->op, p->ranks, p->bytes, p->peer.median_us),
               p->peer.median_us / p->spd.median_us);
    else {
        printf("\"peer_iters\":null,\"peer_us\":null,\"peer_p99_us\":null,\"peer_busbw_GBps\":null,"
               "\"ratio_vs_peer\":null,\"peer_note\":");
        json_string(p->peer_note);
        putchar(',');
    }
    if (cluster.nnodes) {
        printf("\"nodes\":%d,\"transport\":\"ucx %s\",\"copy_bound_us\":null}\n", cluster.nnodes,
               getenv("UCX_TLS") ? getenv("UCX_TLS") : "tcp");
        return;
    }
    printf("\"copy_bound_us\":%.3f,\"copy_bound_bytes\":%" PRIu64 ",\"copy_threads\":%d,"
           "\"copy_threads_from\":\"%s\",\"bound_ratio\":%.3f}\n",
           p->copy_bound_us, p->copy_bytes, p->copy_threads, threads_reported ? "daemon" : "default",
           p->spd.median_us / p->copy_bound_us);
}

/* ---------------------------------------------------------------- main */

/* "64K,1M,65536" into sizes[]; K, M and G are binary. Returns the count, or -1. */
static int parse_sizes(const char *arg, uint64_t *sizes, int cap)
{
    int n = 0;
    const char *p = arg;
    while (*p != '\0') {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(p, &end, 10);
        if (end == p || errno != 0 || n == cap)
            return -1;
        int shift = 0;
        if (*end == 'K' || *end == 'k')
            shift = 10;
        else if (*end == 'M' || *end == 'm')
            shift = 20;
        else if (*end == 'G' || *end == 'g')
            shift = 30;
        if (shift != 0)
            end++;
        if (v == 0 || v > (UINT64_C(1) << 40) >> shift || (*end != ',' && *end != '\0'))
            return -1;
        sizes[n++] = (uint64_t)v << shift;
        p = *end == ',' ? end + 1 : end;
    }
    return n;
}

static int parse_ranks(const char *arg, int *ranks, int cap)
{
    uint64_t v[MAX_SIZES];
    int n = parse_sizes(arg, v, cap < MAX_SIZES ? cap : MAX_SIZES);
    for (int i = 0; i < n; i++) {
        if (v[i] < 2 || v[i] > MAX_RANKS)
            return -1;
        ranks[i] = (int)v[i];
    }
    return n;
}

static int main_bandwidth(int argc, char **argv)
{
    bw_op_t op = strcmp(argv[1], "alltoall") == 0  ? BW_ALLTOALL
               : strcmp(argv[1], "shift") == 0     ? BW_SHIFT
               : strcmp(argv[1], "alltoallv") == 0 ? BW_ALLTOALLV
                                                   : BW_REDUCE_SCATTER;
    uint64_t sizes[MAX_SIZES] = { 64u << 10, 256u << 10, 1u << 20, 4u << 20, 16u << 20, 64u << 20 };
    int nsizes = 6, ranks[MAX_SIZES] = { 2 }, nranks = 1, iters = 0, nodes = 1;
    bool json = false;
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "--ranks") == 0 && i + 1 < argc) {
            if ((nranks = parse_ranks(argv[++i], ranks, MAX_SIZES)) <= 0) {
                fprintf(stderr, "spbench: --ranks wants a comma list of rank counts in [2, %d]\n", MAX_RANKS);
                return 2;
            }
        } else if (strcmp(argv[i], "--sizes") == 0 && i + 1 < argc) {
            if ((nsizes = parse_sizes(argv[++i], sizes, MAX_SIZES)) <= 0) {
                fprintf(stderr, "spbench: --sizes wants a comma list of byte counts (64K, 1M, 65536, ...)\n");
                return 2;
            }
        } else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
            if ((iters = atoi(argv[++i])) < 1) {
                fprintf(stderr, "spbench: --iters wants a positive count\n");
                return 2;
            }
        } else if (strcmp(argv[i], "--nodes") == 0 && i + 1 < argc) {
            if ((nodes = atoi(argv[++i])) < 1 || nodes > MAX_NODES) {
                fprintf(stderr, "spbench: --nodes wants a count in [1, %d]\n", MAX_NODES);
                return 2;
            }
        } else if (strcmp(argv[i], "--registered") == 0) {
            bw_registered = true;
        } else if (strcmp(argv[i], "--json") == 0) {
            json = true;
        } else {
            usage(stderr);
            return 2;
        }
    }
    for (int j = 0; j < nranks && nodes > 1; j++) {
        if (ranks[j] < nodes) {
            fprintf(stderr, "spbench: %d ranks cannot cover %d nodes\n", ranks[j], nodes);
            return 2;
        }
    }

    /* Refuse every bad point before measuring any. */
    uint64_t max_bytes = 0;
    for (int k = 0; k < nsizes; k++) {
        max_bytes = sizes[k] > max_bytes ? sizes[k] : max_bytes;
        for (int j = 0; j < nranks; j++) {
            if (op == BW_ALLTOALL && sizes[k] % a2a_row_bytes(ranks[j]) != 0) {
                fprintf(stderr,
                        "spbench: alltoall of %" PRIu64 " bytes on %d ranks: the per-rank tensor [1, S_loc, H=%u, "
                        "D=%u] fp32 needs a multiple of %" PRIu64 " bytes\n",
                        sizes[k], ranks[j], A2A_HEADS_PER_P * (unsigned)ranks[j], A2A_HEAD_DIM,
                        a2a_row_bytes(ranks[j]));
                return 2;
            }
            if ((op == BW_SHIFT || op == BW_ALLTOALLV) && sizes[k] % 4 != 0) {
                fprintf(stderr, "spbench: %s of %" PRIu64 " bytes: need a multiple of 4\n", bw_name(op), sizes[k]);
                return 2;
            }
            if (op == BW_REDUCE_SCATTER && sizes[k] % (4 * (uint64_t)ranks[j]) != 0) {
                fprintf(stderr, "spbench: reducescatter of %" PRIu64 " bytes on %d ranks: need a multiple of %d "
                        "(fp32, a block per rank)\n", sizes[k], ranks[j], 4 * ranks[j]);
                return 2;
            }
        }
    }

    if (nodes > 1) {
        cluster_start(nodes, bw_arena_bytes(max_bytes) + (1u << 20));
        atexit(cluster_stop);
        mpi_btl = "tcp,self";
    }
    /* This handle creates the jobs. It asks for the largest arena a rank will
     * ask for, so that a daemon that would refuse it says so now. */
    spc_attach_params_t ap = { .struct_size = sizeof ap, .socket_path = rank_socket(0, 1), .name = "spbench",
                               .arena_bytes = bw_arena_bytes(max_bytes) };
    spc_handle_t *owner;
    spc_status_t st = spc_attach(&ap, &owner);
    if (st == SPC_ERR_LIMIT) {
        fprintf(stderr,
                "spbench: spd refused an arena of %" PRIu64 " bytes (%s). Each rank needs 2 x %" PRIu64
                " + %u bytes: start spd with --set max_arena_bytes=%" PRIu64 "M (or SPD_MAX_ARENA_BYTES) or more, "
                "or pass smaller --sizes.\n",
                ap.arena_bytes, spc_last_error(NULL), max_bytes, ARENA_SLACK, (ap.arena_bytes + (1u << 20) - 1) >> 20);
        return 1;
    }
    if (st != SPC_OK)
        die("attach (is spd running? set SPC_SOCKET)", st, NULL);
    bool reported;
    int threads = spd_copy_threads(owner, &reported);

    if (!json) {
        bw_print_text_header(op, threads, reported);
        if (bw_registered)
            printf("# spd's side: registered host memory (spc_register), not the arena\n");
    }
    for (int j = 0; j < nranks; j++) {
        for (int k = 0; k < nsizes; k++) {
            bw_point_t pt = { .op = op, .bytes = sizes[k], .ranks = ranks[j], .copy_threads = threads };
            /* Alltoall and shift write P*N bytes in all (every rank receives N);
             * a reduce-scatter reads them (every rank's N). */
            pt.copy_bytes = (uint64_t)pt.ranks * pt.bytes;
            /* The bound is taken right before and right after the spd point, and
             * the faster is kept: a bound slowed by a burst of other work on the
             * machine would flatter spd. */
            double before = nodes > 1 ? 0 : copy_bound_us(pt.copy_bytes, threads);
            bench_bw_spd(owner, &pt, iters);
            pt.copy_bound_us = nodes > 1 ? 0 : fmin(before, copy_bound_us(pt.copy_bytes, threads));
            bench_bw_mpi(&pt, iters);
            if (json)
                bw_print_json(&pt, reported);
            else
                bw_print_text(&pt);
            fflush(stdout);
        }
    }
    spc_detach(owner);
    return 0;
}
