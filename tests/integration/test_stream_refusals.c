/*
 * Stream order where there may be no GPU, as in CI:
 *
 *   - spc_stream_create says why it cannot: without a driver, SPC_ERR_NO_DEVICE
 *     naming libcuda.so.1; the handle and the daemon go on serving.
 *   - StreamCreateReq with nonsense (a UUID of the wrong length, no or an
 *     over-long PCI bus id) is refused with SPC_ERR_INVALID_ARG before the
 *     driver sees it; a well-formed one for a GPU spd cannot open is refused
 *     with SPC_ERR_NO_DEVICE (or SPC_ERR_NO_DEVICE / UNSUPPORTED where a driver
 *     is); one giving a stream back (resume) at a slot out of range, at a done
 *     its page does not hold, or with settled ops out of order or beyond the
 *     window is SPC_ERR_INVALID_ARG; StreamDestroyReq of a slot never given is
 *     SPC_ERR_NOT_FOUND; the session stays usable.
 *   - An op whose SQ entry names a stream slot the client does not have (only a
 *     broken library writes one) fails with SPC_ERR_INVALID_ARG, and its
 *     partner hears it; the ranks' next op succeeds.
 */
#include <dlfcn.h>
#include <unistd.h>

#include "internal.h"   /* the segment's layout, to write an SQ entry by hand */
#include "sp_futex.h"
#include "sp_test.h"

static void test_client(void)
{
    spc_handle_t *h = sp_test_attach();
    void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    spc_stream_t *s = (spc_stream_t *)(uintptr_t)0x1234;

    if (driver == NULL) {
        CHECK_ST(h, spc_stream_create(h, NULL, &s), SPC_ERR_NO_DEVICE);
        CHECK_CONTAINS(spc_last_error(h), "libcuda.so.1");
        printf("no driver: %s\n", spc_last_error(h));
        CHECK(s == (spc_stream_t *)(uintptr_t)0x1234);   /* outputs are set only on success */
    } else {
        dlclose(driver);
    }
    CHECK_ST(h, spc_stream_create(h, NULL, NULL), SPC_ERR_INVALID_ARG);
    CHECK(spc_get_stream(h) == NULL);
    CHECK_OK(h, spc_set_stream(h, NULL));
    CHECK_EQ(spc_stream_seq(NULL), 0);
    CHECK_OK(h, spc_stream_destroy(NULL));
    CHECK_OK(h, spc_noop(h, 5000));
    spc_detach(h);
}

static void expect_error(int fd, Spd__Msg *m, spc_status_t want, const char *needle)
{
    sp_test_raw_send_msg(fd, m);
    Spd__Msg *rep = sp_test_raw_recv(fd, 5000, NULL);
    CHECK(rep != NULL && rep->body_case == SPD__MSG__BODY_ERROR);
    if (rep->error->status != (int32_t)want)
        SP_FAIL("got %s (%s), want %s", spc_status_name((spc_status_t)rep->error->status), rep->error->detail,
                spc_status_name(want));
    CHECK_CONTAINS(rep->error->detail, needle);
    printf("refused: %s\n", rep->error->detail);
    sp_msg_free(rep);
}

static void test_raw(void)
{
    int fd = sp_test_raw_connect(getenv("SPC_SOCKET"));
    sp_test_raw_hello(fd, SPD__HELLO__ROLE__CLIENT);
    uint8_t uuid[16] = { 1, 2, 3 };
    Spd__StreamCreateReq r = SPD__STREAM_CREATE_REQ__INIT;
    Spd__Msg m = SPD__MSG__INIT;
    m.body_case = SPD__MSG__BODY_STREAM_CREATE_REQ;
    m.stream_create_req = &r;

    r.pci_bus_id = "0000:00:06.0";
    r.uuid.data = uuid;
    r.uuid.len = 15;
    m.seq = 1;
    expect_error(fd, &m, SPC_ERR_INVALID_ARG, "UUID of 15 bytes");
    r.uuid.len = 16;
    r.pci_bus_id = "";
    m.seq = 2;
    expect_error(fd, &m, SPC_ERR_INVALID_ARG, "PCI bus id of 0 characters");
    r.pci_bus_id = "0000:00:06.0-and-then-far-too-long-for-a-bus-id";
    m.seq = 3;
    expect_error(fd, &m, SPC_ERR_INVALID_ARG, "want 1 to 31");
    /* Well formed, for a GPU this machine's spd cannot open. */
    r.pci_bus_id = "0000:ff:1f.7";
    m.seq = 4;
    if (dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL) == NULL)
        expect_error(fd, &m, SPC_ERR_NO_DEVICE, "cannot order ops on GPU streams");
    else
        expect_error(fd, &m, SPC_ERR_NO_DEVICE, "not visible to spd");

    /* A stream given back after a take-over, at odds with the segment's page
     * (every done there is 0) or with itself: refused before any GPU is
     * looked for. */
    r.resume = true;
    r.slot = 1u << 20;
    m.seq = 41;
    expect_error(fd, &m, SPC_ERR_INVALID_ARG, "slot 1048576 back");
    r.slot = 2;
    r.done = 7;
    m.seq = 42;
    expect_error(fd, &m, SPC_ERR_INVALID_ARG, "its page says done 0, the client 7");
    uint64_t settled[2] = { 3, 2 };
    r.done = 0;
    r.settled = settled;
    r.n_settled = 2;
    m.seq = 43;
    expect_error(fd, &m, SPC_ERR_INVALID_ARG, "settled op 2 is not past the one before");
    settled[0] = 1u << 30;
    r.n_settled = 1;
    m.seq = 44;
    expect_error(fd, &m, SPC_ERR_INVALID_ARG, "settled op 1073741824 is not past the one before and within");
    r.resume = false;
    r.n_settled = 0;

    Spd__StreamDestroyReq dr = SPD__STREAM_DESTROY_REQ__INIT;
    dr.slot = 5;
    m.body_case = SPD__MSG__BODY_STREAM_DESTROY_REQ;
    m.stream_destroy_req = &dr;
    m.seq = 5;
    expect_error(fd, &m, SPC_ERR_NOT_FOUND, "no stream 5");
    dr.slot = 1u << 30;
    m.seq = 6;
    expect_error(fd, &m, SPC_ERR_NOT_FOUND, "no stream");

    /* The session still answers. */
    Spd__QueryReq q = SPD__QUERY_REQ__INIT;
    q.topic = "status";
    m.body_case = SPD__MSG__BODY_QUERY_REQ;
    m.query_req = &q;
    m.seq = 7;
    sp_test_raw_send_msg(fd, &m);
    Spd__Msg *rep = sp_test_raw_recv(fd, 5000, NULL);
    CHECK(rep != NULL && rep->body_case == SPD__MSG__BODY_QUERY_REP);
    sp_msg_free(rep);
    close(fd);
}

/* Publishes an all-reduce of arena memory whose entry names stream slot
 * `slot`, as a broken library would; returns its user_data. */
static uint64_t submit_bad_stream(spc_handle_t *h, spc_group_t g, double *x, uint32_t slot)
{
    uint32_t idx = h->sq_tail & h->sq_mask;
    uint64_t user_data = 0xFFFFFFFF00000000ull | 0xFFFFFFFFu;   /* no request: the reaper drops it */
    h->v.sqes[idx] = (struct sp_sqe){ .opcode = SP_OP_ALLREDUCE, .dtype = SP_DTYPE_F64, .redop = SP_REDOP_SUM,
                                      .ntensors = 2, .group = g, .user_data = user_data, .count = 4,
                                      .stream = slot + 1, .stream_seq = 1 };
    struct sp_tensor_ref ref = { .region = SP_REGION_ARENA, .dtype = SP_DTYPE_F64,
                                 .offset = (uint64_t)((uint8_t *)x - h->v.arena), .bytes = 4 * sizeof(double) };
    sp_seg_slot_tensor(&h->v, idx)[0] = ref;
    sp_seg_slot_tensor(&h->v, idx)[1] = ref;
    h->sq_tail++;
    sp_store_release(&h->v.sq->tail, h->sq_tail);
    sp_smp_mb();
    spc__wake_daemon(h);
    return user_data;
}

static int rank_main(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    double *x = spc_alloc(h, 4 * sizeof *x);
    for (int i = 0; i < 4; i++)
        x[i] = rank + 1;
    if (rank == 0) {
        submit_bad_stream(h, world, x, 7);
    } else {
        /* The partner sees the collective fail, naming rank 0 and why. */
        CHECK_ST(h, spc_allreduce(h, world, x, x, 4, SPC_F64, SPC_SUM, 10000), SPC_ERR_PEER_REFUSED);
        CHECK_CONTAINS(spc_last_error(h), "rank 0");
        CHECK_CONTAINS(spc_last_error(h), "names stream 7, which this client does not have");
        printf("rank 1 hears: %s\n", spc_last_error(h));
    }
    CHECK_OK(h, spc_barrier(h, world, 10000));
    for (int i = 0; i < 4; i++)
        x[i] = rank + 1;
    CHECK_OK(h, spc_allreduce(h, world, x, x, 4, SPC_F64, SPC_SUM, 10000));
    CHECK(x[3] == 3.0);
    spc_free(h, x);
    return 0;
}

int main(void)
{
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    test_client();
    test_raw();
    sp_test_run_job(2, rank_main, NULL);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("ok\n");
    return 0;
}
