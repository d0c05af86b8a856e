/*
 * The links between a node's GPUs, discovered by a real spd over the stand-in
 * driver (tests/stubcuda) with four devices: 0 and 1 joined by NVLink, 2 and 3
 * too, 1 and 2 by PCIe peer access, no peer access between the other pairs.
 * `spctl topo` prints a p2p line per ordered pair with what the driver said,
 * the NVLink pairs as islands, and reads back to the same text; `spctl status`
 * says which path an op between each pair takes and why. Ranks that join
 * with a current context on a GPU are placed by those links: Ulysses groups on
 * the NVLink pairs, whatever the rank numbering, and the mesh says so; ranks
 * that announce no GPU keep rank order. Skipped (77) where spd was built
 * without CUDA.
 */
#include "sp_test.h"
#include "sp_topo.h"
#include "stub_cuda.h"

static char out[65536];

/* One of spd's status fields, as text. */
static const char *status_str(const spc_query_result_t *r, const char *key)
{
    long f = spc_query_find(r, 0, key);
    if (f < 0)
        SP_FAIL("spctl status has no field %s", key);
    return spc_query_str(r, 0, (size_t)f);
}

/* Rank r runs on GPU GPU_OF[r]: the NVLink pairs are ranks 0, 2 and 1, 3. */
static const int GPU_OF[4] = { 0, 2, 1, 3 };

typedef struct mesh_rank {
    const char *job_id;
    int         rank;
    bool        on_gpu;          /* make GPU_OF[rank]'s context current before joining */
} mesh_rank_t;

static int mesh_rank_main(void *arg)
{
    const mesh_rank_t *m = arg;
    if (m->on_gpu) {
        void *ctx;
        CHECK_EQ(cuDevicePrimaryCtxRetain(&ctx, GPU_OF[m->rank]), STUB_SUCCESS);
        CHECK_EQ(cuCtxSetCurrent(ctx), STUB_SUCCESS);
    }
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, m->job_id, 4, (uint32_t)m->rank, 10000, &world));
    spc_mesh_spec_t spec = SPC_MESH_SPEC_INIT;
    spec.sp = 4;
    spec.ulysses = 2;
    spec.heads = 4;
    spc_mesh_t mesh;
    CHECK_OK(h, spc_mesh_create(h, &spec, &mesh));
    printf("rank %d%s: ulysses rank %u, ring rank %u; %s\n", m->rank, m->on_gpu ? " (announces its GPU)" : "",
           mesh.ulysses_rank, mesh.ring_rank, mesh.explain);
    if (m->on_gpu) {
        /* Slots by GPU: ranks 0 2 | 1 3. */
        CHECK_EQ(mesh.ulysses_rank, (uint32_t)(m->rank / 2));
        CHECK_EQ(mesh.ring_rank, (uint32_t)(m->rank % 2));
        CHECK_CONTAINS(mesh.explain, "; slowest GPU link of the 2 ulysses groups: NVLink in 2");
    } else {
        CHECK_EQ(mesh.ulysses_rank, (uint32_t)(m->rank % 2));
        CHECK_EQ(mesh.ring_rank, (uint32_t)(m->rank / 2));
        CHECK(strstr(mesh.explain, "GPU link") == NULL);
    }
    spc_detach(h);
    return 0;
}

static void test_mesh(bool on_gpu)
{
    spc_handle_t *owner = sp_test_attach();
    char id[SPC_JOB_ID_MAX];
    CHECK_OK(owner, spc_job_create(owner, id, sizeof id));
    mesh_rank_t ranks[4];
    pid_t pids[4];
    for (int r = 0; r < 4; r++) {
        ranks[r] = (mesh_rank_t){ .job_id = id, .rank = r, .on_gpu = on_gpu };
        pids[r] = sp_test_fork(mesh_rank_main, &ranks[r]);
    }
    sp_test_wait_all_ok(pids, 4, 30000);
    spc_detach(owner);
}

int main(void)
{
    sp_test_use_stub_cuda(SP_STUB_CUDA_DIR);
    setenv("SPD_STUB_CUDA_GPUS", "4", 1);
    setenv("SPD_STUB_CUDA_P2P", "0=1,2=3,1-2", 1);

    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    spc_handle_t *h = sp_test_attach();
    spc_query_result_t *r;
    CHECK_OK(h, spc_query(h, "status", "", &r));
    if (strstr(status_str(r, "gpu_status"), "built without CUDA") != NULL) {
        fprintf(stderr, "skipped: spd was built without CUDA (%s)\n", status_str(r, "gpu_status"));
        spc_query_free(r);
        spc_detach(h);
        sp_test_daemon_stop(&d);
        sp_test_daemon_cleanup(&d);
        return 77;
    }
    CHECK_EQ(spc_query_int(r, 0, (size_t)spc_query_find(r, 0, "gpus")), 4);

    /* The path of each pair, by the topology. */
    CHECK_STREQ(status_str(r, "gpu_paths"),
                "chosen by the topology (spctl topo): 6 pairs peer access, 6 staged through host memory, 0 unknown");
    CHECK_STREQ(status_str(r, "gpu0->gpu1"), "peer access over NVLink (nvl, performance rank 0, native atomics)");
    CHECK_STREQ(status_str(r, "gpu3->gpu2"), "peer access over NVLink (nvl, performance rank 0, native atomics)");
    /* The stub's bus ids are in no sysfs: the PCIe path is unknown. */
    CHECK_STREQ(status_str(r, "gpu2->gpu1"), "peer access (the link is unknown, performance rank 1, no native atomics)");
    CHECK_STREQ(status_str(r, "gpu0->gpu2"),
                "staged through host memory: GPU 0 cannot map GPU 2's memory (no peer access)");
    CHECK_STREQ(status_str(r, "gpu3->gpu0"),
                "staged through host memory: GPU 3 cannot map GPU 0's memory (no peer access)");
    spc_query_free(r);
    spc_detach(h);

    CHECK_EQ(sp_test_run(out, sizeof out, "%s status", sp_test_spctl_bin()), 0);
    printf("$ spctl status\n%s", out);
    CHECK_CONTAINS(out, "gpu1->gpu0        peer access over NVLink (nvl, performance rank 0, native atomics)\n");
    CHECK_CONTAINS(out, "gpu1->gpu3        staged through host memory: GPU 1 cannot map GPU 3's memory (no peer "
                        "access)\n");

    CHECK_EQ(sp_test_run(out, sizeof out, "%s topo", sp_test_spctl_bin()), 0);
    printf("$ spctl topo\n%s", out);
    const char *pairs[] = {
        "p2p 0 1 link nvl access 1 perf-rank 0 atomics 1\n", "p2p 0 2 access 0 perf-rank 0 atomics 0\n",
        "p2p 0 3 access 0 perf-rank 0 atomics 0\n",          "p2p 1 0 link nvl access 1 perf-rank 0 atomics 1\n",
        "p2p 1 2 access 1 perf-rank 1 atomics 0\n",          "p2p 1 3 access 0 perf-rank 0 atomics 0\n",
        "p2p 2 0 access 0 perf-rank 0 atomics 0\n",          "p2p 2 1 access 1 perf-rank 1 atomics 0\n",
        "p2p 2 3 link nvl access 1 perf-rank 0 atomics 1\n", "p2p 3 0 access 0 perf-rank 0 atomics 0\n",
        "p2p 3 1 access 0 perf-rank 0 atomics 0\n",          "p2p 3 2 link nvl access 1 perf-rank 0 atomics 1\n",
    };
    char want[1024] = "";
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++)
        strcat(want, pairs[i]);
    CHECK_CONTAINS(out, want);   /* every pair, in order, after the gpu lines */
    CHECK(strstr(out, want)[strlen(want)] == '\0');

    /* It reads back: the islands are the NVLink pairs, and the text is the same. */
    sp_topo_t *t;
    char err[512];
    if (sp_topo_parse(out, "spctl topo", &t, err, sizeof err) != SPC_OK)
        SP_FAIL("spctl topo printed what does not load: %s", err);
    const sp_topo_node_t *n = &t->nodes[0];
    CHECK_EQ(n->ngpus, 4);
    CHECK_EQ(n->np2p, 12);
    CHECK_STREQ(n->gpus[3].bus, "0000:fc:00.0");
    CHECK_EQ(sp_topo_find_gpu(n, 0)->island, 0);
    CHECK_EQ(sp_topo_find_gpu(n, 1)->island, 0);
    CHECK_EQ(sp_topo_find_gpu(n, 2)->island, 2);
    CHECK_EQ(sp_topo_find_gpu(n, 3)->island, 2);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    sp_topo_dump(t, f);
    fclose(f);
    CHECK_STREQ(text, strchr(out, '\n') + 1);   /* past spctl's comment line */
    free(text);
    sp_topo_free(t);

    CHECK_EQ(sp_test_run(out, sizeof out, "%s topo --json", sp_test_spctl_bin()), 0);
    CHECK_CONTAINS(out, "\"p2p\":[{\"from\":0,\"to\":1,\"link\":\"nvl\",\"access\":1,\"perf_rank\":0,\"atomics\":1},"
                        "{\"from\":0,\"to\":2,\"link\":\"unknown\",\"access\":0,\"perf_rank\":0,\"atomics\":0},");

    test_mesh(true);
    test_mesh(false);

    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    return 0;
}
