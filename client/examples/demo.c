/*
 * spdemo — a small sequence-parallel job through spd.
 *
 *   spdemo [--ranks N] [--count K]
 *
 * The parent attaches and creates a job; it forks N rank processes, each of which
 * attaches on its own, joins the job and arranges the ranks in a mesh (Ulysses
 * pairs, rings across them). Each rank then does what a training step of
 * DeepSpeed-Ulysses plus Ring-Attention asks of spd, and checks every result
 * against values computed here by hand:
 *
 *   1. Ulysses: q, k, v, sequence-sharded, go head-sharded in one all-to-all
 *      (8 query heads, 2 KV heads: replicated where a rank needs them) and back;
 *   2. Ring: a K/V block goes round the ring, one shift per step;
 *   3. the loss: (loss sum, token count) summed over the world.
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

enum { HEADS = 8, KV_HEADS = 2, DIM = 16, ROWS = 4 };   /* ROWS: sequence rows per rank */

/* The value of element (row, head, d) of tensor `which` (0 q, 1 k, 2 v) of the
 * Ulysses group's sequence: every rank can compute any of it. */
static float value(int which, int row, int head, int d)
{
    return (float)(which * 100000 + row * 1000 + head * 10 + d % 10);
}

/* Ulysses: seq->head and back on the mesh's Ulysses group. Returns mistakes. */
static int ulysses_step(spc_handle_t *h, const spc_mesh_t *m, int rank)
{
    const int U = (int)m->ulysses, S = ROWS * U, heads[3] = { HEADS, KV_HEADS, KV_HEADS };
    spc_alltoall_desc_t d = { .struct_size = sizeof d, .group = m->ulysses_group, .dtype = SPC_F32,
                              .direction = SPC_SEQ_TO_HEAD, .layout = SPC_LAYOUT_BSHD, .batch = 1,
                              .seq_len = (uint32_t)S, .kv_heads = KV_HEADS, .ntensors = 3 };
    float *seq[3], *hd[3], *back[3];
    uint32_t local[3];
    for (int t = 0; t < 3; t++) {
        uint32_t kind = t == 0 ? SPC_HEADS_Q : SPC_HEADS_KV;
        local[t] = spc_a2a_local_heads((uint32_t)heads[t], kind, KV_HEADS, (uint32_t)U);
        seq[t] = spc_alloc(h, sizeof(float) * ROWS * heads[t] * DIM);
        hd[t] = spc_alloc(h, sizeof(float) * S * local[t] * DIM);
        back[t] = spc_alloc(h, sizeof(float) * ROWS * heads[t] * DIM);
        if (!seq[t] || !hd[t] || !back[t]) {
            fprintf(stderr, "rank %d: arena full\n", rank);
            exit(1);
        }
        for (int r = 0; r < ROWS; r++)   /* this rank's rows of the group's sequence */
            for (int x = 0; x < heads[t]; x++)
                for (int e = 0; e < DIM; e++)
                    seq[t][(r * heads[t] + x) * DIM + e] = value(t, (int)m->ulysses_rank * ROWS + r, x, e);
        d.tensors[t] = (spc_a2a_tensor_t){ .send = seq[t], .recv = hd[t], .heads = (uint32_t)heads[t],
                                          .head_dim = DIM, .kind = kind };
    }
    CHECK(spc_alltoall(h, &d, 30000));

    /* Now every row, a slice of the heads: query heads [j*8/U, ...), and for each
     * query head the KV head of its group (heads 0-3 use KV 0, 4-7 KV 1). */
    int bad = 0;
    for (int t = 0; t < 3; t++) {
        for (int r = 0; r < S; r++)
            for (uint32_t k = 0; k < local[t]; k++) {
                int head = t == 0 ? (int)(m->ulysses_rank * local[0] + k)
                                  : (int)(m->ulysses_rank * local[0]) / (HEADS / KV_HEADS) + (int)k;
                for (int e = 0; e < DIM; e++)
                    bad += hd[t][(r * (int)local[t] + (int)k) * DIM + e] != value(t, r, head, e);
            }
        d.tensors[t] = (spc_a2a_tensor_t){ .send = hd[t], .recv = back[t], .heads = (uint32_t)heads[t],
                                          .head_dim = DIM, .kind = t == 0 ? SPC_HEADS_Q : SPC_HEADS_KV };
    }
    d.direction = SPC_HEAD_TO_SEQ;   /* attention output goes back to sequence shards */
    CHECK(spc_alltoall(h, &d, 30000));
    for (int t = 0; t < 3; t++) {
        bad += memcmp(back[t], seq[t], sizeof(float) * ROWS * heads[t] * DIM) != 0;
        spc_free(h, seq[t]);
        spc_free(h, hd[t]);
        spc_free(h, back[t]);
    }
    return bad;
}

/* Ring: a block goes round the ring group; after step s a rank holds the block
 * of ring rank - s. The next step's shift is in flight while this one is checked. */
static int ring_step(spc_handle_t *h, const spc_mesh_t *m, int rank, int count)
{
    const int R = (int)m->ring;
    double *buf[2] = { spc_alloc(h, (size_t)count * sizeof(double)), spc_alloc(h, (size_t)count * sizeof(double)) };
    if (!buf[0] || !buf[1]) {
        fprintf(stderr, "rank %d: arena full\n", rank);
        exit(1);
    }
    for (int i = 0; i < count; i++)
        buf[0][i] = m->ring_rank * 1e6 + i;
    int bad = 0;
    for (int s = 1; s < R; s++) {
        spc_shift_desc_t d = { .struct_size = sizeof d, .group = m->ring_group, .channel = 0, .ntensors = 1 };
        d.tensors[0].send = buf[(s - 1) % 2];
        d.tensors[0].recv = buf[s % 2];
        d.tensors[0].bytes = (uint64_t)count * sizeof(double);
        spc_request_t *req;
        CHECK(spc_ishift(h, &d, &req));
        /* ... attention on the block in hand would run here ... */
        CHECK(spc_wait(req, 30000));
        spc_request_release(req);
        int from = ((int)m->ring_rank - s + R) % R;
        for (int i = 0; i < count; i++)
            bad += buf[s % 2][i] != from * 1e6 + i;
    }
    spc_free(h, buf[0]);
    spc_free(h, buf[1]);
    return bad;
}

static int run_rank(const char *job_id, int nranks, int rank, int count)
{
    spc_handle_t *h = NULL;
    spc_group_t world;
    spc_mesh_t m;

    CHECK(spc_attach(NULL, &h));
    CHECK(spc_job_join(h, job_id, (uint32_t)nranks, (uint32_t)rank, 30000, &world));
    /* Ulysses pairs with rings across them when the ranks allow; spd chooses otherwise. */
    spc_mesh_spec_t spec = { .struct_size = sizeof spec, .sp = (uint32_t)nranks, .heads = HEADS,
                             .kv_heads = KV_HEADS, .ulysses = nranks % 2 == 0 && nranks > 2 ? 2 : 0 };
    CHECK(spc_mesh_create(h, &spec, &m));
    if (rank == 0)
        printf("mesh: %s\n", m.explain);
    fflush(stdout);
    CHECK(spc_barrier(h, world, 30000));

    int bad_u = ulysses_step(h, &m, rank);
    int bad_r = ring_step(h, &m, rank, count);

    /* The token-weighted loss: sum (loss, tokens) over the world; rank r has r+1 tokens of loss 0.5. */
    double *loss = spc_alloc(h, 2 * sizeof *loss);
    loss[0] = 0.5 * (rank + 1);
    loss[1] = rank + 1;
    CHECK(spc_allreduce(h, world, loss, loss, 2, SPC_F64, SPC_SUM, 30000));
    int bad_l = loss[0] / loss[1] != 0.5;

    printf("rank %d (pid %d; ulysses %u of %u, ring %u of %u): ulysses all-to-all %s, ring shift x%u %s, "
           "loss %.3f %s\n", rank, (int)getpid(), m.ulysses_rank, m.ulysses, m.ring_rank, m.ring, bad_u ? "WRONG" : "ok",
           m.ring - 1, bad_r ? "WRONG" : "ok", loss[0] / loss[1], bad_l ? "WRONG" : "ok");
    fflush(stdout);
    CHECK(spc_barrier(h, world, 30000));
    spc_free(h, loss);
    spc_detach(h);
    return bad_u || bad_r || bad_l ? 1 : 0;
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
