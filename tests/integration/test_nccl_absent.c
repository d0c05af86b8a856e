/*
 * Device ops across daemons where they cannot run, as in CI (no GPU) or on a
 * node without NCCL: two daemons on loopback, both told to load an NCCL
 * library that is not there (SPD_NCCL_LIBRARY, the nccl_library option).
 *
 *   - spctl status says on each daemon, naming it, that device ops across
 *     daemons are refused and why: the library named is not found (and, where
 *     there is no GPU, that too); no communicator exists;
 *   - a job of four ranks over both daemons still runs its host-memory
 *     collectives (all-reduce, all-gather, a ring shift that crosses the
 *     daemons) bit for bit;
 *   - both daemons keep serving and exit 0 on SIGTERM.
 *
 * A device op to refuse needs GPU memory: test_nccl_nodes (label gpu) makes one
 * with the same library missing and checks the error each rank gets.
 */
#include "sp_test.h"

#define RANKS   4
#define MISSING "/nonexistent/spd-test/libnccl.so.2"

static void check_status(spc_handle_t *h, int rank)
{
    char node[16];
    snprintf(node, sizeof node, "node-%d", rank * 2 / RANKS);
    spc_query_result_t *q;
    CHECK_OK(h, spc_query(h, "status", NULL, &q));
    long f = spc_query_find(q, 0, "transport_nccl"), g = spc_query_find(q, 0, "gpus"),
         c = spc_query_find(q, 0, "nccl_comms"), n = spc_query_find(q, 0, "node");
    CHECK(f >= 0 && g >= 0 && c >= 0 && n >= 0);
    const char *s = spc_query_str(q, 0, (size_t)f);
    CHECK_STREQ(spc_query_str(q, 0, (size_t)n), node);
    CHECK_CONTAINS(s, "device ops across daemons refused");
    CHECK_CONTAINS(s, MISSING " not found");
    if (spc_query_int(q, 0, (size_t)g) <= 0 && strstr(s, "built without") == NULL) {   /* the node's, named */
        char why[48];
        snprintf(why, sizeof why, "no GPU on node %s", node);
        CHECK_CONTAINS(s, why);
    }
    CHECK_EQ(spc_query_int(q, 0, (size_t)c), 0);
    if (rank == 0)
        printf("%s: transport_nccl: %s\n", node, s);
    spc_query_free(q);
}

static int rank_main(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    (void)arg;
    check_status(h, rank);

    /* All-reduce: integers, so the sum is exact whatever the order. */
    int64_t *x = spc_alloc(h, 64 * sizeof *x);
    for (int i = 0; i < 64; i++)
        x[i] = (int64_t)(rank + 1) * 1000 + i;
    CHECK_OK(h, spc_allreduce(h, world, x, x, 64, SPC_I64, SPC_SUM, 20000));
    for (int i = 0; i < 64; i++)
        CHECK_EQ(x[i], (int64_t)P * (P + 1) / 2 * 1000 + (int64_t)P * i);

    /* All-gather. */
    int32_t *me = spc_alloc(h, sizeof *me), *all = spc_alloc(h, (size_t)P * sizeof *all);
    *me = 7 * rank + 3;
    CHECK_OK(h, spc_allgather(h, world, me, all, 1, SPC_I32, 20000));
    for (int q = 0; q < P; q++)
        CHECK_EQ(all[q], 7 * q + 3);

    /* A cyclic shift: ranks 1 -> 2 and 3 -> 0 cross the daemons. */
    const size_t n = 4096 + 5;
    uint8_t *send = spc_alloc(h, n), *recv = spc_alloc(h, n);
    for (size_t i = 0; i < n; i++)
        send[i] = (uint8_t)(rank * 31 + i);
    spc_shift_desc_t d = { .struct_size = sizeof d, .group = world, .ntensors = 1 };
    d.tensors[0].send = send;
    d.tensors[0].recv = recv;
    d.tensors[0].bytes = n;
    CHECK_OK(h, spc_shift(h, &d, 20000));
    int from = (rank + P - 1) % P;
    for (size_t i = 0; i < n; i++)
        CHECK_EQ(recv[i], (uint8_t)(from * 31 + i));
    return 0;
}

int main(void)
{
    /* The daemons read it from their environment, as an operator's SPD_* would be. */
    setenv("SPD_NCCL_LIBRARY", MISSING, 1);
    char *argv[] = { "test_nccl_absent", "--nodes", "2", NULL };
    sp_test_daemon_t d;
    CHECK_EQ(sp_test_start(&d, 3, argv), 2);
    sp_test_run_job(RANKS, rank_main, NULL);
    /* Again: the daemons still serve after a whole job came and went. */
    sp_test_run_job(RANKS, rank_main, NULL);
    CHECK_EQ(sp_test_cluster_stop(), 0);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("nccl_absent: ok\n");
    return 0;
}
