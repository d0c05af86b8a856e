/*
 * test_mesh.c — meshes through a real spd: degrees, coordinates and groups.
 *
 * The layout is the one spclient.h documents, recomputed here from the formula
 * and nothing else:
 *
 *   rank = dp_rank * sp + ring_rank * ulysses + ulysses_rank
 *
 * Every rank checks its coordinates, then proves each of its four groups by an
 * allgather over it of (job rank, coordinate, group id): the job ranks must be
 * the members the formula gives, in group-rank order; the coordinate must be
 * the group rank; the group id must be the same on every member.
 *
 * Cases: explicit degrees (world 4 = sp 4 = ulysses 2 x ring 2; world 8 = dp 2 x
 * sp 4), auto degrees as spc_mesh_spec_t documents them (28 heads / 4 kv on sp
 * 8 -> ulysses 4 x ring 2; 7 heads on sp 4 -> ring 4; GQA and MQA with
 * replicated kv heads; one of ulysses/ring given), odd worlds (3, 5, 6 ranks),
 * dummy heads; invalid specs refused with the reason; ranks that ask for
 * different specs; two meshes in one job; and `spctl jobs` / `spctl mesh`
 * showing them, in JSON and text.
 */
#include <unistd.h>

#include "sp_test.h"

#define TIMEOUT_MS 20000
#define MAXW       8

enum { K_DP, K_SP, K_ULYSSES, K_RING, K_N };
static const char *const kind_name[K_N] = { "dp", "sp", "ulysses", "ring" };

typedef struct mcase {
    const char *name;
    uint32_t    world, sp, ulysses, ring, heads, kv_heads;   /* the spec asked for */
    uint32_t    want_ulysses, want_ring;                     /* what it must give */
    const char *explain;                                     /* must appear in the explanation */
} mcase_t;

/*            name                                          W  sp u  r  H   kv  -> u  r   explain */
static const mcase_t cases[] = {
    { "world 4 = sp 4 (ulysses 2 x ring 2)",               4, 4, 2, 2, 8,  2,  2, 2, "dp 1 x sp 4 (ulysses 2 x ring 2)" },
    { "world 8 = dp 2 x sp 4 (ulysses 2 x ring 2)",        8, 4, 2, 2, 8,  8,  2, 2, "dp 2 x sp 4 (ulysses 2 x ring 2)" },
    { "auto: 28 heads / 4 kv on sp 8",                     8, 8, 0, 0, 28, 4,  4, 2, "dp 1 x sp 8 (ulysses 4 x ring 2)" },
    { "auto: 7 heads on sp 4",                             4, 4, 0, 0, 7,  0,  1, 4, "(ulysses 1 x ring 4)" },
    { "auto: GQA 12 / 2 kv on sp 8, kv x2",                8, 8, 0, 0, 12, 2,  4, 2, "kv heads replicated 2 times" },
    { "auto: MQA 8 / 1 kv, dp 2 x sp 4, kv x4",            8, 4, 0, 0, 8,  1,  4, 1, "kv heads replicated 4 times" },
    { "ring given: sp 4 ring 4",                           4, 4, 0, 4, 8,  8,  1, 4, "sp / ring" },
    { "ulysses given: sp 4 ulysses 2",                     4, 4, 2, 0, 8,  8,  2, 2, "(ulysses 2 x ring 2)" },
    { "6 heads on ulysses 4: 2 dummy heads",               4, 4, 4, 1, 6,  6,  4, 1, "2 dummy heads pad 6 to 8" },
    { "world 3: auto 6 heads on sp 3",                     3, 3, 0, 0, 6,  0,  3, 1, "(ulysses 3 x ring 1)" },
    { "world 3: auto 4 heads on sp 3 -> ring 3",           3, 3, 0, 0, 4,  0,  1, 3, "(ulysses 1 x ring 3)" },
    { "world 5: auto 10 heads on sp 5",                    5, 5, 0, 0, 10, 0,  5, 1, "(ulysses 5 x ring 1)" },
    { "world 5: auto 8 heads on sp 5 -> ring 5",           5, 5, 0, 0, 8,  0,  1, 5, "(ulysses 1 x ring 5)" },
    { "world 6 = dp 2 x sp 3, 9 heads / 3 kv",             6, 3, 0, 0, 9,  3,  3, 1, "dp 2 x sp 3 (ulysses 3 x ring 1)" },
    { "world 5 = dp 5 x sp 1",                             5, 1, 0, 0, 4,  0,  1, 1, "dp 5 x sp 1" },
};
#define NCASES (sizeof cases / sizeof cases[0])

/* ================================================================ the layout, independently */

typedef struct layout {
    uint32_t world, dp, sp, u, ring;
} layout_t;

/* The members of rank r's group of `kind`, in group-rank order; returns the count. */
static uint32_t members(const layout_t *L, int kind, uint32_t r, uint32_t *out)
{
    uint32_t d = r / L->sp, s = r % L->sp, k = s / L->u, j = s % L->u, n = 0;
    switch (kind) {
    case K_DP:
        for (uint32_t i = 0; i < L->dp; i++)
            out[n++] = i * L->sp + s;
        break;
    case K_SP:
        for (uint32_t i = 0; i < L->sp; i++)
            out[n++] = d * L->sp + i;
        break;
    case K_ULYSSES:
        for (uint32_t i = 0; i < L->u; i++)
            out[n++] = d * L->sp + k * L->u + i;
        break;
    case K_RING:
        for (uint32_t i = 0; i < L->ring; i++)
            out[n++] = d * L->sp + i * L->u + j;
        break;
    }
    return n;
}

/* Rank r's coordinate along `kind` (its rank in that group). */
static uint32_t coord(const layout_t *L, int kind, uint32_t r)
{
    uint32_t s = r % L->sp;
    switch (kind) {
    case K_DP:      return r / L->sp;
    case K_SP:      return s;
    case K_ULYSSES: return s % L->u;
    default:        return s / L->u;
    }
}

static spc_group_t mesh_group(const spc_mesh_t *m, int kind)
{
    return kind == K_DP ? m->dp_group : kind == K_SP ? m->sp_group : kind == K_ULYSSES ? m->ulysses_group : m->ring_group;
}

static uint32_t mesh_coord(const spc_mesh_t *m, int kind)
{
    return kind == K_DP ? m->dp_rank : kind == K_SP ? m->sp_rank : kind == K_ULYSSES ? m->ulysses_rank : m->ring_rank;
}

/*
 * Checks this rank's mesh against the layout: coordinates, then an allgather
 * over each group. Group operations on different groups of the same job may
 * run in any order across ranks: each group matches its own sequence.
 */
static void check_mesh(spc_handle_t *h, spc_group_t world, const spc_mesh_t *m, const layout_t *L, uint32_t rank,
                       const char *what)
{
    CHECK_EQ(m->dp, L->dp);
    CHECK_EQ(m->sp, L->sp);
    CHECK_EQ(m->ulysses, L->u);
    CHECK_EQ(m->ring, L->ring);
    CHECK_EQ(m->dp * m->sp, L->world);
    CHECK_EQ(m->ring * m->ulysses, m->sp);

    spc_group_t ids[K_N];
    for (int k = 0; k < K_N; k++) {
        ids[k] = mesh_group(m, k);
        if (mesh_coord(m, k) != coord(L, k, rank))
            SP_FAIL("%s: rank %u: %s_rank %u, the layout says %u", what, rank, kind_name[k], mesh_coord(m, k),
                    coord(L, k, rank));
        CHECK(ids[k] != world);
        for (int j = 0; j < k; j++)
            if (ids[j] == ids[k])
                SP_FAIL("%s: rank %u: the %s and %s groups are both group %u", what, rank, kind_name[j],
                        kind_name[k], ids[k]);
    }
    CHECK_EQ(rank, m->dp_rank * m->sp + m->ring_rank * m->ulysses + m->ulysses_rank);

    int32_t *send = spc_alloc(h, 3 * sizeof *send), *recv = spc_alloc(h, 3 * MAXW * sizeof *recv);
    CHECK(send != NULL && recv != NULL);
    for (int k = 0; k < K_N; k++) {
        uint32_t want[MAXW];
        uint32_t n = members(L, k, rank, want);
        send[0] = (int32_t)rank;
        send[1] = (int32_t)mesh_coord(m, k);
        send[2] = (int32_t)ids[k];
        memset(recv, 0xff, 3 * MAXW * sizeof *recv);
        spc_status_t st = spc_allgather(h, ids[k], send, recv, 3, SPC_I32, TIMEOUT_MS);
        if (st != SPC_OK)
            SP_FAIL("%s: rank %u: allgather over its %s group %u: %s (%s)", what, rank, kind_name[k], ids[k],
                    spc_status_name(st), spc_last_error(h));
        for (uint32_t i = 0; i < n; i++) {
            if (recv[3 * i] != (int32_t)want[i] || recv[3 * i + 1] != (int32_t)i || recv[3 * i + 2] != (int32_t)ids[k])
                SP_FAIL("%s: rank %u: %s group %u, group rank %u: got job rank %d, coordinate %d, group %d; "
                        "expected job rank %u, coordinate %u, group %u", what, rank, kind_name[k], ids[k], i,
                        recv[3 * i], recv[3 * i + 1], recv[3 * i + 2], want[i], i, ids[k]);
        }
        /* The group has exactly n members: nothing past them was written. */
        if (n < MAXW)
            CHECK_EQ(recv[3 * n], -1);
    }
    spc_free(h, send);
    spc_free(h, recv);
}

static spc_mesh_spec_t spec_of(const mcase_t *c)
{
    return (spc_mesh_spec_t){ .struct_size = sizeof(spc_mesh_spec_t), .sp = c->sp, .ulysses = c->ulysses,
                              .ring = c->ring, .heads = c->heads, .kv_heads = c->kv_heads };
}

static layout_t layout_of(const mcase_t *c)
{
    return (layout_t){ c->world, c->world / c->sp, c->sp, c->want_ulysses, c->want_ring };
}

static int rank_case(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    const mcase_t *c = arg;
    spc_mesh_spec_t spec = spec_of(c);
    spc_mesh_t m;
    spc_status_t st = spc_mesh_create(h, &spec, &m);
    if (st != SPC_OK)
        SP_FAIL("%s: rank %d: mesh create: %s (%s)", c->name, rank, spc_status_name(st), spc_last_error(h));
    CHECK_EQ(m.id, 0);
    CHECK_CONTAINS(m.explain, c->explain);
    layout_t L = layout_of(c);
    CHECK_EQ(L.world, (uint32_t)nranks);
    check_mesh(h, world, &m, &L, (uint32_t)rank, c->name);
    CHECK_OK(h, spc_barrier(h, world, TIMEOUT_MS));
    return 0;
}

/* ================================================================ refusals */

typedef struct bad_spec {
    uint32_t    sp, ulysses, ring, heads, kv_heads;
    const char *reason;
} bad_spec_t;

/* On a world of 4. */
static const bad_spec_t bad_specs[] = {
    { 3, 0, 0, 8, 0, "sp 3 does not divide the world of 4 ranks" },
    { 0, 0, 0, 8, 0, "sp 0 does not divide the world of 4 ranks" },
    { 8, 0, 0, 8, 0, "sp 8 does not divide the world of 4 ranks" },
    { 4, 2, 1, 8, 0, "ulysses 2 x ring 1 is not sp 4" },
    { 4, 3, 0, 6, 0, "ulysses 3 and ring 0 must divide sp 4" },
    { 4, 2, 2, 8, 3, "3 kv_heads do not divide 8 heads" },
    { 4, 2, 2, 4, 8, "8 kv_heads do not divide 4 heads" },
    { 4, 4, 1, 6, 3, "ulysses 4 cannot replicate 3 kv heads evenly" },
    { 4, 4, 1, 2, 2, "ulysses 4 exceeds the 2 heads" },
    { 4, 2, 2, 0, 0, "heads" },
};

static int rank_refusals(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    spc_mesh_t m;
    memset(&m, 0x77, sizeof m);
    for (size_t i = 0; i < sizeof bad_specs / sizeof bad_specs[0]; i++) {
        const bad_spec_t *b = &bad_specs[i];
        spc_mesh_spec_t spec = { .struct_size = sizeof spec, .sp = b->sp, .ulysses = b->ulysses, .ring = b->ring,
                                 .heads = b->heads, .kv_heads = b->kv_heads };
        spc_status_t st = spc_mesh_create(h, &spec, &m);
        if (st != SPC_ERR_INVALID_ARG)
            SP_FAIL("rank %d: spec sp %u ulysses %u ring %u heads %u kv %u: got %s (%s), expected "
                    "SPC_ERR_INVALID_ARG", rank, b->sp, b->ulysses, b->ring, b->heads, b->kv_heads,
                    spc_status_name(st), spc_last_error(h));
        CHECK_CONTAINS(spc_last_error(h), "mesh refused: ");
        CHECK_CONTAINS(spc_last_error(h), b->reason);
        CHECK_EQ(m.id, 0x77777777u);   /* output untouched on failure */
    }

    /* Refusals used up no mesh: the next valid one is mesh 0. Rank 0 makes it
     * first; ranks 2 and 3 then ask for something else and are told so, the
     * others find it. */
    spc_mesh_spec_t good = { .struct_size = sizeof good, .sp = 4, .ulysses = 2, .ring = 2, .heads = 8, .kv_heads = 8 };
    if (rank == 0)
        CHECK_OK(h, spc_mesh_create(h, &good, &m));
    CHECK_OK(h, spc_barrier(h, world, TIMEOUT_MS));
    if (rank == 2) {
        spc_mesh_spec_t other = good;
        other.heads = 16;
        CHECK_ST(h, spc_mesh_create(h, &other, &m), SPC_ERR_MISMATCH);
        CHECK_CONTAINS(spc_last_error(h), "mesh 0: rank 2 asked for sp 4 ulysses 2 ring 2 heads 16 kv_heads 8");
        CHECK_CONTAINS(spc_last_error(h), "the mesh has sp 4 ulysses 2 ring 2 heads 8 kv_heads 8");
        CHECK_EQ(m.id, 0x77777777u);
    } else if (rank == 3) {
        spc_mesh_spec_t other = good;
        other.ulysses = 4;
        other.ring = 0;
        CHECK_ST(h, spc_mesh_create(h, &other, &m), SPC_ERR_MISMATCH);
        CHECK_CONTAINS(spc_last_error(h), "rank 3 asked for sp 4 ulysses 4 ring 1");
        CHECK_CONTAINS(spc_last_error(h), "the mesh has sp 4 ulysses 2 ring 2");
    }
    /* Told, they ask again alike: a refused ask took no mesh slot. */
    if (rank != 0)
        CHECK_OK(h, spc_mesh_create(h, &good, &m));
    CHECK_EQ(m.id, 0);
    layout_t L = { 4, 1, 4, 2, 2 };
    check_mesh(h, world, &m, &L, (uint32_t)rank, "mesh after mismatches");
    CHECK_OK(h, spc_barrier(h, world, TIMEOUT_MS));
    return 0;
}

/* ================================================================ two meshes and spctl */

/* The job this rank is in, from the clients query. */
static void my_job_id(spc_handle_t *h, char *out, size_t len)
{
    spc_query_result_t *r;
    CHECK_OK(h, spc_query(h, "clients", "", &r));
    out[0] = '\0';
    for (size_t i = 0; i < spc_query_records(r); i++) {
        if (spc_query_int(r, i, (size_t)spc_query_find(r, i, "pid")) == getpid())
            snprintf(out, len, "%s", spc_query_str(r, i, (size_t)spc_query_find(r, i, "job")));
    }
    spc_query_free(r);
    CHECK(out[0] != '\0');
}

/*
 * What `spctl mesh` must list for a kind: every group as "id:[job ranks]", in
 * the order of their lowest member, from the layout and the group ids every
 * rank reported (gids[rank * K_N + kind]).
 */
static void expected_groups(const layout_t *L, int kind, const int32_t *gids, char *out, size_t len)
{
    size_t off = 0;
    out[0] = '\0';
    for (uint32_t r = 0; r < L->world; r++) {
        uint32_t mem[MAXW];
        uint32_t n = members(L, kind, r, mem);
        if (mem[0] != r)
            continue;   /* listed with its lowest member */
        off += (size_t)snprintf(out + off, len - off, "%s%d:[", off ? " " : "", gids[r * K_N + kind]);
        for (uint32_t i = 0; i < n; i++)
            off += (size_t)snprintf(out + off, len - off, "%s%u", i ? " " : "", mem[i]);
        off += (size_t)snprintf(out + off, len - off, "]");
    }
}

static const mcase_t ctl_meshes[2] = {
    { "mesh 0: dp 2 x sp 4 (ulysses 2 x ring 2)", 8, 4, 2, 2, 8,  8, 2, 2, "dp 2 x sp 4 (ulysses 2 x ring 2)" },
    { "mesh 1: auto, 28 heads / 4 kv on sp 8",    8, 8, 0, 0, 28, 4, 4, 2, "dp 1 x sp 8 (ulysses 4 x ring 2)" },
};

static int rank_spctl(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    static char out[65536], rec[16384], cmd[512], want[4096], got[4096];
    const char *spctl = sp_test_spctl_bin();
    spc_mesh_t m[2];
    int32_t *mine = spc_alloc(h, K_N * sizeof *mine), *gids[2];

    for (int k = 0; k < 2; k++) {
        spc_mesh_spec_t spec = spec_of(&ctl_meshes[k]);
        CHECK_OK(h, spc_mesh_create(h, &spec, &m[k]));
        CHECK_EQ(m[k].id, (uint32_t)k);
        CHECK_CONTAINS(m[k].explain, ctl_meshes[k].explain);
        layout_t L = layout_of(&ctl_meshes[k]);
        check_mesh(h, world, &m[k], &L, (uint32_t)rank, ctl_meshes[k].name);
        /* Every rank's group ids, for the expected `spctl mesh` lists. */
        gids[k] = spc_alloc(h, (size_t)nranks * K_N * sizeof *gids[k]);
        for (int j = 0; j < K_N; j++)
            mine[j] = (int32_t)mesh_group(&m[k], j);
        CHECK_OK(h, spc_allgather(h, world, mine, gids[k], K_N, SPC_I32, TIMEOUT_MS));
    }
    /* The two meshes have distinct groups. */
    for (int j = 0; j < K_N; j++)
        for (int i = 0; i < K_N; i++)
            CHECK(mesh_group(&m[0], j) != mesh_group(&m[1], i));

    if (rank != 0) {
        /* Wait in a barrier while rank 0 looks: 7 ops pending on the world. */
        CHECK_OK(h, spc_barrier(h, world, TIMEOUT_MS));
        return 0;
    }

    char job[SPC_JOB_ID_MAX];
    my_job_id(h, job, sizeof job);

    /* spctl jobs: wait until the other 7 ranks sit in the barrier. */
    char needle[200];
    snprintf(needle, sizeof needle, "\"id\":\"%s\"", job);
    long long pending = -1;
    for (uint64_t end = sp_test_now_ms() + TIMEOUT_MS; pending != 7 && sp_test_now_ms() < end;) {
        CHECK_EQ(sp_test_run(out, sizeof out, "%s --json jobs", spctl), 0);
        CHECK(out[0] == '[');
        CHECK(sp_test_json_record(out, out, needle, rec, sizeof rec));
        pending = sp_test_json_int(rec, "ops_pending");
        if (pending != 7)
            usleep(2000);
    }
    CHECK_EQ(pending, 7);
    CHECK_EQ(sp_test_json_int(rec, "world_size"), 8);
    CHECK_EQ(sp_test_json_int(rec, "joined"), 8);
    CHECK_EQ(sp_test_json_int(rec, "complete"), 1);
    CHECK_EQ(sp_test_json_int(rec, "world_group"), world);
    CHECK_EQ(sp_test_json_int(rec, "meshes"), 2);
    /* The world, then mesh 0: 4 dp + 2 sp + 4 ulysses + 4 ring; mesh 1: 8 dp + 1 sp + 2 + 4. */
    CHECK_EQ(sp_test_json_int(rec, "groups"), 1 + 14 + 15);
    CHECK_CONTAINS(rec, "\"age_s\":");

    /* The same, for this job only and in text. */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json jobs '%s'", spctl, job), 0);
    CHECK(out[0] == '[' && strstr(out, "},{") == NULL);
    CHECK_CONTAINS(out, needle);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s jobs", spctl), 0);
    printf("$ spctl jobs\n%s", out);
    CHECK_CONTAINS(out, "PENDING");
    snprintf(cmd, sizeof cmd, "8      8      yes       %-6u 30      2       7", world);
    CHECK_CONTAINS(out, cmd);
    CHECK_CONTAINS(out, job);

    /* spctl mesh JOB: both meshes, every field, every group. */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json mesh '%s'", spctl, job), 0);
    CHECK(out[0] == '[');
    for (int k = 0; k < 2; k++) {
        const mcase_t *c = &ctl_meshes[k];
        layout_t L = layout_of(c);
        snprintf(needle, sizeof needle, "\"mesh\":%d,", k);
        CHECK(sp_test_json_record(out, out, needle, rec, sizeof rec));
        sp_test_json_str(rec, "job", got, sizeof got);
        CHECK_STREQ(got, job);
        CHECK_EQ(sp_test_json_int(rec, "world_size"), 8);
        CHECK_EQ(sp_test_json_int(rec, "dp"), L.dp);
        CHECK_EQ(sp_test_json_int(rec, "sp"), L.sp);
        CHECK_EQ(sp_test_json_int(rec, "ulysses"), L.u);
        CHECK_EQ(sp_test_json_int(rec, "ring"), L.ring);
        CHECK_EQ(sp_test_json_int(rec, "heads"), c->heads);
        CHECK_EQ(sp_test_json_int(rec, "kv_heads"), c->kv_heads ? c->kv_heads : c->heads);
        sp_test_json_str(rec, "explain", got, sizeof got);
        CHECK_STREQ(got, m[k].explain);
        for (int j = 0; j < K_N; j++) {
            char key[32];
            snprintf(key, sizeof key, "%s_groups", kind_name[j]);
            expected_groups(&L, j, gids[k], want, sizeof want);
            sp_test_json_str(rec, key, got, sizeof got);
            if (strcmp(got, want) != 0)
                SP_FAIL("mesh %d %s: spctl says \"%s\", the layout says \"%s\"", k, key, got, want);
        }
    }
    CHECK_EQ(sp_test_run(out, sizeof out, "%s mesh", spctl), 0);
    printf("$ spctl mesh\n%s", out);
    fflush(stdout);
    snprintf(cmd, sizeof cmd, "job %s mesh 0: dp 2 x sp 4 (ulysses 2 x ring 2), heads 8, kv_heads 8", job);
    CHECK_CONTAINS(out, cmd);
    snprintf(cmd, sizeof cmd, "job %s mesh 1: dp 1 x sp 8 (ulysses 4 x ring 2), heads 28, kv_heads 4", job);
    CHECK_CONTAINS(out, cmd);
    layout_t L0 = layout_of(&ctl_meshes[0]);
    expected_groups(&L0, K_ULYSSES, gids[0], want, sizeof want);
    snprintf(cmd, sizeof cmd, "  ulysses groups   %s\n", want);
    CHECK_CONTAINS(out, cmd);
    CHECK_CONTAINS(out, "  why              dp 2 x sp 4");

    /* An unknown job is refused with its name. */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s mesh no-such-job 2>&1", spctl), 1);
    CHECK_CONTAINS(out, "SPC_ERR_NOT_FOUND");
    CHECK_CONTAINS(out, "no job 'no-such-job'");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json jobs no-such-job 2>&1", spctl), 1);
    CHECK_CONTAINS(out, "no job 'no-such-job'");

    CHECK_OK(h, spc_barrier(h, world, TIMEOUT_MS));
    return 0;
}

int main(void)
{
    sp_test_daemon_t d;
    char out[4096];
    sp_test_daemon_start(&d, NULL);

    /* A mesh needs a complete job. */
    spc_handle_t *lone = sp_test_attach();
    spc_mesh_spec_t spec = { .struct_size = sizeof spec, .sp = 1, .heads = 1 };
    spc_mesh_t m;
    CHECK_ST(lone, spc_mesh_create(lone, &spec, &m), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(lone), "no complete job");
    spc_detach(lone);

    for (size_t i = 0; i < NCASES; i++) {
        const mcase_t *c = &cases[i];
        CHECK(c->world <= MAXW && c->want_ulysses * c->want_ring == c->sp);
        sp_test_run_job((int)c->world, rank_case, (void *)c);
        printf("%s: ok\n", c->name);
        fflush(stdout);
    }
    sp_test_run_job(4, rank_refusals, NULL);
    printf("invalid specs and mismatched specs: ok\n");
    fflush(stdout);
    sp_test_run_job(8, rank_spctl, NULL);
    printf("two meshes, spctl jobs and mesh: ok\n");

    /* The jobs end once their ranks and owners are gone, and their meshes with them. */
    bool gone = false;
    for (uint64_t end = sp_test_now_ms() + 10000; !gone && sp_test_now_ms() < end;) {
        CHECK_EQ(sp_test_run(out, sizeof out, "%s jobs", sp_test_spctl_bin()), 0);
        gone = strstr(out, "(no jobs)") != NULL;
        if (!gone)
            usleep(5000);
    }
    CHECK(gone);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s mesh", sp_test_spctl_bin()), 0);
    CHECK_CONTAINS(out, "(no meshes)");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json mesh", sp_test_spctl_bin()), 0);
    CHECK_STREQ(out, "[]\n");

    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("mesh: ok\n");
    return 0;
}
