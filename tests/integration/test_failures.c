/*
 * Bad input: malformed, oversized and truncated frames; requests naming memory the
 * client does not own. Each gets a clear error (or its connection is dropped),
 * nothing is written where it should not be, and the daemon keeps serving: a
 * second client completes a job afterwards every time.
 */
#include <sys/mman.h>
#include <unistd.h>

#include "sp_test.h"

/* The daemon's answer to a framing error: an Error frame, then end of stream. */
static void expect_error_then_eof(int fd, spc_status_t st, const char *detail)
{
    bool eof;
    Spd__Msg *m = sp_test_raw_recv(fd, 5000, &eof);
    CHECK(m != NULL);
    CHECK_EQ(m->body_case, SPD__MSG__BODY_ERROR);
    CHECK_EQ(m->error->status, st);
    CHECK_CONTAINS(m->error->detail, detail);
    sp_msg_free(m);
    CHECK(sp_test_raw_recv(fd, 5000, &eof) == NULL);
    CHECK(eof);
}

static void test_frames(const sp_test_daemon_t *d)
{
    uint8_t hdr[8];

    /* Over the size limit: refused from the header alone, before any payload. */
    int fd = sp_test_raw_connect(d->sock);
    sp_test_raw_hello(fd, SPD__HELLO__ROLE__CLIENT);
    sp_frame_header_write(hdr, 64u << 20);
    sp_test_raw_send(fd, hdr, sizeof hdr);
    expect_error_then_eof(fd, SPC_ERR_PROTOCOL, "exceeds max_frame_bytes");
    close(fd);
    sp_test_daemon_serves();

    /* Garbage: not an spd frame at all. */
    fd = sp_test_raw_connect(d->sock);
    sp_test_raw_send(fd, "GET / HTTP/1.1\r\n\r\n", 18);
    expect_error_then_eof(fd, SPC_ERR_PROTOCOL, "bad frame magic");
    close(fd);
    sp_test_daemon_serves();

    /* A frame announcing 100 bytes, cut after 10: the daemon drops the session
     * (logged as truncated) and carries on. */
    fd = sp_test_raw_connect(d->sock);
    sp_test_raw_hello(fd, SPD__HELLO__ROLE__CLIENT);
    uint8_t cut[18];
    sp_frame_header_write(cut, 100);
    memset(cut + 8, 0x42, 10);
    sp_test_raw_send(fd, cut, sizeof cut);
    close(fd);
    sp_test_daemon_serves();

    /* A well-framed payload that is not a message: an error, and the session
     * stays usable. */
    fd = sp_test_raw_connect(d->sock);
    sp_test_raw_hello(fd, SPD__HELLO__ROLE__CONTROL);
    uint8_t bad[8 + 7];
    sp_frame_header_write(bad, 7);
    memset(bad + 8, 0xff, 7);
    sp_test_raw_send(fd, bad, sizeof bad);
    Spd__Msg *m = sp_test_raw_recv(fd, 5000, NULL);
    CHECK(m != NULL && m->body_case == SPD__MSG__BODY_ERROR);
    CHECK_EQ(m->error->status, SPC_ERR_PROTOCOL);
    CHECK_CONTAINS(m->error->detail, "does not decode");
    sp_msg_free(m);
    Spd__Msg q = SPD__MSG__INIT;
    Spd__QueryReq qr = SPD__QUERY_REQ__INIT;
    qr.topic = "status";
    q.seq = 2;
    q.body_case = SPD__MSG__BODY_QUERY_REQ;
    q.query_req = &qr;
    sp_test_raw_send_msg(fd, &q);
    m = sp_test_raw_recv(fd, 5000, NULL);
    CHECK(m != NULL && m->body_case == SPD__MSG__BODY_QUERY_REP);
    CHECK_EQ(m->seq, 2);
    sp_msg_free(m);

    /* A request before hello, and a second hello. */
    close(fd);
    fd = sp_test_raw_connect(d->sock);
    sp_test_raw_send_msg(fd, &q);
    expect_error_then_eof(fd, SPC_ERR_PROTOCOL, "first message must be hello");
    close(fd);
    sp_test_daemon_serves();
}

/* ---------------------------------------------------------------- regions */

#define SENTINEL -7.0

struct shared {
    spc_region_t rank0_region;
    int          ready;
};
static struct shared *sh;
static int pipe_r0[2], pipe_r1[2];

static spc_status_t allreduce_refs(spc_handle_t *h, spc_group_t world, spc_tensor_t send, spc_tensor_t recv)
{
    spc_op_t op = { .struct_size = sizeof op, .opcode = SPC_OP_ALLREDUCE, .group = world, .dtype = SPC_F64,
                    .redop = SPC_SUM, .count = 4, .ntensors = 2, .timeout_ms = 10000 };
    op.tensors[0] = send;
    op.tensors[1] = recv;
    return sp_test_submit_wait(h, &op, 15000);
}

static int rank_regions(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    uint64_t arena;
    spc_arena_usage(h, &arena, NULL);
    double *good = spc_alloc(h, 4 * sizeof *good);
    double *out = spc_alloc(h, 4 * sizeof *out);
    spc_tensor_t g = { .ptr = good }, o = { .ptr = out };

    if (rank == 0) {
        double *mine = malloc(4096);
        CHECK_OK(h, spc_register(h, mine, 4096, &sh->rank0_region));
        CHECK(write(pipe_r0[1], "r", 1) == 1);   /* rank 1 may now name this region */
    } else {
        char c;
        CHECK(read(pipe_r0[0], &c, 1) == 1);
    }

    /* Each case: rank 1's receive tensor is bad. Rank 1 hears what is wrong,
     * rank 0 hears which rank was refused and why; nobody's buffer is written. */
    struct {
        spc_tensor_t recv;
        spc_status_t st;
        const char *detail;
    } cases[] = {
        { { .region = 99999 }, SPC_ERR_BAD_REGION, "region 99999 is not registered by this client" },
        { { .region = sh->rank0_region }, SPC_ERR_BAD_REGION, "is not registered by this client" },
        { { .region = SPC_REGION_ARENA, .offset = 0, .bytes = 8 }, SPC_ERR_INVALID_ARG, "receive tensor holds 8 bytes" },
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        for (int i = 0; i < 4; i++) {
            good[i] = rank + 1;
            out[i] = SENTINEL;
        }
        if (rank == 1) {
            CHECK_ST(h, allreduce_refs(h, world, g, cases[k].recv), cases[k].st);
            CHECK_CONTAINS(spc_last_error(h), cases[k].detail);
        } else {
            CHECK_ST(h, allreduce_refs(h, world, g, o), SPC_ERR_PEER_REFUSED);
            CHECK_CONTAINS(spc_last_error(h), "rank 1's request was refused");
            CHECK_CONTAINS(spc_last_error(h), cases[k].detail);
        }
        for (int i = 0; i < 4; i++)
            CHECK_EQ(out[i], SENTINEL);          /* nothing written */
    }

    /* A pointer outside the arena and every registration never leaves the client. */
    double stack[4];
    spc_request_t *r;
    CHECK_ST(h, spc_iallreduce(h, world, stack, stack, 4, SPC_F64, SPC_SUM, &r), SPC_ERR_BAD_REGION);
    CHECK_CONTAINS(spc_last_error(h), "neither in the arena nor in a registered region");
    /* Nor does an arena offset that no allocation holds: the end of the arena,
     * past it. */
    uint64_t past[] = { arena - 16, UINT64_MAX - 8 };
    for (size_t k = 0; k < sizeof past / sizeof past[0]; k++) {
        spc_tensor_t t = { .region = SPC_REGION_ARENA, .offset = past[k] };
        CHECK_ST(h, allreduce_refs(h, world, g, t), SPC_ERR_BAD_REGION);
        CHECK_CONTAINS(spc_last_error(h), "is in no live allocation");
    }

    /* Registered memory the client unmapped afterwards: the daemon's read fails
     * cleanly (EFAULT), not with a crash. */
    if (rank == 1) {
        void *page = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        spc_region_t gone;
        CHECK_OK(h, spc_register(h, page, 4096, &gone));
        munmap(page, 4096);
        spc_tensor_t t = { .region = gone };
        CHECK_ST(h, allreduce_refs(h, world, t, o), SPC_ERR_BAD_REGION);
        CHECK_CONTAINS(spc_last_error(h), "cannot read");
        /* And registering a range that is not mapped is refused up front. */
        CHECK_OK(h, spc_deregister(h, gone));
        spc_region_t no;
        CHECK_ST(h, spc_register(h, page, 4096, &no), SPC_ERR_BAD_REGION);
    } else {
        CHECK_ST(h, allreduce_refs(h, world, g, o), SPC_ERR_PEER_REFUSED);
        CHECK_CONTAINS(spc_last_error(h), "rank 1");
    }

    /* A region deregistered while an op naming it waits for the other rank: spd
     * checked it at submit, and checks again when every rank is in. */
    if (rank == 1) {
        double *page = malloc(4096);
        for (int i = 0; i < 4; i++)
            page[i] = SENTINEL;
        spc_region_t reg;
        CHECK_OK(h, spc_register(h, page, 4096, &reg));
        spc_op_t op = { .struct_size = sizeof op, .opcode = SPC_OP_ALLREDUCE, .group = world, .dtype = SPC_F64,
                        .redop = SPC_SUM, .count = 4, .ntensors = 2, .timeout_ms = 10000 };
        op.tensors[0] = g;
        op.tensors[1] = (spc_tensor_t){ .region = reg };
        CHECK_OK(h, spc_submit(h, &op, &r));
        CHECK(sp_test_wait_status(h, "ops_inflight", 1, 10000));   /* spd holds it */
        CHECK_OK(h, spc_deregister(h, reg));
        CHECK(write(pipe_r1[1], "d", 1) == 1);
        CHECK_ST(h, spc_wait(r, 15000), SPC_ERR_BAD_REGION);
        CHECK_CONTAINS(spc_request_detail(r), "deregistered while the op waited");
        spc_request_release(r);
        for (int i = 0; i < 4; i++)
            CHECK_EQ(page[i], SENTINEL);
        free(page);
    } else {
        char c;
        CHECK(read(pipe_r1[0], &c, 1) == 1);
        CHECK_ST(h, allreduce_refs(h, world, g, o), SPC_ERR_PEER_REFUSED);
        CHECK_CONTAINS(spc_last_error(h), "deregistered while the op waited");
    }

    /* The group is still good. */
    for (int i = 0; i < 4; i++)
        good[i] = rank + 1;
    CHECK_OK(h, allreduce_refs(h, world, g, o));
    for (int i = 0; i < 4; i++)
        CHECK_EQ(out[i], 3);
    return 0;
}

int main(void)
{
    sp_test_daemon_t d;
    const char *args[] = { "--set", "max_frame_bytes=64K", NULL };
    sp_test_daemon_start(&d, args);
    test_frames(&d);

    sh = sp_test_shared(sizeof *sh);
    CHECK(pipe(pipe_r0) == 0 && pipe(pipe_r1) == 0);
    sp_test_run_job(2, rank_regions, NULL);
    sp_test_daemon_serves();

    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    /* The truncated frame was noticed and said so. */
    char out[256];
    CHECK_EQ(sp_test_run(out, sizeof out, "grep -c 'truncated frame' %s", d.log), 0);
    sp_test_daemon_cleanup(&d);
    printf("failures: ok\n");
    return 0;
}
