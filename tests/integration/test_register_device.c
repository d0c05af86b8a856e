/*
 * Device registration where there may be no GPU, as in CI:
 *
 *   - spc_register_device says why it cannot: without a driver, SPC_ERR_NO_DEVICE
 *     naming libcuda.so.1; with one, a host pointer is refused as not device
 *     memory. Either way the daemon keeps serving the handle and others.
 *   - RegisterDeviceReq with nonsense (an IPC handle of the wrong length, a
 *     UUID of the wrong length, no PCI bus id, an empty allocation, a range past
 *     the allocation) is refused with SPC_ERR_INVALID_ARG before the driver
 *     sees it, and the session stays usable; a well-formed one naming a GPU the
 *     daemon cannot open is refused with SPC_ERR_NO_DEVICE.
 */
#include <dlfcn.h>
#include <unistd.h>

#include "sp_test.h"

static void daemon_serves(spc_handle_t *h)
{
    spc_query_result_t *r;
    CHECK_OK(h, spc_query(h, "status", NULL, &r));
    spc_query_free(r);
    double *x = spc_alloc(h, sizeof *x);
    CHECK(x != NULL);
    spc_free(h, x);
}

static void test_client(void)
{
    spc_handle_t *h = sp_test_attach();
    static char host[4096];
    spc_region_t r = 12345;
    void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);

    if (driver == NULL) {
        CHECK_ST(h, spc_register_device(h, host, sizeof host, &r), SPC_ERR_NO_DEVICE);
        CHECK_CONTAINS(spc_last_error(h), "no CUDA driver");
        CHECK_CONTAINS(spc_last_error(h), "libcuda.so.1");
        printf("no driver: %s\n", spc_last_error(h));
    } else {
        CHECK_ST(h, spc_register_device(h, host, sizeof host, &r), SPC_ERR_INVALID_ARG);
        CHECK_CONTAINS(spc_last_error(h), "is not device memory");
        printf("driver present: %s\n", spc_last_error(h));
        dlclose(driver);
    }
    CHECK_EQ(r, 12345);   /* outputs are set only on success */
    CHECK_ST(h, spc_register_device(h, NULL, 64, &r), SPC_ERR_INVALID_ARG);
    daemon_serves(h);
    spc_detach(h);
}

/* Sends one RegisterDeviceReq and checks the error it earns. */
static void expect_refused(int fd, uint32_t seq, const Spd__RegisterDeviceReq *req, spc_status_t want,
                           const char *needle)
{
    Spd__Msg m = SPD__MSG__INIT;
    m.seq = seq;
    m.body_case = SPD__MSG__BODY_REGISTER_DEVICE_REQ;
    m.register_device_req = (Spd__RegisterDeviceReq *)req;
    sp_test_raw_send_msg(fd, &m);
    Spd__Msg *rep = sp_test_raw_recv(fd, 5000, NULL);
    CHECK(rep != NULL && rep->body_case == SPD__MSG__BODY_ERROR);
    CHECK_EQ(rep->seq, seq);
    CHECK_EQ(rep->error->status, want);
    CHECK_CONTAINS(rep->error->detail, needle);
    sp_msg_free(rep);
}

static void test_protocol(const sp_test_daemon_t *d)
{
    uint8_t handle[64] = { 1, 2, 3 }, uuid[16] = { 9 };
    int fd = sp_test_raw_connect(d->sock);
    sp_test_raw_hello(fd, SPD__HELLO__ROLE__CLIENT);

    Spd__RegisterDeviceReq ok = SPD__REGISTER_DEVICE_REQ__INIT;
    ok.ipc_handle = (ProtobufCBinaryData){ sizeof handle, handle };
    ok.uuid = (ProtobufCBinaryData){ sizeof uuid, uuid };
    ok.pci_bus_id = "0000:FF:1F.0";
    ok.alloc_base = 0x7f0000000000ull;
    ok.alloc_size = 1 << 20;
    ok.offset = 4096;
    ok.length = 4096;

    Spd__RegisterDeviceReq r = ok;
    r.ipc_handle.len = 10;
    expect_refused(fd, 10, &r, SPC_ERR_INVALID_ARG, "IPC handle of 10 bytes");
    r = ok;
    r.uuid.len = 0;
    expect_refused(fd, 11, &r, SPC_ERR_INVALID_ARG, "a UUID of 0 bytes");
    r = ok;
    r.pci_bus_id = "";
    expect_refused(fd, 12, &r, SPC_ERR_INVALID_ARG, "PCI bus id of 0 characters");
    r = ok;
    r.alloc_size = 0;
    expect_refused(fd, 13, &r, SPC_ERR_INVALID_ARG, "bad device range");
    r = ok;
    r.length = 0;
    expect_refused(fd, 14, &r, SPC_ERR_INVALID_ARG, "bad device range");
    r = ok;
    r.offset = (1 << 20) - 100;
    expect_refused(fd, 15, &r, SPC_ERR_INVALID_ARG, "bad device range");
    r = ok;
    r.offset = UINT64_MAX;
    expect_refused(fd, 16, &r, SPC_ERR_INVALID_ARG, "bad device range");
    /* Well formed, but no GPU of the daemon answers to that bus id (or it has
     * no driver at all). */
    expect_refused(fd, 17, &ok, SPC_ERR_NO_DEVICE, "");

    /* The session is still usable. */
    Spd__Msg q = SPD__MSG__INIT;
    Spd__QueryReq qr = SPD__QUERY_REQ__INIT;
    qr.topic = "clients";
    q.seq = 18;
    q.body_case = SPD__MSG__BODY_QUERY_REQ;
    q.query_req = &qr;
    sp_test_raw_send_msg(fd, &q);
    Spd__Msg *m = sp_test_raw_recv(fd, 5000, NULL);
    CHECK(m != NULL && m->body_case == SPD__MSG__BODY_QUERY_REP);
    CHECK_EQ(m->seq, 18);
    sp_msg_free(m);
    close(fd);
}

int main(void)
{
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    test_client();
    test_protocol(&d);

    /* Nothing was imported, and the daemon serves a new client. */
    spc_handle_t *h = sp_test_attach();
    CHECK(sp_test_wait_status(h, "gpu_imports", 0, 5000));
    daemon_serves(h);
    spc_detach(h);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("register_device: ok\n");
    return 0;
}
