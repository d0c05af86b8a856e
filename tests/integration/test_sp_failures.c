/*
 * test_sp_failures.c — what goes wrong around the sequence-parallel ops, and
 * what every rank hears about it, through a real spd.
 *
 *   mismatch   ranks pass all-to-alls that differ (dtype, heads, head_dim,
 *              batch, direction, layout, kv_heads, tensor count) or submit their
 *              ops in different orders (one rank shifts where the others do an
 *              all-to-all): every rank gets SPC_ERR_MISMATCH naming the ranks
 *              and fields, no receive buffer is touched, and the group goes on.
 *   timeout    a rank that never arrives, in the world and in a Ulysses group of
 *              a mesh: the others time out after the op's own timeout_ms with
 *              the missing rank named (group and job rank); while they wait,
 *              `spctl ops` shows the op with the ranks arrived and missing; the
 *              late rank gets the same error at once and the groups go on.
 *   bounds     a tensor too small for the op (a small registered region), send
 *              and receive that overlap, registered memory unmapped under the
 *              daemon: that rank gets OUT_OF_BOUNDS, INVALID_ARG or BAD_REGION,
 *              the others PEER_REFUSED naming it, and nothing is written; a
 *              receive unmapped before the write-back fails that rank alone.
 *   peer lost  a rank killed (SIGKILL) while the others wait in an all-to-all
 *              on the world and on its Ulysses group, and with its own op
 *              pending on its ring group: the others get PEER_LOST naming it
 *              within seconds; groups without it carry on; then the daemon
 *              serves a new job.
 *
 * The all-to-all used throughout is small and fully checked: P ranks, seq->head,
 * fp32 BSHD, B = 1, S = 2P rows, 2P heads of dim 4; element (row, head, d) of the
 * full tensor is row * 1000 + head * 10 + d.
 */
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include "sp_test.h"

#define TIMEOUT_MS    20000      /* client waits: generous; nothing should take long */
#define OP_TIMEOUT_MS 2500       /* the daemon's timeout for the ops meant to time out */
#define BUF_BYTES     16384
#define SENTINEL      0xA5
#define D             4          /* head dim */

/* ================================================================ the all-to-all */

static float value(uint32_t row, uint32_t head, uint32_t d)
{
    return (float)(row * 1000 + head * 10 + d);
}

/* Rank p's input: its 2 rows of the [2P, 2P, D] tensor. */
static void fill_send(float *send, uint32_t P, uint32_t p)
{
    uint32_t H = 2 * P;
    for (uint32_t s = 0; s < 2; s++)
        for (uint32_t hd = 0; hd < H; hd++)
            for (uint32_t d = 0; d < D; d++)
                send[(s * H + hd) * D + d] = value(p * 2 + s, hd, d);
}

/* Rank p's output: every row, heads 2p and 2p + 1. */
static void check_recv(const float *recv, uint32_t P, uint32_t p, const char *what)
{
    for (uint32_t row = 0; row < 2 * P; row++)
        for (uint32_t hl = 0; hl < 2; hl++)
            for (uint32_t d = 0; d < D; d++) {
                float got = recv[(row * 2 + hl) * D + d], want = value(row, 2 * p + hl, d);
                if (got != want)
                    SP_FAIL("%s: group rank %u: row %u head %u dim %u: got %g, expected %g", what, p, row,
                            2 * p + hl, d, (double)got, (double)want);
            }
    const uint8_t *tail = (const uint8_t *)(recv + 2 * P * 2 * D);
    for (size_t i = 0; i < 256; i++)
        if (tail[i] != SENTINEL)
            SP_FAIL("%s: group rank %u: byte %zu past the output was written", what, p, i);
}

static void sentinel(void *buf, size_t n)
{
    memset(buf, SENTINEL, n);
}

static void check_untouched(const void *buf, size_t n, const char *what)
{
    const uint8_t *b = buf;
    for (size_t i = 0; i < n; i++)
        if (b[i] != SENTINEL)
            SP_FAIL("%s: byte %zu of a receive buffer was written (0x%02x) by a failed op", what, i, b[i]);
}

static spc_alltoall_desc_t good_desc(spc_group_t g, uint32_t P, const void *send, void *recv)
{
    spc_alltoall_desc_t d;
    memset(&d, 0, sizeof d);
    d.struct_size = sizeof d;
    d.group = g;
    d.dtype = SPC_F32;
    d.direction = SPC_SEQ_TO_HEAD;
    d.layout = SPC_LAYOUT_BSHD;
    d.batch = 1;
    d.seq_len = 2 * P;
    d.ntensors = 1;
    d.tensors[0] = (spc_a2a_tensor_t){ send, recv, 2 * P, D, SPC_HEADS_Q, 0 };
    return d;
}

/* A correct all-to-all over group g (P ranks, this one p), checked. */
static void good_alltoall(spc_handle_t *h, spc_group_t g, uint32_t P, uint32_t p, const char *what)
{
    float *send = spc_alloc(h, BUF_BYTES), *recv = spc_alloc(h, BUF_BYTES);
    CHECK(send != NULL && recv != NULL);
    fill_send(send, P, p);
    sentinel(recv, BUF_BYTES);
    spc_alltoall_desc_t d = good_desc(g, P, send, recv);
    spc_status_t st = spc_alltoall(h, &d, TIMEOUT_MS);
    if (st != SPC_OK)
        SP_FAIL("%s: group rank %u: %s (%s)", what, p, spc_status_name(st), spc_last_error(h));
    check_recv(recv, P, p, what);
    spc_free(h, send);
    spc_free(h, recv);
}

/* Submits d, expects `want` with every needle in the detail. */
static void expect_a2a(spc_handle_t *h, const spc_alltoall_desc_t *d, spc_status_t want, const char *what,
                       const char *n1, const char *n2)
{
    spc_status_t st = spc_alltoall(h, d, TIMEOUT_MS);
    if (st != want)
        SP_FAIL("%s: got %s (%s), expected %s", what, spc_status_name(st), spc_last_error(h), spc_status_name(want));
    if (n1 != NULL && strstr(spc_last_error(h), n1) == NULL)
        SP_FAIL("%s: detail \"%s\" does not name \"%s\"", what, spc_last_error(h), n1);
    if (n2 != NULL && strstr(spc_last_error(h), n2) == NULL)
        SP_FAIL("%s: detail \"%s\" does not name \"%s\"", what, spc_last_error(h), n2);
}

/* ================================================================ JSON of spctl */

/*
 * Polls `spctl --json ops` until op #seq of group g shows `arrived` ranks
 * (copying its record into rec), or, with arrived = 0, until it is gone.
 * Returns whether that happened within timeout_ms.
 */
static bool wait_op(spc_group_t g, uint64_t seq, long long arrived, char *rec, size_t len, int timeout_ms)
{
    static char out[65536];
    char needle[32];
    snprintf(needle, sizeof needle, "\"group\":%u,", g);
    for (uint64_t end = sp_test_now_ms() + (uint64_t)timeout_ms; sp_test_now_ms() < end; usleep(2000)) {
        CHECK_EQ(sp_test_run(out, sizeof out, "%s --json ops", sp_test_spctl_bin()), 0);
        CHECK(out[0] == '[');
        bool found = false;
        for (const char *p = out; !found && (p = strstr(p, needle)) != NULL; p++)
            found = sp_test_json_record(out, p, needle, rec, len) && sp_test_json_int(rec, "seq") == (long long)seq;
        if (arrived == 0 && !found)
            return true;
        if (arrived > 0 && found && sp_test_json_int(rec, "arrived") == arrived)
            return true;
    }
    return false;
}

/* ================================================================ mismatch */

static int rank_mismatch(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    uint32_t P = (uint32_t)nranks, p = (uint32_t)rank;
    uint8_t *send = spc_alloc(h, BUF_BYTES), *recv = spc_alloc(h, BUF_BYTES);
    uint8_t *ssend = spc_alloc(h, 256), *srecv = spc_alloc(h, 256);
    CHECK(send && recv && ssend && srecv);
    CHECK_EQ(P, 3);
    fill_send((float *)send, P, p);
    fill_send((float *)(send + BUF_BYTES / 2), P, p);
    sentinel(recv, BUF_BYTES);
    sentinel(srecv, 256);
    memset(ssend, 1, 256);
    spc_alltoall_desc_t d;

    /* One rank's dtype. */
    d = good_desc(world, P, send, recv);
    if (rank == 2)
        d.dtype = SPC_F16;
    expect_a2a(h, &d, SPC_ERR_MISMATCH, "dtype", "rank 2 sent dtype fp16, rank 0 sent fp32", NULL);
    check_untouched(recv, BUF_BYTES, "dtype mismatch");

    /* Heads on one rank, head_dim on another: both named. */
    d = good_desc(world, P, send, recv);
    if (rank == 1)
        d.tensors[0].head_dim = 8;
    if (rank == 2)
        d.tensors[0].heads = 3;
    expect_a2a(h, &d, SPC_ERR_MISMATCH, "heads", "rank 1 sent tensor 0 head_dim 8, rank 0 sent 4",
               "rank 2 sent tensor 0 heads 3, rank 0 sent 6");
    check_untouched(recv, BUF_BYTES, "heads mismatch");

    /* Rank 0 itself is the odd one: every other rank is named against it. */
    d = good_desc(world, P, send, recv);
    if (rank == 0)
        d.batch = 2;
    expect_a2a(h, &d, SPC_ERR_MISMATCH, "batch", "rank 1 sent batch 1, rank 0 sent 2",
               "rank 2 sent batch 1, rank 0 sent 2");
    check_untouched(recv, BUF_BYTES, "batch mismatch");

    /* Direction and layout. */
    d = good_desc(world, P, send, recv);
    if (rank == 1)
        d.direction = SPC_HEAD_TO_SEQ;
    if (rank == 2)
        d.layout = SPC_LAYOUT_SBHD;
    expect_a2a(h, &d, SPC_ERR_MISMATCH, "direction", "rank 1 sent direction head->seq, rank 0 sent seq->head",
               "rank 2 sent layout SBHD, rank 0 sent BSHD");
    check_untouched(recv, BUF_BYTES, "direction mismatch");

    /* GQA grouping and the number of tensors. */
    d = good_desc(world, P, send, recv);
    if (rank == 1)
        d.kv_heads = 3;
    if (rank == 2) {
        d.ntensors = 2;
        d.tensors[1] = (spc_a2a_tensor_t){ send + BUF_BYTES / 2, recv + BUF_BYTES / 2, 3, D, SPC_HEADS_KV, 0 };
    }
    expect_a2a(h, &d, SPC_ERR_MISMATCH, "kv_heads", "rank 1 sent kv_heads 3, rank 0 sent 0",
               "rank 2 sent tensors 2, rank 0 sent 1");
    check_untouched(recv, BUF_BYTES, "kv_heads mismatch");

    /* Op order: rank 2 shifts first, then does the all-to-all; the others the
     * other way round. Both collectives are refused, each naming the swap. */
    d = good_desc(world, P, send, recv);
    spc_shift_desc_t sh;
    memset(&sh, 0, sizeof sh);
    sh.struct_size = sizeof sh;
    sh.group = world;
    sh.ntensors = 1;
    sh.tensors[0].send = ssend;
    sh.tensors[0].recv = srecv;
    sh.tensors[0].bytes = 64;
    spc_request_t *first, *second;
    if (rank == 2) {
        CHECK_OK(h, spc_ishift(h, &sh, &first));
        CHECK_OK(h, spc_ialltoall(h, &d, &second));
    } else {
        CHECK_OK(h, spc_ialltoall(h, &d, &first));
        CHECK_OK(h, spc_ishift(h, &sh, &second));
    }
    CHECK_EQ(spc_wait(first, TIMEOUT_MS), SPC_ERR_MISMATCH);
    CHECK_CONTAINS(spc_request_detail(first), "rank 2 submitted shift where rank 0 submitted alltoall");
    CHECK_EQ(spc_wait(second, TIMEOUT_MS), SPC_ERR_MISMATCH);
    CHECK_CONTAINS(spc_request_detail(second), "rank 2 submitted alltoall where rank 0 submitted shift");
    spc_request_release(first);
    spc_request_release(second);
    check_untouched(recv, BUF_BYTES, "op order mismatch (alltoall)");
    check_untouched(srecv, 256, "op order mismatch (shift)");

    /* The group goes on: an all-to-all and a shift that agree. */
    good_alltoall(h, world, P, p, "all-to-all after the mismatches");
    CHECK_OK(h, spc_shift(h, &sh, TIMEOUT_MS));
    for (int i = 0; i < 64; i++)
        CHECK_EQ(srecv[i], 1);
    CHECK_EQ(srecv[64], SENTINEL);
    return 0;
}

/* ================================================================ timeout */

/* World 4 = sp 4 = ulysses 2 x ring 2: Ulysses groups {0,1} and {2,3}. Rank 3
 * is the one that is late; it watches the others wait with spctl. */
static int rank_timeout(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    static char rec[8192], out[65536], s[256];
    spc_mesh_spec_t spec = { .struct_size = sizeof spec, .sp = 4, .ulysses = 2, .ring = 2, .heads = 4 };
    spc_mesh_t m;
    CHECK_OK(h, spc_mesh_create(h, &spec, &m));
    CHECK_EQ(m.ulysses_rank, (uint32_t)rank % 2);
    float *send = spc_alloc(h, BUF_BYTES), *recv = spc_alloc(h, BUF_BYTES);
    CHECK(send != NULL && recv != NULL);
    fill_send(send, 4, (uint32_t)rank);
    sentinel(recv, BUF_BYTES);
    spc_alltoall_desc_t d = good_desc(world, 4, send, recv);
    d.timeout_ms = OP_TIMEOUT_MS;
    char want[200];
    uint64_t t0;

    /* 1. The world: ranks 0-2 wait for rank 3 until their op's timeout. */
    snprintf(want, sizeof want, "timed out waiting for rank 3 (1 of 4 missing) in alltoall #0 of world group %u",
             world);
    if (rank < 3) {
        t0 = sp_test_now_ms();
        expect_a2a(h, &d, SPC_ERR_TIMEOUT, "world timeout", want, NULL);
        uint64_t took = sp_test_now_ms() - t0;
        if (took < OP_TIMEOUT_MS - 100 || took > OP_TIMEOUT_MS + 5000)
            SP_FAIL("rank %d: the world all-to-all timed out after %" PRIu64 " ms; its timeout_ms is %d", rank,
                    took, OP_TIMEOUT_MS);
        check_untouched(recv, BUF_BYTES, "world timeout");
    } else {
        if (!wait_op(world, 0, 3, rec, sizeof rec, OP_TIMEOUT_MS))
            SP_FAIL("spctl ops never showed 3 ranks waiting in the world all-to-all");
        sp_test_json_str(rec, "op", s, sizeof s);
        CHECK_STREQ(s, "alltoall");
        sp_test_json_str(rec, "kind", s, sizeof s);
        CHECK_STREQ(s, "world");
        CHECK_EQ(sp_test_json_int(rec, "channel"), 0);
        CHECK_EQ(sp_test_json_int(rec, "seq"), 0);
        CHECK_EQ(sp_test_json_int(rec, "size"), 4);
        sp_test_json_str(rec, "arrived_ranks", s, sizeof s);
        CHECK_STREQ(s, "0 1 2");
        sp_test_json_str(rec, "missing_ranks", s, sizeof s);
        CHECK_STREQ(s, "3");
        double w = sp_test_json_double(rec, "waiting_s"), left = sp_test_json_double(rec, "timeout_in_s");
        CHECK(w >= 0 && w < OP_TIMEOUT_MS / 1000.0);
        CHECK(left <= OP_TIMEOUT_MS / 1000.0 + 0.01);
        /* And in text. */
        CHECK_EQ(sp_test_run(out, sizeof out, "%s ops", sp_test_spctl_bin()), 0);
        printf("$ spctl ops   (rank 3 late in the world)\n%s", out);
        fflush(stdout);
        snprintf(s, sizeof s, "group %u (world, 4 ranks) channel 0: alltoall #0, ", world);
        CHECK_CONTAINS(out, s);
        CHECK_CONTAINS(out, "  arrived: 0 1 2\n  missing: 3\n");
        /* Once the others gave up it is gone from the list; rank 3 comes late
         * and hears the same at once, so the sequence numbers stay aligned. */
        if (!wait_op(world, 0, 0, rec, sizeof rec, OP_TIMEOUT_MS + 10000))
            SP_FAIL("the timed-out all-to-all stays in spctl ops: %s", rec);
        t0 = sp_test_now_ms();
        expect_a2a(h, &d, SPC_ERR_TIMEOUT, "late rank", want, NULL);
        CHECK(sp_test_now_ms() - t0 < 2000);
        check_untouched(recv, BUF_BYTES, "late rank");
    }

    /* 2. Ulysses group {2,3}: rank 2 waits for rank 3 (group rank 1); group
     * {0,1} meanwhile works. */
    d = good_desc(m.ulysses_group, 2, send, recv);
    d.timeout_ms = OP_TIMEOUT_MS;
    fill_send(send, 2, m.ulysses_rank);
    snprintf(want, sizeof want, "timed out waiting for rank 1 (job rank 3) (1 of 2 missing) in alltoall #0 of "
             "ulysses group %u", m.ulysses_group);
    if (rank < 2) {
        good_alltoall(h, m.ulysses_group, 2, m.ulysses_rank, "the other Ulysses group");
    } else if (rank == 2) {
        expect_a2a(h, &d, SPC_ERR_TIMEOUT, "ulysses timeout", want, NULL);
        check_untouched(recv, BUF_BYTES, "ulysses timeout");
    } else {
        if (!wait_op(m.ulysses_group, 0, 1, rec, sizeof rec, OP_TIMEOUT_MS))
            SP_FAIL("spctl ops never showed rank 2 waiting in its Ulysses all-to-all");
        sp_test_json_str(rec, "kind", s, sizeof s);
        CHECK_STREQ(s, "ulysses");
        CHECK_EQ(sp_test_json_int(rec, "size"), 2);
        sp_test_json_str(rec, "arrived_ranks", s, sizeof s);
        CHECK_STREQ(s, "0(2)");
        sp_test_json_str(rec, "missing_ranks", s, sizeof s);
        CHECK_STREQ(s, "1(3)");
        CHECK_EQ(sp_test_run(out, sizeof out, "%s ops", sp_test_spctl_bin()), 0);
        printf("$ spctl ops   (rank 3 late in its Ulysses group)\n%s", out);
        fflush(stdout);
        CHECK_CONTAINS(out, "  arrived: 0(2)\n  missing: 1(3)\n");
        if (!wait_op(m.ulysses_group, 0, 0, rec, sizeof rec, OP_TIMEOUT_MS + 10000))
            SP_FAIL("the timed-out Ulysses all-to-all stays in spctl ops: %s", rec);
        expect_a2a(h, &d, SPC_ERR_TIMEOUT, "late rank, ulysses", want, NULL);
    }

    /* 3. Everyone again: both groups work. */
    good_alltoall(h, world, 4, (uint32_t)rank, "world after the timeouts");
    good_alltoall(h, m.ulysses_group, 2, m.ulysses_rank, "Ulysses group after the timeouts");
    CHECK_OK(h, spc_barrier(h, world, TIMEOUT_MS));
    return 0;
}

/* ================================================================ bounds */

static int rank_bounds(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    uint32_t P = (uint32_t)nranks, p = (uint32_t)rank;
    static uint8_t small[64] __attribute__((aligned(64)));
    char want[128];
    float *send = spc_alloc(h, BUF_BYTES), *recv = spc_alloc(h, BUF_BYTES);
    CHECK(send != NULL && recv != NULL);
    CHECK_EQ(P, 3);
    fill_send(send, P, p);
    sentinel(recv, BUF_BYTES);
    sentinel(small, sizeof small);
    spc_region_t reg;
    CHECK_OK(h, spc_register(h, small, sizeof small, &reg));
    spc_alltoall_desc_t d;

    /* Rank 1's receive is a 64-byte region; the op writes 192 bytes there. */
    d = good_desc(world, P, send, recv);
    if (rank == 1) {
        d.tensors[0].recv = small;
        expect_a2a(h, &d, SPC_ERR_OUT_OF_BOUNDS, "small receive", "alltoall receive 0 tensor: 192 bytes at offset 0 "
                   "exceed region", NULL);
    } else {
        expect_a2a(h, &d, SPC_ERR_PEER_REFUSED, "peer's small receive", "rank 1's request was refused: alltoall "
                   "receive 0 tensor", NULL);
    }
    check_untouched(recv, BUF_BYTES, "small receive");
    check_untouched(small, sizeof small, "small receive");

    /* Rank 2's send is the small region: 192 bytes read from 64. */
    d = good_desc(world, P, send, recv);
    if (rank == 2) {
        d.tensors[0].send = small;
        expect_a2a(h, &d, SPC_ERR_OUT_OF_BOUNDS, "small send", "alltoall send 0 tensor: 192 bytes", NULL);
    } else {
        expect_a2a(h, &d, SPC_ERR_PEER_REFUSED, "peer's small send", "rank 2's request was refused", NULL);
    }
    check_untouched(recv, BUF_BYTES, "small send");

    /* Summed replicas of a type that has no sum: refused on every rank, not
     * quietly given the first copy. */
    d = good_desc(world, P, send, recv);
    d.dtype = SPC_U8;
    d.direction = SPC_HEAD_TO_SEQ;
    d.kv_heads = 1;
    d.tensors[0].heads = 1;
    d.tensors[0].kind = SPC_HEADS_KV;
    d.tensors[0].flags = SPC_A2A_SUM_REPLICAS;
    expect_a2a(h, &d, SPC_ERR_UNSUPPORTED, "u8 replica sum", "replicas of uint8 cannot be summed", NULL);
    check_untouched(recv, BUF_BYTES, "u8 replica sum");

    /* Rank 0's receive overlaps its send. */
    d = good_desc(world, P, send, recv);
    if (rank == 0) {
        d.tensors[0].recv = send + 4;
        expect_a2a(h, &d, SPC_ERR_INVALID_ARG, "overlap", "receive 0 overlaps", NULL);
    } else {
        expect_a2a(h, &d, SPC_ERR_PEER_REFUSED, "peer's overlap", "rank 0's request was refused", NULL);
    }
    check_untouched(recv, BUF_BYTES, "overlap");

    /* Rank 1's send is registered memory it unmapped: the daemon cannot read it,
     * so nothing moves anywhere. */
    d = good_desc(world, P, send, recv);
    if (rank == 1) {
        void *page = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        CHECK(page != MAP_FAILED);
        fill_send(page, P, p);
        spc_region_t pr;
        CHECK_OK(h, spc_register(h, page, 4096, &pr));
        CHECK_EQ(munmap(page, 4096), 0);
        d.tensors[0].send = page;
        expect_a2a(h, &d, SPC_ERR_BAD_REGION, "unmapped send", "cannot read 192 bytes", NULL);
        CHECK_OK(h, spc_deregister(h, pr));
    } else {
        snprintf(want, sizeof want, "rank 1: cannot read 192 bytes");
        expect_a2a(h, &d, SPC_ERR_PEER_REFUSED, "peer's unmapped send", want, NULL);
    }
    check_untouched(recv, BUF_BYTES, "unmapped send");

    /* Rank 2's receive is registered memory it unmapped: the others get their
     * data; only rank 2's write-back fails. */
    d = good_desc(world, P, send, recv);
    if (rank == 2) {
        void *page = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        CHECK(page != MAP_FAILED);
        spc_region_t pr;
        CHECK_OK(h, spc_register(h, page, 4096, &pr));
        CHECK_EQ(munmap(page, 4096), 0);
        d.tensors[0].recv = page;
        expect_a2a(h, &d, SPC_ERR_BAD_REGION, "unmapped receive", "registered memory", NULL);
        CHECK_OK(h, spc_deregister(h, pr));
    } else {
        CHECK_OK(h, spc_alltoall(h, &d, TIMEOUT_MS));
        check_recv(recv, P, p, "beside an unmapped receive");
        sentinel(recv, BUF_BYTES);
    }

    /* The group goes on. */
    good_alltoall(h, world, P, p, "all-to-all after the refusals");
    CHECK_OK(h, spc_deregister(h, reg));
    return 0;
}

/* ================================================================ peer lost */

static char job_id[SPC_JOB_ID_MAX];
static int hold[2];    /* rank 3 blocks reading this; nobody writes */

/* World 4 = sp 4 = ulysses 2 x ring 2: Ulysses {0,1} {2,3}, rings {0,2} {1,3}. */
static int rank_lost(void *arg)
{
    int rank = (int)(intptr_t)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, 4, (uint32_t)rank, TIMEOUT_MS, &world));
    spc_mesh_spec_t spec = { .struct_size = sizeof spec, .sp = 4, .ulysses = 2, .ring = 2, .heads = 4 };
    spc_mesh_t m;
    CHECK_OK(h, spc_mesh_create(h, &spec, &m));
    float *send = spc_alloc(h, BUF_BYTES), *recv = spc_alloc(h, BUF_BYTES), *recv2 = spc_alloc(h, BUF_BYTES);
    CHECK(send && recv && recv2);
    fill_send(send, 4, (uint32_t)rank);
    sentinel(recv, BUF_BYTES);
    sentinel(recv2, BUF_BYTES);
    spc_alltoall_desc_t dw = good_desc(world, 4, send, recv);
    spc_alltoall_desc_t du = good_desc(m.ulysses_group, 2, send, recv2);

    if (rank == 3) {
        /* Its own op waits on its ring group {1,3}, where rank 1 is not yet. */
        spc_request_t *r;
        CHECK_OK(h, spc_ibarrier(h, m.ring_group, &r));
        char c;
        (void)!read(hold[0], &c, 1);   /* killed here */
        return 1;
    }
    spc_request_t *rw, *ru = NULL;
    CHECK_OK(h, spc_ialltoall(h, &dw, &rw));
    if (rank == 2)
        CHECK_OK(h, spc_ialltoall(h, &du, &ru));
    CHECK_EQ(spc_wait(rw, TIMEOUT_MS), SPC_ERR_PEER_LOST);
    CHECK_CONTAINS(spc_request_detail(rw), "rank 3 (pid");
    CHECK_CONTAINS(spc_request_detail(rw), "lost: ");
    spc_request_release(rw);
    if (ru != NULL) {
        CHECK_EQ(spc_wait(ru, TIMEOUT_MS), SPC_ERR_PEER_LOST);
        CHECK_CONTAINS(spc_request_detail(ru), "rank 3 (pid");
        spc_request_release(ru);
    }
    check_untouched(recv, BUF_BYTES, "world all-to-all with a lost peer");
    check_untouched(recv2, BUF_BYTES, "Ulysses all-to-all with a lost peer");

    /* Groups without rank 3 carry on; groups with it fail at once. */
    uint64_t t0 = sp_test_now_ms();
    if (rank < 2)
        good_alltoall(h, m.ulysses_group, 2, m.ulysses_rank, "Ulysses group {0,1} after rank 3 died");
    if (rank == 0 || rank == 2)
        CHECK_OK(h, spc_barrier(h, m.ring_group, TIMEOUT_MS));
    else
        CHECK_ST(h, spc_barrier(h, m.ring_group, TIMEOUT_MS), SPC_ERR_PEER_LOST);
    if (rank == 2)
        CHECK_ST(h, spc_alltoall(h, &du, TIMEOUT_MS), SPC_ERR_PEER_LOST);
    CHECK_ST(h, spc_alltoall(h, &dw, TIMEOUT_MS), SPC_ERR_PEER_LOST);
    CHECK_CONTAINS(spc_last_error(h), "rank 3");
    CHECK(sp_test_now_ms() - t0 < 5000);
    spc_detach(h);
    return 0;
}

/* The records of the "ops" query that are on `kind` groups with `arrived` ranks. */
static bool ops_show(spc_handle_t *q, const char *kind, int64_t arrived, const char *arrived_ranks)
{
    spc_query_result_t *r;
    bool found = false;
    CHECK_OK(q, spc_query(q, "ops", "", &r));
    for (size_t i = 0; i < spc_query_records(r); i++) {
        long k = spc_query_find(r, i, "kind"), a = spc_query_find(r, i, "arrived"),
             ar = spc_query_find(r, i, "arrived_ranks");
        CHECK(k >= 0 && a >= 0 && ar >= 0);
        if (strcmp(spc_query_str(r, i, (size_t)k), kind) == 0 && spc_query_int(r, i, (size_t)a) == arrived &&
            strcmp(spc_query_str(r, i, (size_t)ar), arrived_ranks) == 0)
            found = true;
    }
    spc_query_free(r);
    return found;
}

static int rank_after(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    good_alltoall(h, world, (uint32_t)nranks, (uint32_t)rank, "the next job");
    return 0;
}

static void test_peer_lost(void)
{
    CHECK(pipe(hold) == 0);
    spc_handle_t *owner = sp_test_attach();
    CHECK_OK(owner, spc_job_create(owner, job_id, sizeof job_id));
    pid_t pids[4];
    for (int r = 0; r < 4; r++)
        pids[r] = sp_test_fork(rank_lost, (void *)(intptr_t)r);

    /* The scene: ranks 0-2 in the world all-to-all, rank 2 in its Ulysses one,
     * rank 3's own barrier pending on its ring. */
    bool ready = false;
    for (uint64_t end = sp_test_now_ms() + TIMEOUT_MS; !ready && sp_test_now_ms() < end; usleep(2000))
        ready = ops_show(owner, "world", 3, "0 1 2") && ops_show(owner, "ulysses", 1, "0(2)") &&
                ops_show(owner, "ring", 1, "1(3)");
    CHECK(ready);

    uint64_t t0 = sp_test_now_ms();
    CHECK_EQ(kill(pids[3], SIGKILL), 0);
    CHECK_EQ(sp_test_wait(pids[3], 5000), -SIGKILL);
    sp_test_wait_all_ok(pids, 3, TIMEOUT_MS);
    uint64_t took = sp_test_now_ms() - t0;
    printf("peer lost: the other ranks were done %" PRIu64 " ms after the kill\n", took);
    CHECK(took < 5000);
    close(hold[0]);
    close(hold[1]);
    spc_detach(owner);

    /* The daemon serves the next job. */
    sp_test_run_job(4, rank_after, NULL);
}

/* ================================================================ main */

int main(void)
{
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);

    uint64_t t = sp_test_now_ms();
    sp_test_run_job(3, rank_mismatch, NULL);
    printf("mismatch: ok (%" PRIu64 " ms)\n", sp_test_now_ms() - t);
    fflush(stdout);

    t = sp_test_now_ms();
    sp_test_run_job(4, rank_timeout, NULL);
    printf("timeout: ok (%" PRIu64 " ms)\n", sp_test_now_ms() - t);
    fflush(stdout);

    t = sp_test_now_ms();
    sp_test_run_job(3, rank_bounds, NULL);
    printf("bounds: ok (%" PRIu64 " ms)\n", sp_test_now_ms() - t);
    fflush(stdout);

    t = sp_test_now_ms();
    test_peer_lost();
    printf("peer lost: ok (%" PRIu64 " ms)\n", sp_test_now_ms() - t);

    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("sp_failures: ok\n");
    return 0;
}
