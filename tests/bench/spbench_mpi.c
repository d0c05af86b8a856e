/*
 * spbench-mpi — the MPI peer of spbench, run by it under mpirun.
 *
 *   spbench-mpi ITERS WARMUP
 *
 * Times each 8-byte MPI_Allreduce on rank 0 and prints
 * "mpi_allreduce8 <median_us> <p99_us>", the same statistics spbench takes of spd.
 */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv)
{
    MPI_Init(&argc, &argv);
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    int iters = argc > 1 ? atoi(argv[1]) : 10000;
    int warmup = argc > 2 ? atoi(argv[2]) : 1000;
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
        qsort(s, (size_t)iters, sizeof *s, cmp_double);
        double median = iters % 2 ? s[iters / 2] : (s[iters / 2 - 1] + s[iters / 2]) / 2;
        int k = (int)ceil(0.99 * iters) - 1;
        printf("mpi_allreduce8 %.3f %.3f\n", median, s[k < 0 ? 0 : k]);
    }
    free(s);
    MPI_Finalize();
    return 0;
}
