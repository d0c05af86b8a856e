/*
 * What a client receives beside its segment lets it wake spd and nothing
 * more. A hostile client takes the descriptors of its Welcome by hand: none
 * but its own segment maps as shared writable memory (once, every client
 * mapped one doorbell page writable, and what spd published there to all of
 * them), the other is an eventfd; it fills that eventfd's counter, drains it,
 * makes it blocking and writes to it from a child for the rest of the test.
 * spd keeps serving, and a client that submits while the progress thread is
 * asleep still wakes it at once.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include "sp_test.h"

/* Says a client Hello on fd and returns the Welcome's descriptors in fds. */
static int hello_take_fds(int fd, int *fds, int max, uint64_t *segment_bytes_p)
{
    Spd__Msg m = SPD__MSG__INIT;
    Spd__Hello hl = SPD__HELLO__INIT;
    hl.protocol = SP_PROTOCOL_VERSION;
    hl.role = SPD__HELLO__ROLE__CLIENT;
    hl.name = "wake-fd-attacker";
    hl.arena_bytes = 1 << 20;
    m.seq = 1;
    m.body_case = SPD__MSG__BODY_HELLO;
    m.hello = &hl;
    sp_test_raw_send_msg(fd, &m);

    struct pollfd p = { .fd = fd, .events = POLLIN };
    CHECK_EQ(poll(&p, 1, 5000), 1);
    static uint8_t buf[4096];
    char ctl[CMSG_SPACE(4 * sizeof(int))];
    struct iovec iov = { buf, sizeof buf };
    struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl };
    ssize_t n = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC);
    CHECK(n > 0);
    sp_frame_t f;
    CHECK_EQ(sp_frame_parse(buf, (size_t)n, sizeof buf, &f), SP_FRAME_OK);
    Spd__Msg *w = sp_msg_decode(&f);
    CHECK(w != NULL);
    CHECK_EQ(w->body_case, SPD__MSG__BODY_WELCOME);
    *segment_bytes_p = w->welcome->segment_bytes;
    sp_msg_free(w);

    int got = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c != NULL; c = CMSG_NXTHDR(&mh, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
            for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int) && got < max; i++)
                memcpy(&fds[got++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
    return got;
}

/* The hostile client's child: writes to the eventfd until killed. */
static int keep_writing(void *arg)
{
    int fd = (int)(intptr_t)arg;
    for (uint64_t v = 1;; v = v * 6364136223846793005ull + 1442695040888963407ull) {
        uint64_t w = v % 0xfffffffffffffffeull;
        if (write(fd, &w, sizeof w) < 0 && errno != EAGAIN)
            return 1;
        usleep(100);
    }
}

/* Submitted while the progress thread sleeps (progress_sleep_ms is 10 s), a
 * no-op completes at once only if its wake-up reached spd. */
static void wakes_promptly(void)
{
    spc_handle_t *h = sp_test_attach();
    for (int i = 0; i < 5; i++) {
        usleep(20000);   /* longer than progress_spin_us: the progress thread is asleep */
        uint64_t t0 = sp_test_now_ms();
        CHECK_OK(h, spc_noop(h, 5000));
        CHECK(sp_test_now_ms() - t0 < 3000);
    }
    spc_detach(h);
}

int main(void)
{
    sp_test_daemon_t d;
    const char *args[] = { "--set", "progress_sleep_ms=10000", NULL };
    sp_test_daemon_start(&d, args);

    int sock = sp_test_raw_connect(d.sock);
    int fds[4];
    uint64_t seg_bytes;
    int n = hello_take_fds(sock, fds, 4, &seg_bytes);
    CHECK_EQ(n, 2);

    int wake = -1;
    for (int i = 0; i < n; i++) {
        struct stat st;
        CHECK_EQ(fstat(fds[i], &st), 0);
        if (S_ISREG(st.st_mode) && (uint64_t)st.st_size == seg_bytes)
            continue;   /* its own segment */
        void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fds[i], 0);
        if (p != MAP_FAILED)
            SP_FAIL("descriptor %d of the Welcome (%lld bytes) maps writable and shared: a client could write what "
                    "spd shows every client", i, (long long)st.st_size);
        char link[64], path[32];
        snprintf(path, sizeof path, "/proc/self/fd/%d", fds[i]);
        ssize_t len = readlink(path, link, sizeof link - 1);
        CHECK(len > 0);
        link[len] = '\0';
        CHECK_CONTAINS(link, "eventfd");
        wake = fds[i];
    }
    CHECK(wake >= 0);

    /* Everything a client can do with its eventfd. */
    uint64_t v = 0xfffffffffffffffeull;
    CHECK_EQ(write(wake, &v, sizeof v), (ssize_t)sizeof v);
    v = 1;
    CHECK(write(wake, &v, sizeof v) < 0 && errno == EAGAIN);   /* full */
    CHECK_EQ(read(wake, &v, sizeof v), (ssize_t)sizeof v);      /* drained */
    CHECK_EQ(fcntl(wake, F_SETFL, 0), 0);                       /* blocking: a daemon that read it could hang */
    CHECK_EQ(write(wake, &v, sizeof v), (ssize_t)sizeof v);
    pid_t writer = sp_test_fork(keep_writing, (void *)(intptr_t)wake);

    wakes_promptly();
    sp_test_daemon_serves();
    spc_handle_t *h = sp_test_attach();
    CHECK_EQ(sp_test_status_int(h, "clients"), 2);   /* the attacker and this one */
    spc_detach(h);

    kill(writer, SIGKILL);
    sp_test_wait(writer, 5000);
    close(sock);
    for (int i = 0; i < n; i++)
        close(fds[i]);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    return 0;
}
