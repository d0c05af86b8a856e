/*
 * A trainer that knows only the installed spd: built by tests/deploy/test_install.sh
 * against an installed tree (through pkg-config and through find_package), it
 * runs a job of two rank processes on the spd at $SPC_SOCKET. Each all-reduces
 * N doubles, rank r holding (r + 1) * i at i, and checks that every element
 * is the sum, 3 * i.
 */
#include <spclient/spclient.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define N 4096

static int rank_main(const char *job, uint32_t rank)
{
    spc_handle_t *h;
    spc_group_t world;
    if (spc_attach(NULL, &h) != SPC_OK || spc_job_join(h, job, 2, rank, 10000, &world) != SPC_OK) {
        fprintf(stderr, "rank %u: %s\n", rank, spc_last_error(NULL));
        return 1;
    }
    double *x = spc_alloc(h, N * sizeof *x);
    if (x == NULL)
        return 1;
    for (int i = 0; i < N; i++)
        x[i] = (double)(rank + 1) * i;
    spc_status_t st = spc_allreduce(h, world, x, x, N, SPC_F64, SPC_SUM, 10000);
    if (st != SPC_OK) {
        fprintf(stderr, "rank %u: %s: %s\n", rank, spc_status_name(st), spc_last_error(h));
        return 1;
    }
    for (int i = 0; i < N; i++)
        if (x[i] != 3.0 * i) {
            fprintf(stderr, "rank %u: x[%d] = %g, not %g\n", rank, i, x[i], 3.0 * i);
            return 1;
        }
    spc_detach(h);
    return 0;
}

int main(void)
{
    spc_handle_t *owner;
    char job[SPC_JOB_ID_MAX];
    if (spc_attach(NULL, &owner) != SPC_OK || spc_job_create(owner, job, sizeof job) != SPC_OK) {
        fprintf(stderr, "no job: %s\n", spc_last_error(NULL));
        return 1;
    }
    pid_t pid[2];
    for (uint32_t r = 0; r < 2; r++)
        if ((pid[r] = fork()) == 0)
            _exit(rank_main(job, r));
    int failed = 0;
    for (int r = 0; r < 2; r++) {
        int status;
        failed |= waitpid(pid[r], &status, 0) != pid[r] || !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    }
    spc_detach(owner);
    if (failed)
        return 1;
    printf("2 ranks all-reduced %d doubles through spd: every sum right\n", N);
    return 0;
}
