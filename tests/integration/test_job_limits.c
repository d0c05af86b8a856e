/*
 * Jobs a client can make spd keep: past max_jobs_per_client live jobs its next
 * job_create is refused, naming the limit, while other clients go on creating
 * and spd serves; the jobs end with their creator and the place comes back.
 * And a join of the empty job id is "no such job", never "ended" (unused slots
 * of the ended-jobs record are empty strings).
 */
#include "sp_test.h"

#define MAX_JOBS 3

static bool log_has(const sp_test_daemon_t *d, const char *needle)
{
    char out[64];
    return sp_test_run(out, sizeof out, "grep -q '%s' %s", needle, d->log) == 0;
}

static void test_job_cap(const sp_test_daemon_t *d)
{
    char id[SPC_JOB_ID_MAX];
    spc_handle_t *h = sp_test_attach();
    for (int i = 0; i < MAX_JOBS; i++)
        CHECK_OK(h, spc_job_create(h, id, sizeof id));
    for (int i = 0; i < 100; i++)
        CHECK_ST(h, spc_job_create(h, id, sizeof id), SPC_ERR_LIMIT);
    CHECK_CONTAINS(spc_last_error(h), "already has 3 live jobs (max_jobs_per_client)");
    CHECK(log_has(d, "job refused: this client already has 3 live jobs (max_jobs_per_client)"));
    CHECK_EQ(sp_test_status_int(h, "jobs"), MAX_JOBS);

    /* The cap is the client's: another one creates, and spd serves. */
    spc_handle_t *other = sp_test_attach();
    CHECK_OK(other, spc_job_create(other, id, sizeof id));
    spc_detach(other);
    sp_test_daemon_serves();

    /* Its jobs end when it leaves; a new client has its full allowance. */
    spc_detach(h);
    h = sp_test_attach();
    CHECK(sp_test_wait_status(h, "jobs", 0, 5000));
    for (int i = 0; i < MAX_JOBS; i++)
        CHECK_OK(h, spc_job_create(h, id, sizeof id));
    spc_detach(h);
}

static void test_empty_job_id(void)
{
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_ST(h, spc_job_join(h, "", 2, 0, 1000, &world), SPC_ERR_NOT_FOUND);
    CHECK_CONTAINS(spc_last_error(h), "no job ''");
    CHECK_OK(h, spc_noop(h, 5000));
    spc_detach(h);
}

int main(void)
{
    sp_test_daemon_t d;
    char max_jobs[48];
    snprintf(max_jobs, sizeof max_jobs, "max_jobs_per_client=%d", MAX_JOBS);
    const char *args[] = { "--set", max_jobs, NULL };
    sp_test_daemon_start(&d, args);

    test_empty_job_id();
    test_job_cap(&d);

    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    return 0;
}
