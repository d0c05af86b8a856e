/*
 * spdemo — a small multi-rank job through spd.
 *
 *   spdemo [--ranks N] [--count K]
 *
 * The parent attaches and creates a job; it forks N rank processes, each of which
 * attaches on its own, joins the job, meets the others in a barrier, and sums a
 * vector across ranks with an allreduce in the shared arena. Every rank checks
 * its result against the sum computed here by hand.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "spclient/spclient.h"

#define CHECK(call)                                                                            \
    do {                                                                                       \
        spc_status_t st_ = (call);                                                             \
        if (st_ != SPC_OK) {                                                                   \
            fprintf(stderr, "rank %d: %s failed: %s: %s\n", rank, #call, spc_status_name(st_), \
                    spc_last_error(h));                                                        \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

static int run_rank(const char *job_id, int nranks, int rank, int count)
{
    spc_handle_t *h = NULL;
    spc_group_t world;

    CHECK(spc_attach(NULL, &h));
    CHECK(spc_job_join(h, job_id, (uint32_t)nranks, (uint32_t)rank, 30000, &world));
    CHECK(spc_barrier(h, world, 30000));

    /* Rank r contributes x[i] = (r + 1) * (i + 1). */
    double *x = spc_alloc(h, (size_t)count * sizeof *x);
    if (x == NULL) {
        fprintf(stderr, "rank %d: spc_alloc: %s\n", rank, spc_last_error(h));
        return 1;
    }
    for (int i = 0; i < count; i++)
        x[i] = (double)(rank + 1) * (i + 1);
    CHECK(spc_allreduce(h, world, x, x, (uint64_t)count, SPC_F64, SPC_SUM, 30000));

    int bad = 0;
    double ranks_sum = nranks * (nranks + 1) / 2.0;
    for (int i = 0; i < count; i++)
        bad += x[i] != ranks_sum * (i + 1);
    printf("rank %d of %d (pid %d): barrier ok; allreduce of %d doubles: x[0] = %g, x[%d] = %g -> %s\n", rank,
           nranks, (int)getpid(), count, x[0], count - 1, x[count - 1], bad ? "WRONG" : "ok");
    fflush(stdout);
    CHECK(spc_barrier(h, world, 30000));
    spc_free(h, x);
    spc_detach(h);
    return bad ? 1 : 0;
}

int main(int argc, char **argv)
{
    int nranks = 4, count = 1024, rank = -1;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--ranks") == 0 && i + 1 < argc)
            nranks = atoi(argv[++i]);
        else if (strcmp(argv[i], "--count") == 0 && i + 1 < argc)
            count = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: spdemo [--ranks N] [--count K]\n");
            return 2;
        }
    }
    if (nranks < 1 || count < 1)
        return 2;

    spc_handle_t *h = NULL;
    char job_id[SPC_JOB_ID_MAX];
    CHECK(spc_attach(NULL, &h));
    CHECK(spc_job_create(h, job_id, sizeof job_id));
    printf("spd %s (pid %d) at %s; job %s with %d ranks\n", spc_daemon_version(h), spc_daemon_pid(h),
           spc_socket_path(h), job_id, nranks);
    fflush(stdout);

    pid_t *pids = calloc((size_t)nranks, sizeof *pids);
    for (int r = 0; r < nranks; r++) {
        pids[r] = fork();
        if (pids[r] == 0)
            _exit(run_rank(job_id, nranks, r, count));
    }
    int failed = 0;
    for (int r = 0; r < nranks; r++) {
        int status;
        waitpid(pids[r], &status, 0);
        failed += !WIFEXITED(status) || WEXITSTATUS(status) != 0;
    }
    free(pids);
    spc_detach(h);
    printf("%s: %d of %d ranks ok\n", failed ? "FAILED" : "done", nranks - failed, nranks);
    return failed ? 1 : 0;
}
