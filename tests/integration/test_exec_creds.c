/*
 * A client registers host memory, then execs a setuid-root program that keeps a
 * secret at the registered address, while a forked child of the client goes on
 * speaking on its sessions. spd (root, so ptrace checks would not stop it) must
 * neither read the secret nor write into the program: every op on the stale
 * registrations, and every new registration probe, is refused with the same
 * clear reason, whatever is mapped at the address, logged, and the session
 * ends. spd goes on serving everybody else.
 *
 * The client runs as nobody, admitted with allow_group. A second case execs the
 * setuid program between connect and Hello: the attach is refused for the
 * credentials it has now. Where the filesystem ignores the setuid bit the
 * program runs as nobody, still another program: the refusals are the same.
 *
 * A process that dropped privileges itself (not dumpable) attaches and uses its
 * arena, but may not register memory.
 *
 * Then spd runs as nobody too, without CAP_SYS_PTRACE: it uses
 * process_vm_readv/writev, and the kernel refuses it the setuid program (not
 * tried where setuid is ignored, or without setpriv). Needs root, else skipped
 * (77).
 */
#include <errno.h>
#include <grp.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sp_test.h"

#define NOBODY 65534
#define PAGE   4096
#define INTS   (PAGE / sizeof(int32_t))
/* Free in both programs; nothing of the test's maps there. */
#define SECRET_ADDR   0x5a5a00000000ull
#define UNMAPPED_ADDR 0x5a5b00000000ull
#define SECRET        "root's secret, in the setuid program's memory. "
#define GONE          "is no longer the process that attached (it exec'd)"

static char holder[256];   /* the setuid copy of secret_holder */

/* What the forked child saw, for the test process to check. */
struct seen {
    int          holder_euid;
    spc_status_t write_st, read_st, probe_mapped_st, probe_unmapped_st;
    char         write_err[256], read_err[256], probe_mapped_err[256], probe_unmapped_err[256];
    bool         secret_read;   /* the read's destination holds the secret */
    pid_t        child;
};

static void drop_to_nobody(void)
{
    CHECK_EQ(setgroups(0, NULL), 0);
    CHECK_EQ(setresgid(NOBODY, NOBODY, NOBODY), 0);
    CHECK_EQ(setresuid(NOBODY, NOBODY, NOBODY), 0);
}

static void become_nobody(void)
{
    drop_to_nobody();
    /* As a program started as nobody is: changing credentials cleared it. */
    CHECK_EQ(prctl(PR_SET_DUMPABLE, 1), 0);
}

/* Attaches and joins a job of its own, a world of one. */
static spc_handle_t *attach_alone(spc_group_t *world_p)
{
    spc_handle_t *h = sp_test_attach();
    char id[SPC_JOB_ID_MAX];
    CHECK_OK(h, spc_job_create(h, id, sizeof id));
    CHECK_OK(h, spc_job_join(h, id, 1, 0, 5000, world_p));
    return h;
}

static void exec_holder(int ready, int go)
{
    char r[16], g[16], addr[32];
    snprintf(r, sizeof r, "%d", ready);
    snprintf(g, sizeof g, "%d", go);
    snprintf(addr, sizeof addr, "%llx", SECRET_ADDR);
    execl(holder, "secret_holder", r, g, addr, SECRET, (char *)NULL);
    SP_FAIL("exec %s: %s", holder, strerror(errno));
}

static void copy_error(char *dst, spc_handle_t *h)
{
    snprintf(dst, 256, "%s", spc_last_error(h));
}

/*
 * The client: nobody, with a page of its own at SECRET_ADDR registered on two
 * sessions. It forks the child that keeps the sessions, and execs the holder.
 */
static int client(void *arg)
{
    struct seen *seen = arg;
    spc_group_t w_write, w_read;
    spc_region_t reg;
    int ready[2], go[2];

    become_nobody();
    char *mine = mmap((void *)SECRET_ADDR, PAGE, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    CHECK(mine == (char *)SECRET_ADDR);
    memset(mine, 'c', PAGE);
    spc_handle_t *hw = attach_alone(&w_write);
    spc_handle_t *hr = attach_alone(&w_read);
    spc_handle_t *hp = sp_test_attach();
    spc_handle_t *hu = sp_test_attach();
    CHECK_OK(hw, spc_register(hw, mine, PAGE, &reg));
    CHECK_OK(hr, spc_register(hr, mine, PAGE, &reg));
    /* Both ends survive the exec: the holder speaks through them. */
    CHECK_EQ(pipe(ready), 0);
    CHECK_EQ(pipe(go), 0);

    pid_t child = fork();
    CHECK(child >= 0);
    if (child > 0)
        exec_holder(ready[1], go[0]);

    /* The child: the sessions are still open, the pid behind them execs. */
    CHECK_EQ(read(ready[0], &seen->holder_euid, sizeof seen->holder_euid), (ssize_t)sizeof seen->holder_euid);
    char *in = spc_alloc(hr, PAGE);
    memset(in, 0, PAGE);
    seen->read_st = spc_allreduce(hr, w_read, mine, in, INTS, SPC_I32, SPC_SUM, 10000);
    copy_error(seen->read_err, hr);
    seen->secret_read = memmem(in, PAGE, SECRET, strlen(SECRET)) != NULL;

    int32_t *out = spc_alloc(hw, PAGE);
    for (size_t i = 0; i < INTS; i++)
        out[i] = 0x77777777;
    seen->write_st = spc_allreduce(hw, w_write, out, mine, INTS, SPC_I32, SPC_SUM, 10000);
    copy_error(seen->write_err, hw);

    /* Mapped in the holder or not: the answers must not tell. */
    seen->probe_mapped_st = spc_register(hp, (void *)SECRET_ADDR, PAGE, &reg);
    copy_error(seen->probe_mapped_err, hp);
    seen->probe_unmapped_st = spc_register(hu, (void *)UNMAPPED_ADDR, PAGE, &reg);
    copy_error(seen->probe_unmapped_err, hu);

    seen->child = getpid();
    CHECK_EQ(write(go[1], "", 1), 1);
    return 0;
}

/*
 * The same exec, between connect and Hello: a forked child says Hello on the
 * connection the holder's pid made. Returns the status spd answered.
 */
static int exec_before_hello(void *arg)
{
    spc_status_t *answer = arg;
    const char *sock = getenv("SPC_SOCKET");
    int ready[2], go[2];

    become_nobody();
    int fd = sp_test_raw_connect(sock);
    CHECK_EQ(pipe(ready), 0);
    CHECK_EQ(pipe(go), 0);
    pid_t child = fork();
    CHECK(child >= 0);
    if (child > 0)
        exec_holder(ready[1], go[0]);

    int euid;
    CHECK_EQ(read(ready[0], &euid, sizeof euid), (ssize_t)sizeof euid);
    Spd__Msg m = SPD__MSG__INIT;
    Spd__Hello h = SPD__HELLO__INIT;
    h.protocol = SP_PROTOCOL_VERSION;
    h.role = SPD__HELLO__ROLE__CLIENT;
    h.name = "after-exec";
    m.seq = 1;
    m.body_case = SPD__MSG__BODY_HELLO;
    m.hello = &h;
    sp_test_raw_send_msg(fd, &m);
    Spd__Msg *r = sp_test_raw_recv(fd, 5000, NULL);
    *answer = r == NULL ? SPC_ERR_TIMEOUT : r->body_case == SPD__MSG__BODY_ERROR ? r->error->status : SPC_OK;
    sp_msg_free(r);
    CHECK_EQ(write(go[1], "", 1), 1);
    return 0;
}

/*
 * A process that dropped from root to nobody itself, and so is not dumpable:
 * nobody may not read its memory, nor may spd. It attaches and its arena
 * serves; registering memory is refused, saying why and what to do.
 */
static int dropped_privileges(void *arg)
{
    spc_group_t world;
    spc_region_t reg;
    static double x[4] = { 1, 2, 3, 4 };

    (void)arg;
    drop_to_nobody();
    spc_handle_t *h = attach_alone(&world);
    double *y = spc_alloc(h, sizeof x);
    memcpy(y, x, sizeof x);
    CHECK_OK(h, spc_allreduce(h, world, y, y, 4, SPC_F64, SPC_SUM, 5000));
    CHECK_EQ(y[3], 4);
    CHECK_ST(h, spc_register(h, x, sizeof x, &reg), SPC_ERR_PERMISSION);
    CHECK_CONTAINS(spc_last_error(h), "is not dumpable");
    CHECK_CONTAINS(spc_last_error(h), "prctl(PR_SET_DUMPABLE, 1)");
    spc_detach(h);
    return 0;
}

/* Copies secret_holder next to spd's files, setuid root. */
static void install_holder(const sp_test_daemon_t *d)
{
    char out[64];
    snprintf(holder, sizeof holder, "%s/secret_holder", d->dir);
    CHECK_EQ(sp_test_run(out, sizeof out, "cp %s %s", SP_SECRET_HOLDER, holder), 0);
    CHECK_EQ(chown(holder, 0, 0), 0);
    CHECK_EQ(chmod(holder, 04755), 0);
}

/* Runs fn in a client process, then waits for the holder it became. */
static int run_client(int (*fn)(void *), void *arg)
{
    pid_t p = sp_test_fork(fn, arg);
    return sp_test_wait(p, 20000);
}

/* spd still serves: another client's registered memory works. */
static int still_serving(void *arg)
{
    spc_group_t world;
    spc_region_t reg;
    double x[4] = { 0.5, 1.5, 2.5, 3.5 };

    (void)arg;
    spc_handle_t *h = attach_alone(&world);
    CHECK_OK(h, spc_register(h, x, sizeof x, &reg));
    CHECK_OK(h, spc_allreduce(h, world, x, x, 4, SPC_F64, SPC_SUM, 5000));
    CHECK_EQ(x[3], 3.5);
    spc_detach(h);
    return 0;
}

static int still_serving_nobody(void *arg)
{
    become_nobody();
    return still_serving(arg);
}

/* Runs the client, then the child it left, to their ends. */
static int attack(struct seen *seen)
{
    memset(seen, 0, sizeof *seen);
    int holder_exit = run_client(client, seen);
    CHECK(seen->child > 0);
    CHECK_EQ(sp_test_wait(seen->child, 10000), 0);
    return holder_exit;
}

/* spd's log has at least `times` lines matching pattern. */
static void log_has(const sp_test_daemon_t *d, const char *pattern, int times)
{
    char out[64];
    CHECK_EQ(sp_test_run(out, sizeof out, "grep -c \"%s\" %s", pattern, d->log), 0);
    if (atoi(out) < times)
        SP_FAIL("%d lines of spd's log match \"%s\", expected %d", atoi(out), pattern, times);
}

/*
 * spd as root, which the kernel would let into any process: it goes through
 * the descriptor of the image that attached, which the exec left dead. Returns
 * whether the holder ran setuid.
 */
static bool attack_privileged_spd(struct seen *seen)
{
    const char *allow[] = { "--set", "allow_group=65534", NULL };
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, allow);
    install_holder(&d);

    int holder_exit = attack(seen);
    printf("exec_creds: the holder ran as uid %d%s\n", seen->holder_euid,
           seen->holder_euid == 0 ? " (setuid)" : " (the filesystem ignores setuid)");
    /* Nothing was written into the holder, nothing read out of it. */
    CHECK_EQ(holder_exit, 0);
    CHECK(!seen->secret_read);
    CHECK_ST(NULL, seen->write_st, SPC_ERR_PERMISSION);
    CHECK_CONTAINS(seen->write_err, GONE);
    CHECK_ST(NULL, seen->read_st, SPC_ERR_PERMISSION);
    CHECK_CONTAINS(seen->read_err, GONE);
    /* The same answer whether the holder maps the address or not. */
    CHECK_ST(NULL, seen->probe_mapped_st, SPC_ERR_PERMISSION);
    CHECK_CONTAINS(seen->probe_mapped_err, GONE);
    CHECK_STREQ(seen->probe_mapped_err, seen->probe_unmapped_err);
    /* Logged, and each of the four sessions ended for it. */
    log_has(&d, "through /proc/<pid>/mem", 1);
    log_has(&d, "exec'd since it attached.*disconnecting it", 4);
    CHECK_EQ(sp_test_wait(sp_test_fork(still_serving, NULL), 20000), 0);

    /* A Hello after the exec: refused for the credentials the pid has now. */
    if (seen->holder_euid == 0) {
        spc_status_t *answer = sp_test_shared(sizeof *answer);
        CHECK_EQ(run_client(exec_before_hello, answer), 0);
        CHECK_ST(NULL, *answer, SPC_ERR_PERMISSION);
        log_has(&d, "refusing pid [0-9]*: pid [0-9]* no longer has the credentials it connected with", 1);
        CHECK_EQ(sp_test_wait(sp_test_fork(still_serving, NULL), 20000), 0);
    }
    CHECK_EQ(sp_test_wait(sp_test_fork(dropped_privileges, NULL), 20000), 0);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    return seen->holder_euid == 0;
}

/*
 * spd as nobody, serving nobody: process_vm_readv/writev, which the kernel
 * refuses into the setuid holder on every call.
 */
static void attack_unprivileged_spd(struct seen *seen)
{
    const char *wrapper[] = { "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", NULL };
    sp_test_daemon_t d;
    sp_test_daemon_start_ex(&d, wrapper, NULL);
    install_holder(&d);

    CHECK_EQ(attack(seen), 0);
    CHECK_EQ(seen->holder_euid, 0);
    CHECK(!seen->secret_read);
    CHECK_ST(NULL, seen->write_st, SPC_ERR_PERMISSION);
    CHECK_ST(NULL, seen->read_st, SPC_ERR_PERMISSION);
    CHECK_CONTAINS(seen->read_err, "Operation not permitted");
    CHECK_ST(NULL, seen->probe_mapped_st, SPC_ERR_PERMISSION);
    CHECK_ST(NULL, seen->probe_unmapped_st, SPC_ERR_PERMISSION);
    CHECK_CONTAINS(seen->probe_mapped_err, "Operation not permitted");
    CHECK_CONTAINS(seen->probe_unmapped_err, "Operation not permitted");
    log_has(&d, "with process_vm_readv/writev", 1);
    CHECK_EQ(sp_test_wait(sp_test_fork(still_serving_nobody, NULL), 20000), 0);
    printf("exec_creds: spd as nobody: the kernel refused every access\n");
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
}

int main(void)
{
    if (geteuid() != 0) {
        fprintf(stderr, "skipped: needs root to play nobody and to install a setuid program\n");
        return SP_TEST_SKIP;
    }
    /* The child that keeps the sessions outlives its parent (the holder): it
     * comes back to this process to be reaped. */
    CHECK_EQ(prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
    struct seen *seen = sp_test_shared(sizeof *seen);
    char out[64];

    bool setuid = attack_privileged_spd(seen);
    /* Without setuid the holder is nobody's own program, which unprivileged
     * spd may reach as nobody could. */
    if (!setuid || sp_test_run(out, sizeof out, "command -v setpriv") != 0)
        printf("exec_creds: spd as nobody not tried (%s)\n", setuid ? "no setpriv" : "no setuid here");
    else
        attack_unprivileged_spd(seen);
    printf("exec_creds: ok\n");
    return 0;
}
