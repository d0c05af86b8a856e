/*
 * spbench-mpi — the MPI peer of spbench, run by it under mpirun.
 *
 *   spbench-mpi allreduce8 ITERS WARMUP
 *   spbench-mpi alltoall BYTES ITERS WARMUP
 *   spbench-mpi shift BYTES ITERS WARMUP
 *   spbench-mpi reducescatter BYTES ITERS WARMUP
 *   spbench-mpi alltoallv BYTES ITERS WARMUP
 *   spbench-mpi ITERS WARMUP                  (old form of allreduce8)
 *
 * allreduce8: times each 8-byte MPI_Allreduce on rank 0 and prints
 * "mpi_allreduce8 <median_us> <p99_us>".
 *
 * alltoall: MPI_Alltoall of BYTES / P bytes to each destination, so that every
 * rank sends BYTES and receives BYTES. shift: MPI_Sendrecv of BYTES to rank + 1
 * and from rank - 1, around the ring. reducescatter: MPI_Reduce_scatter_block
 * of BYTES of fp32 per rank, summed, BYTES / P to each rank. alltoallv:
 * MPI_Alltoallv of BYTES of fp32 per rank in spbench's uneven blocks (v_block).
 * All are timed the way spbench times spd:
 * a barrier before each iteration, each rank times its own op, an iteration
 * counts as the slowest rank's time, and the median and 99th percentile over
 * ITERS iterations are printed by rank 0 as
 * "mpi_<op> <bytes> <iters> <median_us> <p99_us>".
 *
 * ITERS 0 means "choose": after WARMUP (at least CAL_ITERS) iterations rank 0
 * takes the median time of one iteration, barrier included, and picks enough
 * iterations for about TARGET_S seconds, clamped to [MIN_ITERS, MAX_ITERS];
 * then ITERS / 10 (at most 500) more warm-up iterations run. The constants and
 * this rule are the same in spbench.c: keep them in step.
 */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CAL_ITERS 5
#define TARGET_S  0.3
#define MIN_ITERS 10
#define MAX_ITERS 10000

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Sorts s and writes its median and 99th percentile. */
static void summarize(double *s, int n, double *median_p, double *p99_p)
{
    qsort(s, (size_t)n, sizeof *s, cmp_double);
    *median_p = n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
    int k = (int)ceil(0.99 * n) - 1;
    *p99_p = s[k < 0 ? 0 : k];
}

static int allreduce8(int rank, int iters, int warmup)
{
    double *s = malloc((size_t)iters * sizeof *s);
    double x, y;

    MPI_Barrier(MPI_COMM_WORLD);
    for (int i = 0; i < warmup + iters; i++) {
        x = rank + i;
        double t0 = MPI_Wtime();
        MPI_Allreduce(&x, &y, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
        if (i >= warmup)
            s[i - warmup] = (MPI_Wtime() - t0) * 1e6;
    }
    if (rank == 0) {
        double median, p99;
        summarize(s, iters, &median, &p99);
        printf("mpi_allreduce8 %.3f %.3f\n", median, p99);
    }
    free(s);
    return 0;
}

typedef enum { OP_ALLTOALL, OP_SHIFT, OP_REDUCE_SCATTER, OP_ALLTOALLV } bw_op_t;

/* alltoallv's elements from rank src to rank dst, of E per rank: spbench.c's
 * v_block, the same uneven blocks spd moves. */
static size_t v_block(size_t E, int P, int src, int dst)
{
    const size_t W = (size_t)P * (size_t)(P + 1) / 2, k = (size_t)((dst - src + P) % P);
    if (k != 0)
        return E * (k + 1) / W;
    size_t rest = E;
    for (size_t j = 1; j < (size_t)P; j++)
        rest -= E * (j + 1) / W;
    return rest;
}

/* MPI_Alltoallv of fp32 in those blocks, packed in rank order on both sides. */
static void alltoallv(const char *send, char *recv, size_t bytes, int rank, int size)
{
    int *sc = malloc(4 * (size_t)size * sizeof *sc), *sd = sc + size, *rc = sd + size, *rd = rc + size;
    if (sc == NULL)
        MPI_Abort(MPI_COMM_WORLD, 1);
    for (int q = 0, s = 0, r = 0; q < size; q++) {
        sc[q] = (int)v_block(bytes / 4, size, rank, q);
        rc[q] = (int)v_block(bytes / 4, size, q, rank);
        sd[q] = s;
        rd[q] = r;
        s += sc[q];
        r += rc[q];
    }
    MPI_Alltoallv(send, sc, sd, MPI_FLOAT, recv, rc, rd, MPI_FLOAT, MPI_COMM_WORLD);
    free(sc);
}

static void run_op(bw_op_t op, const char *send, char *recv, size_t bytes, int rank, int size)
{
    if (op == OP_ALLTOALL) {
        MPI_Alltoall(send, (int)(bytes / (size_t)size), MPI_BYTE, recv, (int)(bytes / (size_t)size), MPI_BYTE,
                     MPI_COMM_WORLD);
    } else if (op == OP_ALLTOALLV) {
        alltoallv(send, recv, bytes, rank, size);
    } else if (op == OP_REDUCE_SCATTER) {
        MPI_Reduce_scatter_block(send, recv, (int)(bytes / sizeof(float) / (size_t)size), MPI_FLOAT, MPI_SUM,
                                 MPI_COMM_WORLD);
    } else {
        int to = (rank + 1) % size, from = (rank + size - 1) % size;
        MPI_Sendrecv(send, (int)bytes, MPI_BYTE, to, 0, recv, (int)bytes, MPI_BYTE, from, 0, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
    }
}

/* One iteration: barrier, then this rank's time of the op in microseconds.
 * *wall_p gets the time from before the barrier (what calibration sizes). */
static double timed_iter(bw_op_t op, const char *send, char *recv, size_t bytes, int rank, int size,
                         double *wall_p)
{
    double tb = MPI_Wtime();
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    run_op(op, send, recv, bytes, rank, size);
    double t1 = MPI_Wtime();
    if (wall_p != NULL)
        *wall_p = (t1 - tb) * 1e6;
    return (t1 - t0) * 1e6;
}

static int bandwidth(bw_op_t op, const char *name, size_t bytes, int iters, int warmup, int rank, int size)
{
    const size_t unit = op == OP_ALLTOALL           ? (size_t)size
                      : op == OP_REDUCE_SCATTER   ? sizeof(float) * (size_t)size
                      : op == OP_ALLTOALLV        ? sizeof(float)
                                                  : 1;
    if (bytes == 0 || bytes > INT32_MAX || bytes % unit != 0) {
        if (rank == 0)
            fprintf(stderr, "spbench-mpi: %s: %zu bytes is not a positive multiple of %zu below 2 GiB\n", name,
                    bytes, unit);
        return 2;
    }
    char *send = malloc(bytes), *recv = malloc(bytes);
    if (send == NULL || recv == NULL) {
        fprintf(stderr, "spbench-mpi: rank %d: out of memory for 2 x %zu bytes\n", rank, bytes);
        MPI_Abort(MPI_COMM_WORLD, 1);   /* the other ranks would wait for this one forever */
    }
    memset(send, op == OP_REDUCE_SCATTER ? 0 : rank + 1, bytes);   /* touch every page before timing (fp32 zeros: sums stay finite) */
    memset(recv, 0, bytes);

    /* Warm-up and calibration. */
    if (warmup < CAL_ITERS)
        warmup = CAL_ITERS;
    double *cal = malloc((size_t)warmup * sizeof *cal);
    for (int i = 0; i < warmup; i++)
        timed_iter(op, send, recv, bytes, rank, size, &cal[i]);
    if (iters <= 0) {
        double median, p99;
        summarize(cal, warmup, &median, &p99);
        double want = ceil(TARGET_S * 1e6 / (median > 0 ? median : 1));
        iters = want < MIN_ITERS ? MIN_ITERS : want > MAX_ITERS ? MAX_ITERS : (int)want;
        MPI_Bcast(&iters, 1, MPI_INT, 0, MPI_COMM_WORLD);
    }
    free(cal);
    int extra = iters / 10 < 500 ? iters / 10 : 500;
    for (int i = 0; i < extra; i++)
        timed_iter(op, send, recv, bytes, rank, size, NULL);

    double *s = malloc((size_t)iters * sizeof *s), *smax = malloc((size_t)iters * sizeof *smax);
    for (int i = 0; i < iters; i++)
        s[i] = timed_iter(op, send, recv, bytes, rank, size, NULL);
    /* An iteration takes as long as its slowest rank. */
    MPI_Reduce(s, smax, iters, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        double median, p99;
        summarize(smax, iters, &median, &p99);
        printf("mpi_%s %zu %d %.3f %.3f\n", name, bytes, iters, median, p99);
    }
    free(s);
    free(smax);
    free(send);
    free(recv);
    return 0;
}

static void usage(void)
{
    fprintf(stderr, "usage: spbench-mpi allreduce8 ITERS WARMUP\n"
                    "       spbench-mpi alltoall|shift|reducescatter|alltoallv BYTES ITERS(0: choose) WARMUP\n");
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank, size, rc;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);

    const char *mode = argc > 1 ? argv[1] : "allreduce8";
    if (strcmp(mode, "allreduce8") == 0)
        rc = allreduce8(rank, argc > 2 ? atoi(argv[2]) : 10000, argc > 3 ? atoi(argv[3]) : 1000);
    else if ((strcmp(mode, "alltoall") == 0 || strcmp(mode, "shift") == 0 || strcmp(mode, "reducescatter") == 0 ||
              strcmp(mode, "alltoallv") == 0) && argc == 5)
        rc = bandwidth(strcmp(mode, "alltoall") == 0    ? OP_ALLTOALL
                       : strcmp(mode, "shift") == 0     ? OP_SHIFT
                       : strcmp(mode, "alltoallv") == 0 ? OP_ALLTOALLV
                                                        : OP_REDUCE_SCATTER,
                       mode, (size_t)strtoull(argv[2], NULL, 10), atoi(argv[3]), atoi(argv[4]), rank, size);
    else if (mode[0] >= '0' && mode[0] <= '9')   /* the old form: ITERS WARMUP */
        rc = allreduce8(rank, atoi(argv[1]), argc > 2 ? atoi(argv[2]) : 1000);
    else {
        if (rank == 0)
            usage();
        rc = 2;
    }
    MPI_Finalize();
    return rc;
}
