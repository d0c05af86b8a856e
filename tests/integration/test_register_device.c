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
 *   - cuMem (VMM) requests with a malformed chunk list (both an IPC handle and
 *     chunks, a negative descriptor, a descriptor the client does not have,
 *     chunks that overlap, leave a gap, are empty, run past the range or wrap,
 *     do not cover it, or are too many) are refused with the reason, and the
 *     daemon holds no more descriptors than before: every one it took from the
 *     client (pidfd_getfd) was closed, on the refusals as on the request that
 *     got as far as the missing GPU.
 */
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/prctl.h>
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

/* How many descriptors process pid has open. */
static int fd_count(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
    DIR *d = opendir(path);
    CHECK(d != NULL);
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

/* A cuMem request of two 2 MiB chunks, both naming descriptor fd. */
#define CHUNK (2ull << 20)

static void test_vmm_protocol(const sp_test_daemon_t *d)
{
    uint8_t handle[64] = { 1 }, uuid[16] = { 9 };
    int fd = sp_test_raw_connect(d->sock);
    sp_test_raw_hello(fd, SPD__HELLO__ROLE__CLIENT);
    /* spd takes descriptors out of this process as it would out of a client;
     * where Yama restricts ptrace that needs our consent. */
    prctl(PR_SET_PTRACER, (unsigned long)d->pid, 0, 0, 0);
    int mine = open("/dev/null", O_RDONLY | O_CLOEXEC);
    CHECK(mine >= 0);
    const int daemon_fds = fd_count(d->pid);

    Spd__DeviceChunk c0 = SPD__DEVICE_CHUNK__INIT, c1 = SPD__DEVICE_CHUNK__INIT;
    c0.offset = 0;
    c0.size = CHUNK;
    c0.buffer_id = 7;
    c0.fd = mine;
    c1 = c0;
    c1.offset = CHUNK;
    c1.buffer_id = 8;
    Spd__DeviceChunk *chunks[2] = { &c0, &c1 };
    Spd__RegisterDeviceReq ok = SPD__REGISTER_DEVICE_REQ__INIT;
    ok.uuid = (ProtobufCBinaryData){ sizeof uuid, uuid };
    ok.pci_bus_id = "0000:FF:1F.0";
    ok.alloc_base = 0x7f0000000000ull;
    ok.alloc_size = 2 * CHUNK;
    ok.offset = CHUNK - 4096;
    ok.length = 8192;
    ok.n_chunks = 2;
    ok.chunks = chunks;

    Spd__RegisterDeviceReq r = ok;
    r.ipc_handle = (ProtobufCBinaryData){ sizeof handle, handle };
    expect_refused(fd, 30, &r, SPC_ERR_INVALID_ARG, "IPC handle of 64 bytes (want none beside cuMem chunks)");

    Spd__DeviceChunk b = c1;
    chunks[1] = &b;
    b.fd = -1;
    expect_refused(fd, 31, &ok, SPC_ERR_INVALID_ARG, "chunk 1: bad descriptor number -1");
    /* Chunk 0's descriptor is taken before chunk 1's is found missing: the
     * daemon must close its copy of the first. */
    b.fd = 999999;
    expect_refused(fd, 32, &ok, SPC_ERR_INVALID_ARG, "has no descriptor 999999");
    b = c1;
    b.offset = CHUNK / 2;
    expect_refused(fd, 33, &ok, SPC_ERR_INVALID_ARG, "overlaps the one before");
    b = c1;
    b.offset = CHUNK + 4096;
    expect_refused(fd, 34, &ok, SPC_ERR_INVALID_ARG, "leaves a gap after the one before");
    b = c1;
    b.size = 0;
    expect_refused(fd, 35, &ok, SPC_ERR_INVALID_ARG, "is empty");
    b = c1;
    b.size = UINT64_MAX - CHUNK + 1;   /* offset + size wraps to 0 */
    expect_refused(fd, 36, &ok, SPC_ERR_INVALID_ARG, "runs past the range's");
    b = c1;
    r = ok;
    r.alloc_size = 3 * CHUNK;
    expect_refused(fd, 37, &r, SPC_ERR_INVALID_ARG, "the chunks cover 4194304 of the range's 6291456 bytes");
    r = ok;
    r.alloc_base = UINT64_MAX - CHUNK;   /* the range wraps around the address space */
    expect_refused(fd, 38, &r, SPC_ERR_INVALID_ARG, "bad device range");
    r = ok;
    r.offset = 2 * CHUNK - 4096;
    expect_refused(fd, 39, &r, SPC_ERR_INVALID_ARG, "bad device range");

    /* One chunk more than a registration may span. */
    const size_t many = SP_DEVICE_MAX_CHUNKS + 1;
    Spd__DeviceChunk *lots = calloc(many, sizeof *lots), **lotp = calloc(many, sizeof *lotp);
    CHECK(lots != NULL && lotp != NULL);
    for (size_t i = 0; i < many; i++) {
        lots[i] = c0;
        lots[i].offset = i * CHUNK;
        lots[i].buffer_id = i + 1;
        lotp[i] = &lots[i];
    }
    r = ok;
    r.n_chunks = many;
    r.chunks = lotp;
    r.alloc_size = many * CHUNK;
    expect_refused(fd, 40, &r, SPC_ERR_LIMIT, "1025 chunks in one cuMem registration: at most 1024");
    free(lots);
    free(lotp);

    /* Well formed: the descriptors are taken, and the request fails only at
     * the GPU, which this daemon does not have (no driver, or no GPU at that
     * bus id). */
    expect_refused(fd, 41, &ok, SPC_ERR_NO_DEVICE, "");
    CHECK_EQ(fd_count(d->pid), daemon_fds);

    /* The session is still usable. */
    Spd__Msg q = SPD__MSG__INIT;
    Spd__QueryReq qr = SPD__QUERY_REQ__INIT;
    qr.topic = "clients";
    q.seq = 42;
    q.body_case = SPD__MSG__BODY_QUERY_REQ;
    q.query_req = &qr;
    sp_test_raw_send_msg(fd, &q);
    Spd__Msg *m = sp_test_raw_recv(fd, 5000, NULL);
    CHECK(m != NULL && m->body_case == SPD__MSG__BODY_QUERY_REP);
    CHECK_EQ(m->seq, 42);
    sp_msg_free(m);
    close(mine);
    close(fd);
}

int main(void)
{
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    test_client();
    test_protocol(&d);
    test_vmm_protocol(&d);

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
