/*
 * spbench — spd's benchmark. Every figure is printed beside a peer measured in
 * the same run, on the same machine, with the ratio peer time / spd time.
 *
 *   spbench latency [--ranks N] [--iters K] [--json]
 *
 * latency: the no-op round trip through spd (one client), against a ping-pong of
 * 8 bytes over a Unix socket between two processes (what a socket-based daemon
 * pays per request); and the 8-byte allreduce across N ranks (default 2),
 * against OpenMPI's MPI_Allreduce of 8 bytes on N ranks. Each op is timed on its
 * own; medians and 99th percentiles over K ops (default 10000) after a warm-up.
 *
 * spbench talks to the spd at $SPC_SOCKET (or the default socket).
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "spclient/spclient.h"

#define WARMUP 1000

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

/* Runs the MPI helper under mpirun; it prints "median_us p99_us" for rank 0. */
static bool bench_mpi_allreduce(int ranks, int iters, stats_t *out, char *note, size_t notelen)
{
#ifdef SPBENCH_MPI
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=self,vader "
             "'%s' -np %d --oversubscribe '%s' %d %d 2>&1",
             SPBENCH_MPIRUN, ranks, SPBENCH_MPI, iters, WARMUP);
    fflush(stdout);
    FILE *p = popen(cmd, "r");
    if (p == NULL) {
        snprintf(note, notelen, "cannot run mpirun");
        return false;
    }
    char line[512], last[512] = "";
    bool ok = false;
    while (fgets(line, sizeof line, p) != NULL) {
        if (sscanf(line, "mpi_allreduce8 %lf %lf", &out->median_us, &out->p99_us) == 2)
            ok = true;
        else
            snprintf(last, sizeof last, "%s", line);
    }
    int rc = pclose(p);
    if (!ok || rc != 0) {
        last[strcspn(last, "\n")] = '\0';
        snprintf(note, notelen, "mpirun failed: %s", last);
        return false;
    }
    out->n = iters;
    return true;
#else
    (void)ranks;
    (void)iters;
    (void)out;
    snprintf(note, notelen, "built without MPI (install libopenmpi-dev)");
    return false;
#endif
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

static void usage(FILE *out)
{
    fprintf(out, "usage: spbench latency [--ranks N] [--iters K] [--json]\n"
                 "  Measures against the spd at $SPC_SOCKET (default %s).\n",
            spc_socket_path(NULL));
}

int main(int argc, char **argv)
{
    int ranks = 2, iters = 10000, json = 0;
    if (argc < 2 || strcmp(argv[1], "latency") != 0) {
        usage(argc < 2 || strcmp(argv[1], "--help") ? stderr : stdout);
        return argc < 2 || strcmp(argv[1], "--help") ? 2 : 0;
    }
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
