/*
 * A process of another user attaches: refused, with the reason, and the daemon
 * goes on serving its own user. With allow_group, members of that group (primary
 * or supplementary) are admitted and nobody else.
 *
 * spd runs as nobody (65534) through setpriv; the test itself is root, which
 * passes the directory permissions, so the refusal seen is the daemon's own
 * SO_PEERCRED check. Needs root and setpriv, else skipped (77).
 */
#include <grp.h>
#include <unistd.h>

#include "sp_test.h"

#define NOBODY 65534

static int as_nobody(void *arg)
{
    (void)arg;
    CHECK_EQ(setgroups(0, NULL), 0);
    CHECK_EQ(setresgid(NOBODY, NOBODY, NOBODY), 0);
    CHECK_EQ(setresuid(NOBODY, NOBODY, NOBODY), 0);
    spc_handle_t *h = sp_test_attach();
    CHECK_OK(h, spc_noop(h, 5000));
    char id[SPC_JOB_ID_MAX];
    spc_group_t world;
    CHECK_OK(h, spc_job_create(h, id, sizeof id));
    CHECK_OK(h, spc_job_join(h, id, 1, 0, 5000, &world));
    double *x = spc_alloc(h, sizeof *x);
    *x = 21;
    CHECK_OK(h, spc_allreduce(h, world, x, x, 1, SPC_F64, SPC_SUM, 5000));
    CHECK_EQ(*x, 21);
    spc_detach(h);
    return 0;
}

/* Root, but with nogroup as a supplementary group. */
static int root_in_nogroup(void *arg)
{
    (void)arg;
    gid_t g = NOBODY;
    CHECK_EQ(setgroups(1, &g), 0);
    spc_handle_t *h = sp_test_attach();
    CHECK_OK(h, spc_noop(h, 5000));
    spc_detach(h);
    return 0;
}

int main(void)
{
    if (geteuid() != 0) {
        fprintf(stderr, "skipped: needs root to run spd as another user\n");
        return SP_TEST_SKIP;
    }
    char out[256];
    if (sp_test_run(out, sizeof out, "command -v setpriv") != 0) {
        fprintf(stderr, "skipped: setpriv (util-linux) is not installed\n");
        return SP_TEST_SKIP;
    }
    const char *wrapper[] = { "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", NULL };
    sp_test_daemon_t d;
    spc_handle_t *h;

    sp_test_daemon_start_ex(&d, wrapper, NULL);
    CHECK_ST(NULL, spc_attach(NULL, &h), SPC_ERR_PERMISSION);
    CHECK_CONTAINS(spc_last_error(NULL), "uid 0 is not spd's user (uid 65534)");
    pid_t p = sp_test_fork(as_nobody, NULL);
    CHECK_EQ(sp_test_wait(p, 20000), 0);
    CHECK_ST(NULL, spc_attach(NULL, &h), SPC_ERR_PERMISSION);   /* still refused, still serving */
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);

    const char *allow[] = { "--set", "allow_group=65534", NULL };
    sp_test_daemon_start_ex(&d, wrapper, allow);
    p = sp_test_fork(root_in_nogroup, NULL);
    CHECK_EQ(sp_test_wait(p, 20000), 0);
    CHECK_ST(NULL, spc_attach(NULL, &h), SPC_ERR_PERMISSION);
    CHECK_CONTAINS(spc_last_error(NULL), "not in group 65534");
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("other_uid: ok\n");
    return 0;
}
