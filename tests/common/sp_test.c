/* sp_test.c — see sp_test.h. */
#include "sp_test.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

uint64_t sp_test_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

int sp_test_tcp_connect(const char *from_ip, int port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    CHECK(fd >= 0);
    if (from_ip != NULL) {
        struct sockaddr_in src = { .sin_family = AF_INET };
        CHECK(inet_pton(AF_INET, from_ip, &src.sin_addr) == 1);
        CHECK(bind(fd, (struct sockaddr *)&src, sizeof src) == 0);
    }
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons((uint16_t)port) };
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    CHECK(connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    return fd;
}

long sp_test_tcp_closed_after(const char *from_ip, int port, const void *bytes, size_t len, int timeout_ms)
{
    int fd = sp_test_tcp_connect(from_ip, port);
    uint64_t t0 = sp_test_now_ms();
    if (len > 0)
        CHECK(write(fd, bytes, len) == (ssize_t)len);
    char buf[4096];
    for (;;) {
        long left = timeout_ms - (long)(sp_test_now_ms() - t0);
        struct pollfd p = { .fd = fd, .events = POLLIN };
        if (left <= 0 || poll(&p, 1, (int)left) <= 0) {
            close(fd);
            return -1;
        }
        if (read(fd, buf, sizeof buf) <= 0)   /* what it says first (a hello, an error) is dropped */
            break;
    }
    close(fd);
    return (long)(sp_test_now_ms() - t0);
}

int64_t sp_test_proc_kib(pid_t pid, const char *field)
{
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        SP_FAIL("%s: %s", path, strerror(errno));
    int64_t kib = -1;
    size_t n = strlen(field);
    while (kib < 0 && fgets(line, sizeof line, f) != NULL)
        if (strncmp(line, field, n) == 0 && line[n] == ':')
            kib = strtoll(line + n + 1, NULL, 10);
    fclose(f);
    if (kib < 0)
        SP_FAIL("no %s in %s", field, path);
    return kib;
}

const char *sp_test_spd_bin(void)
{
    const char *other = getenv("SP_TEST_SPD");
    return other != NULL ? other : SPD_BIN;
}

const char *sp_test_spctl_bin(void)
{
    return SPCTL_BIN;
}

void *sp_test_shared(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(p != MAP_FAILED);
    return p;
}

/* The daemons this process started (a test may play several nodes), and the
 * pid that started them. */
#define MAX_DAEMONS 8
static sp_test_daemon_t *started[MAX_DAEMONS];
static int nstarted;
static pid_t current_owner;

void sp_test_on_fail(void)
{
    if (current_owner != getpid())
        return;
    for (int i = 0; i < nstarted; i++) {
        if (started[i]->pid > 0) {
            sp_test_daemon_dump_log(started[i]);
            kill(started[i]->pid, SIGKILL);
        }
    }
}

void sp_test_daemon_dump_log(const sp_test_daemon_t *d)
{
    FILE *f = fopen(d->log, "r");
    if (f == NULL)
        return;
    char line[1024];
    fprintf(stderr, "---- spd log (%s) ----\n", d->log);
    while (fgets(line, sizeof line, f) != NULL)
        fputs(line, stderr);
    fprintf(stderr, "---- end of spd log ----\n");
    fclose(f);
}

bool sp_test_notify_wait(sp_test_daemon_t *d, const char *state, int timeout_ms)
{
    uint64_t deadline = sp_test_now_ms() + (uint64_t)timeout_ms;
    char buf[512];
    for (;;) {
        uint64_t now = sp_test_now_ms();
        if (now >= deadline)
            return false;
        struct pollfd p = { .fd = d->notify_fd, .events = POLLIN };
        if (poll(&p, 1, (int)(deadline - now)) <= 0)
            continue;
        ssize_t n = recv(d->notify_fd, buf, sizeof buf - 1, 0);
        if (n <= 0)
            continue;
        buf[n] = '\0';
        if (strstr(buf, state) != NULL)
            return true;
    }
}

static void daemon_spawn(sp_test_daemon_t *d, const char *const *wrapper, const char *const *extra_args);

void sp_test_daemon_start_ex(sp_test_daemon_t *d, const char *const *wrapper, const char *const *extra_args)
{
    memset(d, 0, sizeof *d);
    snprintf(d->dir, sizeof d->dir, "/tmp/spd-test-XXXXXX");
    CHECK(mkdtemp(d->dir) != NULL);
    /* A wrapper may run spd as another user, who must be able to create run/ here. */
    chmod(d->dir, wrapper != NULL ? 0777 : 0755);
    snprintf(d->sock, sizeof d->sock, "%s/run/spd.sock", d->dir);
    snprintf(d->log, sizeof d->log, "%s/spd.log", d->dir);
    snprintf(d->notify, sizeof d->notify, "%s/notify", d->dir);

    d->notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", d->notify);
    CHECK(bind(d->notify_fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    chmod(d->notify, 0777);
    daemon_spawn(d, wrapper, extra_args);
}

void sp_test_daemon_restart(sp_test_daemon_t *d, const char *const *extra_args)
{
    CHECK(d->pid == 0);
    daemon_spawn(d, NULL, extra_args);
}

/* Runs spd on d's socket, log and notify socket, and waits for READY=1. */
static void daemon_spawn(sp_test_daemon_t *d, const char *const *wrapper, const char *const *extra_args)
{
    char set_sock[256], set_log[256];
    snprintf(set_sock, sizeof set_sock, "socket=%s", d->sock);
    snprintf(set_log, sizeof set_log, "log_file=%s", d->log);
    const char *argv[64];
    int n = 0;
    for (int i = 0; wrapper && wrapper[i]; i++)
        argv[n++] = wrapper[i];
    argv[n++] = sp_test_spd_bin();
    argv[n++] = "--set";
    argv[n++] = set_sock;
    argv[n++] = "--set";
    argv[n++] = set_log;
    argv[n++] = "--set";
    argv[n++] = "log_level=debug";
    for (int i = 0; extra_args && extra_args[i] && n < 62; i++)
        argv[n++] = extra_args[i];
    argv[n] = NULL;

    d->pid = fork();
    CHECK(d->pid >= 0);
    if (d->pid == 0) {
        /* Dies with the test, whatever happens to the test. */
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        setenv("NOTIFY_SOCKET", d->notify, 1);
        execvp(argv[0], (char *const *)argv);
        fprintf(stderr, "exec %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    int k = 0;
    while (k < nstarted && started[k] != d)
        k++;
    if (k == nstarted && nstarted < MAX_DAEMONS)
        started[nstarted++] = d;
    current_owner = getpid();
    if (!sp_test_notify_wait(d, "READY=1", 15000)) {
        sp_test_daemon_dump_log(d);
        kill(d->pid, SIGKILL);
        SP_FAIL("spd did not say READY=1 within 15 s");
    }
    setenv("SPC_SOCKET", d->sock, 1);
}

void sp_test_daemon_start(sp_test_daemon_t *d, const char *const *extra_args)
{
    sp_test_daemon_start_ex(d, NULL, extra_args);
}

int sp_test_daemon_stop(sp_test_daemon_t *d)
{
    if (d->pid <= 0)
        return -1;
    kill(d->pid, SIGTERM);
    int rc = sp_test_wait(d->pid, 20000);
    d->pid = 0;
    if (rc != 0)
        sp_test_daemon_dump_log(d);
    return rc;
}

static void rm_rf(const char *path)
{
    DIR *dir = opendir(path);
    if (dir != NULL) {
        struct dirent *e;
        while ((e = readdir(dir)) != NULL) {
            if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
                continue;
            char p[512];
            snprintf(p, sizeof p, "%s/%s", path, e->d_name);
            rm_rf(p);
        }
        closedir(dir);
        rmdir(path);
    } else {
        unlink(path);
    }
}

void sp_test_daemon_cleanup(sp_test_daemon_t *d)
{
    if (d->pid > 0) {
        kill(d->pid, SIGKILL);
        sp_test_wait(d->pid, 5000);
        d->pid = 0;
    }
    if (d->notify_fd > 0)
        close(d->notify_fd);
    if (d->dir[0] != '\0' && getenv("SP_TEST_KEEP") == NULL)
        rm_rf(d->dir);
}

pid_t sp_test_fork(int (*fn)(void *arg), void *arg)
{
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);   /* a failed test leaves no ranks behind */
        int rc = fn(arg);
        fflush(stdout);                      /* _exit does not flush stdio */
        fflush(stderr);
        _exit(rc);
    }
    return pid;
}

int sp_test_wait(pid_t pid, int timeout_ms)
{
    uint64_t deadline = sp_test_now_ms() + (uint64_t)timeout_ms;
    int status;
    for (;;) {
        pid_t r = waitpid(pid, &status, WNOHANG);
        if (r == pid)
            break;
        if (r < 0)
            return -1001;
        if (sp_test_now_ms() >= deadline) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            return -1000;
        }
        usleep(2000);   /* polling a child's exit: there is no event to wait on portably */
    }
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    return -WTERMSIG(status);
}

void sp_test_wait_all_ok(const pid_t *pids, int n, int timeout_ms)
{
    int bad = 0;
    for (int i = 0; i < n; i++) {
        int rc = sp_test_wait(pids[i], timeout_ms);
        if (rc != 0) {
            fprintf(stderr, "child %d (pid %d) ended with %d%s\n", i, (int)pids[i], rc,
                    rc == -1000 ? " (timed out)" : "");
            bad++;
        }
    }
    if (bad)
        SP_FAIL("%d of %d children failed", bad, n);
}

int64_t sp_test_status_int(spc_handle_t *h, const char *key)
{
    spc_query_result_t *q;
    CHECK_OK(h, spc_query(h, "status", NULL, &q));
    long f = spc_query_find(q, 0, key);
    CHECK(f >= 0);
    int64_t v = spc_query_int(q, 0, (size_t)f);
    spc_query_free(q);
    return v;
}

bool sp_test_wait_status(spc_handle_t *h, const char *key, int64_t want, int timeout_ms)
{
    for (uint64_t end = sp_test_now_ms() + (uint64_t)timeout_ms; sp_test_now_ms() < end;)
        if (sp_test_status_int(h, key) == want)
            return true;
    return false;
}

/* A job's `joined` count, -1 when the daemon has no such job. */
static int64_t job_joined(spc_handle_t *h, const char *job_id)
{
    spc_query_result_t *q;
    spc_status_t st = spc_query(h, "jobs", job_id, &q);
    if (st == SPC_ERR_NOT_FOUND)
        return -1;
    CHECK_OK(h, st);
    long f = spc_query_find(q, 0, "joined");
    CHECK(f >= 0);
    int64_t joined = spc_query_int(q, 0, (size_t)f);
    spc_query_free(q);
    return joined;
}

bool sp_test_wait_job_joined(spc_handle_t *h, const char *job_id, int64_t want, int timeout_ms)
{
    uint64_t end = sp_test_now_ms() + (uint64_t)timeout_ms;
    while (job_joined(h, job_id) != want) {
        if (sp_test_now_ms() >= end)
            return false;
        usleep(500);   /* a join has no event a third client could wait on */
    }
    return true;
}

spc_status_t sp_test_submit_wait(spc_handle_t *h, const spc_op_t *op, int timeout_ms)
{
    spc_request_t *r;
    spc_status_t st = spc_submit(h, op, &r);
    if (st != SPC_OK)
        return st;
    st = spc_wait(r, timeout_ms);
    spc_request_release(r);
    return st;
}

spc_handle_t *sp_test_attach(void)
{
    spc_handle_t *h = NULL;
    spc_status_t st = spc_attach(NULL, &h);
    if (st != SPC_OK)
        SP_FAIL("spc_attach: %s: %s", spc_status_name(st), spc_last_error(NULL));
    return h;
}

int sp_test_run(char *buf, size_t len, const char *fmt, ...)
{
    char cmd[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    fflush(stdout);
    FILE *p = popen(cmd, "r");
    CHECK(p != NULL);
    size_t off = 0;
    if (buf != NULL && len > 0) {
        size_t n;
        while (off + 1 < len && (n = fread(buf + off, 1, len - off - 1, p)) > 0)
            off += n;
        buf[off] = '\0';
    }
    char sink[4096];
    while (fread(sink, 1, sizeof sink, p) > 0)
        ;
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* ---------------------------------------------------------------- raw protocol */

int sp_test_raw_connect(const char *sock)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", sock);
    CHECK(fd >= 0);
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0)
        SP_FAIL("connect %s: %s", sock, strerror(errno));
    return fd;
}

void sp_test_raw_send(int fd, const void *buf, size_t len)
{
    const uint8_t *p = buf;
    while (len > 0) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0)
            SP_FAIL("send: %s", strerror(errno));
        p += n;
        len -= (size_t)n;
    }
}

void sp_test_raw_send_msg(int fd, Spd__Msg *m)
{
    uint8_t *buf;
    size_t len;
    CHECK_EQ(sp_msg_encode(m, &buf, &len), 0);
    sp_test_raw_send(fd, buf, len);
    free(buf);
}

Spd__Msg *sp_test_raw_recv(int fd, int timeout_ms, bool *eof_p)
{
    static uint8_t buf[1 << 16];
    size_t len = 0;
    uint64_t deadline = sp_test_now_ms() + (uint64_t)timeout_ms;
    if (eof_p)
        *eof_p = false;
    for (;;) {
        sp_frame_t f;
        sp_frame_result_t r = sp_frame_parse(buf, len, sizeof buf - 8, &f);
        if (r == SP_FRAME_OK)
            return sp_msg_decode(&f);
        CHECK(r == SP_FRAME_NEED_MORE);
        uint64_t now = sp_test_now_ms();
        if (now >= deadline)
            return NULL;
        struct pollfd p = { .fd = fd, .events = POLLIN };
        if (poll(&p, 1, (int)(deadline - now)) <= 0)
            continue;
        char ctl[CMSG_SPACE(4 * sizeof(int))];
        struct iovec iov = { buf + len, sizeof buf - len };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl, .msg_controllen = sizeof ctl };
        ssize_t n = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC);
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c != NULL; c = CMSG_NXTHDR(&mh, c)) {
            if (c->cmsg_type == SCM_RIGHTS) {
                int *fds = (int *)CMSG_DATA(c);
                for (size_t i = 0; i < (c->cmsg_len - CMSG_LEN(0)) / sizeof(int); i++)
                    close(fds[i]);
            }
        }
        if (n <= 0) {
            if (eof_p)
                *eof_p = true;
            return NULL;
        }
        len += (size_t)n;
    }
}

void sp_test_raw_hello(int fd, int role)
{
    Spd__Msg m = SPD__MSG__INIT;
    Spd__Hello h = SPD__HELLO__INIT;
    h.protocol = SP_PROTOCOL_VERSION;
    h.role = role;
    h.name = "raw-test";
    m.seq = 1;
    m.body_case = SPD__MSG__BODY_HELLO;
    m.hello = &h;
    sp_test_raw_send_msg(fd, &m);
    Spd__Msg *r = sp_test_raw_recv(fd, 5000, NULL);
    CHECK(r != NULL);
    CHECK_EQ(r->body_case, SPD__MSG__BODY_WELCOME);
    sp_msg_free(r);
}

/* ---------------------------------------------------------------- jobs */

struct job_child {
    const char     *job_id;
    int             rank, nranks;
    sp_test_rank_fn fn;
    void           *arg;
};

/* The extra daemons of sp_test_start's cluster; node 0 is the caller's. */
#define MAX_CLUSTER 4
static struct {
    int                n;
    sp_test_daemon_t  *node0;
    sp_test_daemon_t   more[MAX_CLUSTER - 1];
    char               dir[64];
    char               secret[128];
} cluster;

const sp_test_daemon_t *sp_test_cluster_daemon(int node)
{
    CHECK(node >= 1 && node < cluster.n);
    return &cluster.more[node - 1];
}

const char *sp_test_cluster_secret(void)
{
    CHECK(cluster.n > 1);
    return cluster.secret;
}

static const char *cluster_socket(int rank, int nranks)
{
    if (cluster.n < 2)
        return NULL;
    int node = (int)((int64_t)rank * cluster.n / nranks);
    return node == 0 ? cluster.node0->sock : cluster.more[node - 1].sock;
}

int sp_test_start(sp_test_daemon_t *d, int argc, char **argv)
{
    int n = 1;
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], "--nodes") == 0)
            n = atoi(argv[i + 1]);
    CHECK(n >= 1 && n <= MAX_CLUSTER);
    if (n == 1) {
        sp_test_daemon_start(d, NULL);
        return 1;
    }
    char peers[256] = "";
    const char *secret = cluster.secret;
    snprintf(cluster.dir, sizeof cluster.dir, "/tmp/spd-cluster-XXXXXX");
    CHECK(mkdtemp(cluster.dir) != NULL);
    sp_test_secret_file(cluster.dir, "secret", "the test cluster's shared secret\n", cluster.secret,
                        sizeof cluster.secret);
    cluster.node0 = d;
    cluster.n = n;
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        char name[16];
        snprintf(name, sizeof name, "node-%d", i);
        sp_test_daemon_t *di = i == 0 ? d : &cluster.more[i - 1];
        /* Long timeout: sanitizer builds of many ranks may starve a daemon's loop a while. */
        sp_test_node_start(di, name, secret, "127.0.0.1:0", peers, 10000);
        off += (size_t)snprintf(peers + off, sizeof peers - off, "%s127.0.0.1:%d", i ? "," : "",
                                sp_test_node_port(di));
    }
    for (int i = 1; i < n; i++) {   /* the last one dialled everybody: its links say all are up */
        char rec[2048], name[16];
        snprintf(name, sizeof name, "node-%d", i - 1);
        sp_test_peer_wait(&cluster.more[n - 2], name, "up", 10000, rec, sizeof rec);
    }
    setenv("SPC_SOCKET", d->sock, 1);
    printf("%d nodes on loopback: ranks spread contiguously\n", n);
    return n;
}

int sp_test_cluster_stop(void)
{
    int rc = 0;
    for (int i = 1; i < cluster.n; i++) {
        rc |= sp_test_daemon_stop(&cluster.more[i - 1]) != 0;
        sp_test_daemon_cleanup(&cluster.more[i - 1]);
    }
    if (cluster.n > 1) {
        char out[256];
        sp_test_run(out, sizeof out, "rm -rf %s", cluster.dir);
    }
    cluster.n = 0;
    return rc;
}

static int job_child_main(void *p)
{
    struct job_child *c = p;
    const char *sock = cluster_socket(c->rank, c->nranks);
    if (sock != NULL)
        setenv("SPC_SOCKET", sock, 1);
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, c->job_id, (uint32_t)c->nranks, (uint32_t)c->rank, 20000, &world));
    int rc = c->fn(h, world, c->rank, c->nranks, c->arg);
    spc_detach(h);
    return rc;
}

void sp_test_run_job_in(const char *job_id, int nranks, sp_test_rank_fn fn, void *arg)
{
    pid_t pids[64];
    CHECK(nranks <= 64);
    for (int r = 0; r < nranks; r++) {
        struct job_child c = { job_id, r, nranks, fn, arg };
        pids[r] = sp_test_fork(job_child_main, &c);
    }
    sp_test_wait_all_ok(pids, nranks, 60000);
}

void sp_test_run_job(int nranks, sp_test_rank_fn fn, void *arg)
{
    spc_handle_t *owner = sp_test_attach();
    char id[SPC_JOB_ID_MAX];
    CHECK_OK(owner, spc_job_create(owner, id, sizeof id));
    sp_test_run_job_in(id, nranks, fn, arg);
    spc_detach(owner);
}

/* A fresh 2-rank job whose allreduce must come out right. */
static int rank_alive(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    (void)nranks;
    (void)arg;
    double *x = spc_alloc(h, sizeof *x);
    CHECK(x != NULL);
    *x = rank + 1;
    CHECK_OK(h, spc_allreduce(h, world, x, x, 1, SPC_F64, SPC_SUM, 10000));
    CHECK_EQ(*x, 3);
    return 0;
}

void sp_test_daemon_serves(void)
{
    sp_test_run_job(2, rank_alive, NULL);
}

/* ---------------------------------------------------------------- JSON of spctl */

bool sp_test_json_record(const char *json, const char *from, const char *needle, char *out, size_t len)
{
    const char *p = strstr(from, needle);
    if (p == NULL)
        return false;
    const char *b = p, *e = strchr(p, '}');
    while (b > json && *b != '{')
        b--;
    if (*b != '{' || e == NULL || (size_t)(e - b + 2) > len)
        return false;
    memcpy(out, b, (size_t)(e - b + 1));
    out[e - b + 1] = '\0';
    return true;
}

/* Where the value of `key` starts in rec (after `"key":` and `suffix`). */
static const char *json_value(const char *rec, const char *key, const char *suffix)
{
    char pat[96];
    snprintf(pat, sizeof pat, "\"%s\":%s", key, suffix);
    const char *p = strstr(rec, pat);
    if (p == NULL)
        SP_FAIL("no \"%s\" in %s", key, rec);
    return p + strlen(pat);
}

long long sp_test_json_int(const char *rec, const char *key)
{
    return strtoll(json_value(rec, key, ""), NULL, 10);
}

double sp_test_json_double(const char *rec, const char *key)
{
    return strtod(json_value(rec, key, ""), NULL);
}

void sp_test_json_str(const char *rec, const char *key, char *out, size_t len)
{
    const char *p = json_value(rec, key, "\"");
    const char *e = strchr(p, '"');
    CHECK(e != NULL && (size_t)(e - p) < len);
    memcpy(out, p, (size_t)(e - p));
    out[e - p] = '\0';
}

/* ---------------------------------------------------------------- several nodes */

void sp_test_secret_file(const char *dir, const char *name, const char *secret, char *path, size_t len)
{
    snprintf(path, len, "%s/%s", dir, name);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    CHECK(fd >= 0);
    CHECK(write(fd, secret, strlen(secret)) == (ssize_t)strlen(secret));
    CHECK(fchmod(fd, 0600) == 0);
    close(fd);
}

void sp_test_node_start(sp_test_daemon_t *d, const char *node, const char *secret, const char *listen,
                        const char *peers, int peer_timeout_ms)
{
    /* Each daemon keeps its own copies: spd reads its arguments at exec. */
    char a[5][256];
    snprintf(a[0], sizeof a[0], "node_name=%s", node);
    snprintf(a[1], sizeof a[1], "cluster_secret_file=%s", secret);
    snprintf(a[2], sizeof a[2], "peer_listen=%s", listen);
    snprintf(a[3], sizeof a[3], "peers=%s", peers);
    snprintf(a[4], sizeof a[4], "peer_timeout_ms=%d", peer_timeout_ms);
    const char *args[] = { "--set", a[0], "--set", a[1], "--set", a[2], "--set", a[3],
                           "--set", "peer_heartbeat_ms=50", "--set", a[4], NULL };
    sp_test_daemon_start(d, args);
}

int sp_test_node_port(const sp_test_daemon_t *d)
{
    char out[8192], listen[96];
    sp_test_node_status(d, out, sizeof out);
    sp_test_json_str(out, "peer_listen", listen, sizeof listen);
    const char *colon = strrchr(listen, ':');
    CHECK(colon != NULL);
    return atoi(colon + 1);
}

void sp_test_node_pair_start(sp_test_daemon_t nodes[2], const char *secret)
{
    char peers[64], rec[2048];
    sp_test_node_start(&nodes[0], "node-0", secret, "127.0.0.1:0", "", 5000);
    snprintf(peers, sizeof peers, "127.0.0.1:%d", sp_test_node_port(&nodes[0]));
    sp_test_node_start(&nodes[1], "node-1", secret, "127.0.0.1:0", peers, 5000);
    sp_test_peer_wait(&nodes[0], "node-1", "up", 10000, rec, sizeof rec);
    sp_test_peer_wait(&nodes[1], "node-0", "up", 10000, rec, sizeof rec);
}

void sp_test_node_stop(sp_test_daemon_t *d)
{
    if (d->pid > 0)
        CHECK_EQ(sp_test_daemon_stop(d), 0);
    sp_test_daemon_cleanup(d);
}

void sp_test_node_pair_stop(sp_test_daemon_t nodes[2])
{
    sp_test_node_stop(&nodes[1]);
    sp_test_node_stop(&nodes[0]);
}

void sp_test_node_status(const sp_test_daemon_t *d, char *out, size_t len)
{
    CHECK_EQ(sp_test_run(out, len, "%s --socket %s --json status", sp_test_spctl_bin(), d->sock), 0);
}

int sp_test_log_count(const sp_test_daemon_t *d, const char *re)
{
    char out[64];
    /* grep exits 1 where no line matches: a count of 0, not a failure. */
    CHECK_EQ(sp_test_run(out, sizeof out, "grep -cE '%s' %s || true", re, d->log), 0);
    return atoi(out);
}

int sp_test_peer_links_up(const sp_test_daemon_t *d, const char *node)
{
    static char out[65536], rec[2048];
    char needle[96], state[32];
    int up = 0;
    snprintf(needle, sizeof needle, "\"node\":\"%s\"", node);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket %s --json peers", sp_test_spctl_bin(), d->sock), 0);
    for (const char *at = out; (at = strstr(at, needle)) != NULL; at++) {
        CHECK(sp_test_json_record(out, at, needle, rec, sizeof rec));
        sp_test_json_str(rec, "state", state, sizeof state);
        up += strcmp(state, "up") == 0;
    }
    return up;
}

void sp_test_peer_wait(const sp_test_daemon_t *d, const char *node, const char *state, int timeout_ms, char *rec,
                       size_t len)
{
    static char out[65536];
    char needle[96], got[64] = "absent";
    snprintf(needle, sizeof needle, "\"node\":\"%s\"", node);
    uint64_t deadline = sp_test_now_ms() + (uint64_t)timeout_ms;
    while (sp_test_now_ms() < deadline) {
        if (sp_test_run(out, sizeof out, "%s --socket %s --json peers", sp_test_spctl_bin(), d->sock) == 0 &&
            sp_test_json_record(out, out, needle, rec, len)) {
            sp_test_json_str(rec, "state", got, sizeof got);
            if (strcmp(got, state) == 0)
                return;
        }
        usleep(20000);
    }
    SP_FAIL("%s: peer %s is %s, not %s, after %d ms", d->sock, node, got, state, timeout_ms);
}

void sp_test_become(uid_t uid, gid_t gid)
{
    CHECK_EQ(setgroups(1, &gid), 0);
    CHECK_EQ(setresgid(gid, gid, gid), 0);
    CHECK_EQ(setresuid(uid, uid, uid), 0);
}

void sp_test_use_stub_cuda(const char *dir)
{
    const char *old = getenv("LD_LIBRARY_PATH");
    char path[4096];
    snprintf(path, sizeof path, "%s%s%s", dir, old != NULL ? ":" : "", old != NULL ? old : "");
    setenv("LD_LIBRARY_PATH", path, 1);
}
