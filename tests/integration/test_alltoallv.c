/*
 * The uneven all-to-all across real ranks of a real spd (or, with --nodes 2,
 * of two), checked against a reference this file computes on its own: rank
 * src's send holds, for each rank dst in order, C(src, dst) elements of its
 * own values; rank dst's receive must hold, for each rank src in order, the
 * C(src, dst) elements src made for it.
 *
 *   1. Counts of their own per pair, empty blocks among them, on P = 1 .. 4
 *      ranks, fp32 and bf16 and int64, three ops in flight before the first
 *      wait; nothing past a receive is written.
 *   2. A rank that sends and receives nothing (NULL buffers), and a rank that
 *      only receives (NULL send).
 *   3. Registered memory: on one daemon through the staging (one window, as
 *      an all-to-all's), across daemons
 *      copied and its blocks for the other daemon packed. The same bytes.
 *   4. Refusals: counts that do not pair up (MISMATCH on every rank, naming
 *      the sender, the receiver and both counts), send and receive
 *      overlapping, a NULL buffer with elements to move, a group of one whose
 *      rank expects other than it sends; the group then runs the op again.
 */
#include <stdlib.h>

#include "sp_test.h"

#define MAXR  4
#define TMO   20000
#define TAIL  16           /* guard bytes past each receive */
#define GUARD 0xA5

static const spc_dtype_t DTYPES[] = { SPC_F32, SPC_BF16, SPC_I64 };
static const size_t DT_SIZE[] = { 4, 2, 8 };
#define NDT (sizeof DTYPES / sizeof DTYPES[0])

/* Elements rank src sends rank dst in pattern `salt`: their own per pair, some
 * 0. With `idle` < P, rank idle sends and receives nothing. */
static uint64_t C(int P, int src, int dst, int salt, int idle)
{
    if (src == idle || dst == idle)
        return 0;
    return (uint64_t)((src * 7 + dst * 3 + salt) % 5) * (uint64_t)(salt + 3);
}

/* Byte k of what rank src sends rank dst. */
static uint8_t byte_of(int src, int dst, int salt, uint64_t k)
{
    uint64_t x = ((uint64_t)src * 1000003u + (uint64_t)dst * 7919u + (uint64_t)salt * 104729u + k) * 0x9E3779B97F4A7C15ull;
    return (uint8_t)(x >> 56);
}

typedef struct side {
    uint64_t counts[MAXR];
    uint64_t bytes;
} side_t;

/* Rank r's send and receive counts in pattern salt. */
static void sides(int P, int r, int salt, int idle, side_t *send, side_t *recv)
{
    memset(send, 0, sizeof *send);
    memset(recv, 0, sizeof *recv);
    for (int q = 0; q < P; q++) {
        send->counts[q] = C(P, r, q, salt, idle);
        recv->counts[q] = C(P, q, r, salt, idle);
    }
}

/* Fills rank r's send: block dst is byte_of(r, dst, ...) for C(r, dst) elements. */
static void fill_send(uint8_t *send, int P, int r, int salt, int idle, size_t es)
{
    for (int dst = 0, at = 0; dst < P; dst++)
        for (uint64_t k = 0; k < C(P, r, dst, salt, idle) * es; k++)
            send[at++] = byte_of(r, dst, salt, k);
}

/* Checks rank r's receive: block src is what src made for r; then TAIL guards. */
static void check_recv(const uint8_t *recv, int P, int r, int salt, int idle, size_t es, const char *what)
{
    uint64_t at = 0;
    for (int src = 0; src < P; src++)
        for (uint64_t k = 0; k < C(P, src, r, salt, idle) * es; k++, at++)
            if (recv[at] != byte_of(src, r, salt, k))
                SP_FAIL("%s, P=%d rank %d: byte %" PRIu64 " of the block from rank %d (receive byte %" PRIu64
                        ") is 0x%02x, rank %d sent 0x%02x", what, P, r, k, src, at, recv[at], src,
                        byte_of(src, r, salt, k));
    for (int k = 0; k < TAIL; k++)
        if (recv[at + k] != GUARD)
            SP_FAIL("%s, P=%d rank %d: byte %d past the receive was written", what, P, r, k);
}

static uint64_t total(const uint64_t *counts, int P)
{
    uint64_t n = 0;
    for (int q = 0; q < P; q++)
        n += counts[q];
    return n;
}

static spc_alltoallv_desc_t desc(spc_group_t g, spc_dtype_t dt, const void *send, void *recv, const uint64_t *sc,
                                 const uint64_t *rc)
{
    spc_alltoallv_desc_t d = SPC_ALLTOALLV_DESC_INIT;
    d.group = g;
    d.dtype = dt;
    d.send = send;
    d.recv = recv;
    d.send_counts = sc;
    d.recv_counts = rc;
    d.timeout_ms = TMO;
    return d;
}

/* ---------------------------------------------------------------- 1, 2. arena */

static int rank_arena(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    spc_request_t *req[NDT];
    uint8_t *send[NDT], *recv[NDT];
    side_t s[NDT], r[NDT];
    for (size_t d = 0; d < NDT; d++) {
        int salt = (int)d;
        sides(P, rank, salt, -1, &s[d], &r[d]);
        size_t es = DT_SIZE[d], sb = total(s[d].counts, P) * es, rb = total(r[d].counts, P) * es;
        send[d] = spc_alloc(h, sb + 1);
        recv[d] = spc_alloc(h, rb + TAIL);
        CHECK(send[d] != NULL && recv[d] != NULL);
        fill_send(send[d], P, rank, salt, -1, es);
        memset(recv[d], GUARD, rb + TAIL);
        spc_alltoallv_desc_t ad = desc(world, DTYPES[d], send[d], recv[d], s[d].counts, r[d].counts);
        CHECK_OK(h, spc_ialltoallv(h, &ad, &req[d]));
    }
    for (size_t d = 0; d < NDT; d++) {
        CHECK_EQ(spc_wait(req[d], TMO), SPC_OK);
        spc_request_release(req[d]);
        check_recv(recv[d], P, rank, (int)d, -1, DT_SIZE[d], "arena");
        spc_free(h, send[d]);
        spc_free(h, recv[d]);
    }
    if (P < 2)
        return 0;

    /* 2. The last rank holds nothing; rank 0 sends nothing and only receives. */
    const int idle = P - 1, salt = 4;
    side_t so, ro;
    sides(P, rank, salt, idle, &so, &ro);
    if (rank == 0)
        memset(so.counts, 0, sizeof so.counts);
    uint64_t rb = 0;
    for (int q = 0; q < P; q++) {
        if (q == 0)
            ro.counts[q] = 0;   /* rank 0 sends nothing: its block to anyone is empty */
        rb += ro.counts[q];
    }
    uint8_t *sbuf = NULL, *rbuf = NULL;
    if (rank != idle && rank != 0) {
        sbuf = spc_alloc(h, total(so.counts, P) * 4 + 1);
        CHECK(sbuf != NULL);
        for (int dst = 0, at = 0; dst < P; dst++)
            for (uint64_t k = 0; k < so.counts[dst] * 4; k++)
                sbuf[at++] = byte_of(rank, dst, salt, k);
    }
    if (rank != idle) {
        rbuf = spc_alloc(h, rb * 4 + TAIL);
        CHECK(rbuf != NULL);
        memset(rbuf, GUARD, rb * 4 + TAIL);
    }
    spc_alltoallv_desc_t ad = desc(world, SPC_F32, sbuf, rbuf, so.counts, ro.counts);
    CHECK_OK(h, spc_alltoallv(h, &ad, TMO));
    if (rank != idle) {
        uint64_t at = 0;
        for (int src = 1; src < P; src++)
            for (uint64_t k = 0; k < C(P, src, rank, salt, idle) * 4; k++, at++)
                if (rbuf[at] != byte_of(src, rank, salt, k))
                    SP_FAIL("P=%d rank %d: byte %" PRIu64 " from rank %d wrong with an idle rank", P, rank, k, src);
        CHECK_EQ(at, rb * 4);
        for (int k = 0; k < TAIL; k++)
            CHECK_EQ(rbuf[at + k], GUARD);
        spc_free(h, rbuf);
    }
    if (sbuf != NULL)
        spc_free(h, sbuf);
    return 0;
}

/* ---------------------------------------------------------------- 3. registered memory */

/* Elements per unit of C: blocks of up to 4 x 4093 fp32, every rank's send
 * and receive together within the 2 MiB of staging that the op's one window
 * takes on one daemon. */
#define REG_SCALE 4093u

static int rank_registered(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    const int salt = 1;
    uint64_t sc[MAXR], rc[MAXR];
    for (int q = 0; q < P; q++) {
        sc[q] = C(P, rank, q, salt, -1) * REG_SCALE / (uint64_t)(salt + 3);
        rc[q] = C(P, q, rank, salt, -1) * REG_SCALE / (uint64_t)(salt + 3);
    }
    size_t sb = total(sc, P) * 4, rb = total(rc, P) * 4;
    uint8_t *send = malloc(sb + 1), *recv = malloc(rb + TAIL);
    CHECK(send != NULL && recv != NULL);
    for (int dst = 0, at = 0; dst < P; dst++)
        for (uint64_t k = 0; k < sc[dst] * 4; k++)
            send[at++] = byte_of(rank, dst, 9, k);
    memset(recv, GUARD, rb + TAIL);
    spc_region_t rs, rr;
    CHECK_OK(h, spc_register(h, send, sb + 1, &rs));
    CHECK_OK(h, spc_register(h, recv, rb + TAIL, &rr));
    spc_alltoallv_desc_t ad = desc(world, SPC_F32, send, recv, sc, rc);
    CHECK_OK(h, spc_alltoallv(h, &ad, TMO));
    uint64_t at = 0;
    for (int src = 0; src < P; src++) {
        uint64_t n = C(P, src, rank, salt, -1) * REG_SCALE / (uint64_t)(salt + 3) * 4;
        for (uint64_t k = 0; k < n; k++, at++)
            if (recv[at] != byte_of(src, rank, 9, k))
                SP_FAIL("registered, P=%d rank %d: byte %" PRIu64 " from rank %d is 0x%02x", P, rank, k, src, recv[at]);
    }
    for (int k = 0; k < TAIL; k++)
        CHECK_EQ(recv[at + k], GUARD);
    CHECK_OK(h, spc_deregister(h, rs));
    CHECK_OK(h, spc_deregister(h, rr));
    free(send);
    free(recv);
    return 0;
}

/* ---------------------------------------------------------------- 4. refusals */

/* Rank 2 expects 3 elements from rank 1, which sends it 2: every rank hears
 * MISMATCH naming both and both counts; then the same group runs it right. */
static int rank_mismatch(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    uint64_t sc[MAXR], rc[MAXR];
    for (int q = 0; q < P; q++)
        sc[q] = rc[q] = 2;
    if (rank == 2)
        rc[1] = 3;
    float *send = spc_alloc(h, 64 * sizeof(float)), *recv = spc_alloc(h, 64 * sizeof(float));
    CHECK(send != NULL && recv != NULL);
    memset(send, 0, 64 * sizeof(float));
    spc_alltoallv_desc_t ad = desc(world, SPC_F32, send, recv, sc, rc);
    spc_request_t *r;
    CHECK_OK(h, spc_ialltoallv(h, &ad, &r));
    CHECK_EQ(spc_wait(r, TMO), SPC_ERR_MISMATCH);
    CHECK_CONTAINS(spc_request_detail(r), "rank 1");
    CHECK_CONTAINS(spc_request_detail(r), "sends 2 elements to rank 2");
    CHECK_CONTAINS(spc_request_detail(r), "which expects 3 from it");
    if (rank == 0)
        printf("counts that do not pair up: %s\n", spc_request_detail(r));
    spc_request_release(r);

    /* Overlap, and a NULL with elements, are each rank's own refusal. */
    rc[1] = 2;
    ad = desc(world, SPC_F32, send, send + 1, sc, rc);
    CHECK_ST(h, spc_alltoallv(h, &ad, TMO), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(h), "overlap");
    ad = desc(world, SPC_F32, NULL, recv, sc, rc);
    CHECK_ST(h, spc_alltoallv(h, &ad, TMO), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(h), "send is NULL");

    /* spd still serves the group. */
    for (int q = 0; q < P; q++)
        send[2 * q] = (float)(rank * 10 + q), send[2 * q + 1] = -(float)(rank * 10 + q);
    ad = desc(world, SPC_F32, send, recv, sc, rc);
    CHECK_OK(h, spc_alltoallv(h, &ad, TMO));
    for (int q = 0; q < P; q++) {
        CHECK_EQ(recv[2 * q], (float)(q * 10 + rank));
        CHECK_EQ(recv[2 * q + 1], -(float)(q * 10 + rank));
    }
    spc_free(h, send);
    spc_free(h, recv);
    return 0;
}

static int rank_alone(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    uint64_t sc[1] = { 4 }, rc[1] = { 5 };
    float *buf = spc_alloc(h, 64);
    CHECK(buf != NULL);
    spc_alltoallv_desc_t ad = desc(world, SPC_F32, buf, buf + 8, sc, rc);
    CHECK_ST(h, spc_alltoallv(h, &ad, TMO), SPC_ERR_MISMATCH);
    CHECK_CONTAINS(spc_last_error(h), "rank 0 sends 4 elements to itself and expects 5");
    spc_free(h, buf);
    return 0;
}

int main(int argc, char **argv)
{
    uint64_t t0 = sp_test_now_ms();
    sp_test_daemon_t d;

    setenv("SPD_STAGING_BYTES", "2M", 1);   /* every daemon the test starts */
    int nodes = sp_test_start(&d, argc, argv);
    for (int P = nodes; P <= MAXR; P++)
        sp_test_run_job(P, rank_arena, NULL);
    printf("1, 2. counts of their own per pair, fp32, bf16 and int64, P = %d .. %d, an idle rank and one that only "
           "receives: every block where it belongs\n", nodes, MAXR);
    sp_test_run_job(MAXR, rank_registered, NULL);
    printf("3. registered memory through the staging: the same bytes\n");
    sp_test_run_job(3, rank_mismatch, NULL);
    if (nodes == 1)
        sp_test_run_job(1, rank_alone, NULL);
    printf("4. refusals: counts that do not pair up, overlap, NULL with elements, a rank alone; then served again\n");

    CHECK_EQ(sp_test_cluster_stop(), 0);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("alltoallv: ok (%" PRIu64 " ms)\n", sp_test_now_ms() - t0);
    return 0;
}
