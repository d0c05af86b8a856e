/*
 * test_nodes N: one job over N daemons (2 or 3) on loopback, each playing a node with two ranks:
 * the ranks join through the root daemon, and every op (all-reduce, Ulysses
 * all-to-all there and back, ring shift on a mesh whose rings cross the nodes,
 * all-gather, broadcast, barrier) gives the results an index loop computes here,
 * bit for bit, as on one node. Then the failures: a daemon killed while the
 * others' ranks wait in an op fails them with the node named, a rank killed on
 * one daemon fails the waits on the others, and the survivors keep serving.
 */
#include <math.h>
#include <signal.h>
#include <sys/stat.h>

#include "sp_test.h"

#define MAX_NODES 3
#define PER       2

static int NODES = 3, RANKS = 3 * PER;
static char job_id[SPC_JOB_ID_MAX];
static sp_test_daemon_t nodes[MAX_NODES];

typedef struct rank_arg {
    int  rank;
    int  scenario;
} rank_arg_t;

enum { OPS, WAIT_FOR_KILL, SLEEP, ROUND_ROBIN };

/* The node a rank attaches to: contiguous blocks, or round-robin over the nodes. */
static int node_of(int rank, int scenario)
{
    return scenario == ROUND_ROBIN ? rank % NODES : rank / PER;
}

/* Ranks numbered round-robin over the nodes (rank r on node r % N): an automatic
 * mesh still keeps each Ulysses group inside one node, and its rings cross them. */
static void run_round_robin(spc_handle_t *h, int rank)
{
    spc_mesh_spec_t spec = { .struct_size = sizeof spec, .sp = (uint32_t)RANKS, .heads = 8, .kv_heads = 8 };
    spc_mesh_t m;
    CHECK_OK(h, spc_mesh_create(h, &spec, &m));
    CHECK_EQ(m.ulysses, PER);
    CHECK_EQ(m.ring, NODES);
    CHECK_CONTAINS(m.explain, "inside a node");
    int32_t *me = spc_alloc(h, sizeof *me), *all = spc_alloc(h, PER * sizeof *all);
    *me = node_of(rank, ROUND_ROBIN);
    CHECK_OK(h, spc_allgather(h, m.ulysses_group, me, all, 1, SPC_I32, 20000));
    for (int i = 0; i < PER; i++)
        CHECK_EQ(all[i], *me);                     /* one node per Ulysses group */
    int32_t *ring = spc_alloc(h, (size_t)NODES * sizeof *ring);
    CHECK_OK(h, spc_allgather(h, m.ring_group, me, ring, 1, SPC_I32, 20000));
    for (int i = 0; i < NODES; i++)
        for (int k = 0; k < i; k++)
            CHECK(ring[i] != ring[k]);             /* every ring visits every node once */
}

static double value(int rank, int i)
{
    return sin(0.37 * i + rank) * pow(10.0, rank - 2);
}

static float a2a_value(uint32_t s, uint32_t h, uint32_t d)
{
    return (float)(s * 1000 + h * 10 + d) + 0.5f;
}

static void run_ops(spc_handle_t *h, spc_group_t world, int rank)
{
    /* All-reduce: the rank-order sum, the same bits everywhere. */
    enum { N = 1000 };
    double *x = spc_alloc(h, N * sizeof *x);
    for (int i = 0; i < N; i++)
        x[i] = value(rank, i);
    CHECK_OK(h, spc_allreduce(h, world, x, x, N, SPC_F64, SPC_SUM, 20000));
    for (int i = 0; i < N; i++) {
        double want = value(0, i);
        for (int r = 1; r < RANKS; r++)
            want += value(r, i);
        if (memcmp(&x[i], &want, sizeof want) != 0)
            SP_FAIL("allreduce element %d: %.17g != %.17g", i, x[i], want);
    }

    /* Ulysses over the world: sequence shards -> head shards -> back. */
    const uint32_t S = 14, H = (uint32_t)RANKS, D = 4, P = (uint32_t)RANKS, S_loc = (S + P - 1) / P;
    float *in = spc_alloc(h, sizeof(float) * S_loc * H * D), *mid = spc_alloc(h, sizeof(float) * S * 1 * D);
    float *back = spc_alloc(h, sizeof(float) * S_loc * H * D);
    for (uint32_t s = 0; s < S_loc; s++)
        for (uint32_t hh = 0; hh < H; hh++)
            for (uint32_t d = 0; d < D; d++) {
                uint32_t g = (uint32_t)rank * S_loc + s;
                in[(s * H + hh) * D + d] = g < S ? a2a_value(g, hh, d) : 0.0f;
            }
    spc_alltoall_desc_t a = { .struct_size = sizeof a, .group = world, .dtype = SPC_F32, .direction = SPC_SEQ_TO_HEAD,
                              .layout = SPC_LAYOUT_BSHD, .batch = 1, .seq_len = S, .ntensors = 1,
                              .tensors = { { in, mid, H, D, SPC_HEADS_Q, 0 } } };
    CHECK_OK(h, spc_alltoall(h, &a, 20000));
    for (uint32_t s = 0; s < S; s++)
        for (uint32_t d = 0; d < D; d++)
            if (mid[s * D + d] != a2a_value(s, (uint32_t)rank, d))
                SP_FAIL("alltoall row %u dim %u: %g != %g", s, d, mid[s * D + d], a2a_value(s, (uint32_t)rank, d));
    a.direction = SPC_HEAD_TO_SEQ;
    a.tensors[0] = (spc_a2a_tensor_t){ mid, back, H, D, SPC_HEADS_Q, 0 };
    CHECK_OK(h, spc_alltoall(h, &a, 20000));
    CHECK(memcmp(in, back, sizeof(float) * S_loc * H * D) == 0);

    /* A mesh: Ulysses pairs inside each node, rings of 3 across the nodes. */
    spc_mesh_spec_t spec = { .struct_size = sizeof spec, .sp = RANKS, .ulysses = PER, .ring = NODES, .heads = 8 };
    spc_mesh_t m;
    CHECK_OK(h, spc_mesh_create(h, &spec, &m));
    CHECK_EQ(m.ring, NODES);
    CHECK_EQ(m.ring_rank, (uint32_t)rank / PER);
    int64_t *kv = spc_alloc(h, 64 * sizeof *kv), *got = spc_alloc(h, 64 * sizeof *got);
    for (int i = 0; i < 64; i++)
        kv[i] = rank * 1000 + i;
    spc_shift_desc_t sh = { .struct_size = sizeof sh, .group = m.ring_group, .ntensors = 1 };
    sh.tensors[0].send = kv;
    sh.tensors[0].recv = got;
    sh.tensors[0].bytes = 64 * sizeof *kv;
    CHECK_OK(h, spc_shift(h, &sh, 20000));
    int from = (int)(((m.ring_rank + NODES - 1) % NODES) * PER + m.ulysses_rank);
    for (int i = 0; i < 64; i++)
        CHECK_EQ(got[i], from * 1000 + i);
    /* Linear, on the backward channel: ring rank 0 gets zeros. */
    sh.channel = 1;
    sh.flags = SPC_SHIFT_LINEAR;
    CHECK_OK(h, spc_shift(h, &sh, 20000));
    for (int i = 0; i < 64; i++)
        CHECK_EQ(got[i], m.ring_rank == 0 ? 0 : from * 1000 + i);

    /* All-gather, broadcast, barrier. */
    int32_t *mine = spc_alloc(h, 3 * sizeof *mine), *all = spc_alloc(h, (size_t)RANKS * 3 * sizeof *all);
    for (int i = 0; i < 3; i++)
        mine[i] = rank * 10 + i;
    CHECK_OK(h, spc_allgather(h, world, mine, all, 3, SPC_I32, 20000));
    for (int r = 0; r < RANKS; r++)
        for (int i = 0; i < 3; i++)
            CHECK_EQ(all[r * 3 + i], r * 10 + i);
    float *b = spc_alloc(h, 5 * sizeof *b);
    const int root = RANKS - 2;   /* on the last node */
    for (int i = 0; i < 5; i++)
        b[i] = rank == root ? 7.25f + (float)i : -1.0f;
    CHECK_OK(h, spc_broadcast(h, world, b, 5, SPC_F32, (uint32_t)root, 20000));
    for (int i = 0; i < 5; i++)
        CHECK(b[i] == 7.25f + (float)i);
    CHECK_OK(h, spc_barrier(h, world, 20000));
}

static int rank_main(void *p)
{
    const rank_arg_t *ra = p;
    setenv("SPC_SOCKET", nodes[node_of(ra->rank, ra->scenario)].sock, 1);
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, RANKS, (uint32_t)ra->rank, 20000, &world));
    if (ra->scenario == OPS) {
        run_ops(h, world, ra->rank);
    } else if (ra->scenario == ROUND_ROBIN) {
        run_round_robin(h, ra->rank);
    } else if (ra->scenario == WAIT_FOR_KILL) {
        /* Wait in an all-reduce that a lost node or rank must fail, naming it. */
        double *x = spc_alloc(h, 8 * sizeof *x);
        spc_status_t st = spc_allreduce(h, world, x, x, 8, SPC_F64, SPC_SUM, 30000);
        if (st != SPC_ERR_PEER_LOST)
            SP_FAIL("rank %d: %s, expected SPC_ERR_PEER_LOST (%s)", ra->rank, spc_status_name(st), spc_last_error(h));
        const char *want = getenv("SP_TEST_LOST");
        CHECK_CONTAINS(spc_last_error(h), want);
    } else {
        pause();   /* killed by the parent (or with its daemon) */
    }
    spc_detach(h);
    return 0;
}

static int survivors(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    (void)arg;
    int64_t *x = spc_alloc(h, sizeof *x);
    *x = rank + 1;
    CHECK_OK(h, spc_allreduce(h, world, x, x, 1, SPC_I64, SPC_SUM, 10000));
    CHECK_EQ(*x, nranks * (nranks + 1) / 2);
    return 0;
}

/* Runs a job of RANKS ranks, created on node 0, each rank in `scenario[rank]`.
 * The creator stays attached (a job nobody holds ends) until the caller
 * detaches the handle returned. */
static spc_handle_t *start_job(pid_t *pids, const int *scenario)
{
    setenv("SPC_SOCKET", nodes[0].sock, 1);
    spc_handle_t *owner = sp_test_attach();
    CHECK_OK(owner, spc_job_create(owner, job_id, sizeof job_id));
    CHECK_CONTAINS(job_id, "node-0:");
    for (int r = 0; r < RANKS; r++) {
        rank_arg_t ra = { r, scenario[r] };
        pids[r] = sp_test_fork(rank_main, &ra);
    }
    return owner;
}

int main(int argc, char **argv)
{
    char dir[64] = "/tmp/spd-nodes-XXXXXX", secret[128], peers[128], rec[2048], out[16384];
    NODES = argc > 1 ? atoi(argv[1]) : 3;
    CHECK(NODES == 2 || NODES == 3);
    RANKS = NODES * PER;
    CHECK(mkdtemp(dir) != NULL);
    sp_test_secret_file(dir, "secret", "three nodes share this secret, 2026\n", secret, sizeof secret);

    /* node-0 listens; node-1 dials it and listens; node-2 dials both. */
    sp_test_node_start(&nodes[0], "node-0", secret, "127.0.0.1:0", "", 5000);
    int p0 = sp_test_node_port(&nodes[0]);
    snprintf(peers, sizeof peers, "127.0.0.1:%d", p0);
    sp_test_node_start(&nodes[1], "node-1", secret, "127.0.0.1:0", peers, 5000);
    int p1 = sp_test_node_port(&nodes[1]);
    snprintf(peers, sizeof peers, "127.0.0.1:%d,127.0.0.1:%d", p0, p1);
    if (NODES == 3)
        sp_test_node_start(&nodes[2], "node-2", secret, "", peers, 5000);
    for (int i = 0; i < NODES; i++)
        for (int k = 0; k < NODES; k++)
            if (i != k) {
                char name[16];
                snprintf(name, sizeof name, "node-%d", k);
                sp_test_peer_wait(&nodes[i], name, "up", 10000, rec, sizeof rec);
            }

    /* Every op across the three daemons. */
    pid_t pids[MAX_NODES * PER];
    int scen[MAX_NODES * PER];
    for (int r = 0; r < RANKS; r++)
        scen[r] = OPS;
    spc_handle_t *owner = start_job(pids, scen);
    sp_test_wait_all_ok(pids, RANKS, 60000);
    /* The root lists the job with every node that has ranks in it (its creator keeps it). */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket %s --json jobs", sp_test_spctl_bin(), nodes[0].sock), 0);
    CHECK_CONTAINS(out, "\"nodes\":\"node-0,");   /* the root first, the others as they joined */
    for (int i = 1; i < NODES; i++) {
        char name[16];
        snprintf(name, sizeof name, "node-%d", i);
        CHECK_CONTAINS(strstr(out, "\"nodes\""), name);
    }
    spc_detach(owner);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket %s --json status", sp_test_spctl_bin(),
                         nodes[NODES - 1].sock), 0);
    CHECK(sp_test_json_int(out, "ops_failed") == 0);

    for (int r = 0; r < RANKS; r++)
        scen[r] = ROUND_ROBIN;
    owner = start_job(pids, scen);
    sp_test_wait_all_ok(pids, RANKS, 60000);
    spc_detach(owner);

    /* A rank killed on the last node: the waits on the others fail naming it. */
    const int victim = RANKS - 2;
    char lost[32];
    for (int r = 0; r < RANKS; r++)
        scen[r] = r == victim ? SLEEP : WAIT_FOR_KILL;
    snprintf(lost, sizeof lost, "rank %d", victim);
    setenv("SP_TEST_LOST", lost, 1);
    owner = start_job(pids, scen);
    /* Rank 4 is in once every daemon lists the job complete. */
    uint64_t deadline = sp_test_now_ms() + 10000;
    do {
        CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket %s --json jobs", sp_test_spctl_bin(), nodes[0].sock), 0);
    } while (strstr(out, "\"complete\":1") == NULL && sp_test_now_ms() < deadline && usleep(20000) == 0);
    CHECK_CONTAINS(out, "\"complete\":1");
    usleep(200000);   /* let the other ranks enter their all-reduce (a late one fails the same way) */
    CHECK(kill(pids[victim], SIGKILL) == 0);
    CHECK_EQ(sp_test_wait(pids[victim], 5000), -SIGKILL);
    for (int r = 0; r < RANKS; r++)
        if (r != victim)
            CHECK_EQ(sp_test_wait(pids[r], 20000), 0);
    spc_detach(owner);

    /* node-1 killed while the others wait: they learn it from the broken link. */
    for (int r = 0; r < RANKS; r++)
        scen[r] = r / PER == 1 ? SLEEP : WAIT_FOR_KILL;
    setenv("SP_TEST_LOST", "node node-1 lost", 1);
    owner = start_job(pids, scen);
    deadline = sp_test_now_ms() + 10000;
    do {
        CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket %s --json jobs", sp_test_spctl_bin(), nodes[0].sock), 0);
    } while (strstr(out, "\"complete\":1") == NULL && sp_test_now_ms() < deadline && usleep(20000) == 0);
    usleep(200000);
    CHECK(kill(nodes[1].pid, SIGKILL) == 0);
    CHECK_EQ(sp_test_wait(nodes[1].pid, 5000), -SIGKILL);
    nodes[1].pid = 0;
    for (int r = 0; r < RANKS; r++)
        if (r != 2 && r != 3)
            CHECK_EQ(sp_test_wait(pids[r], 20000), 0);
    for (int r = 2; r <= 3; r++) {
        kill(pids[r], SIGKILL);
        sp_test_wait(pids[r], 5000);
    }
    spc_detach(owner);
    sp_test_peer_wait(&nodes[0], "node-1", "down", 5000, rec, sizeof rec);

    /* The survivors still serve. */
    setenv("SPC_SOCKET", nodes[0].sock, 1);
    sp_test_run_job(2, survivors, NULL);
    if (NODES == 3)
        CHECK_EQ(sp_test_daemon_stop(&nodes[2]), 0);
    CHECK_EQ(sp_test_daemon_stop(&nodes[0]), 0);
    for (int i = 0; i < NODES; i++)
        sp_test_daemon_cleanup(&nodes[i]);
    sp_test_run(out, sizeof out, "rm -rf %s", dir);
    return 0;
}
