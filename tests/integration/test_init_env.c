/*
 * A rank started by a launcher finds its place and its job in the launcher's
 * environment (spc_launch_from_env, spc_init_from_env):
 *
 *   - torchrun's, OpenMPI's and SLURM's variables each give rank, world size,
 *     local rank, the launch id and a job name made from it; torchrun wins
 *     over both, mpirun over SLURM; $SPC_JOB names the job instead;
 *   - no launcher, a rank that is not a number or not below the world size, a
 *     bad $SPC_JOB: refused with the reason, nothing attached; ranks on
 *     several nodes joining an spd without peers: the join times out naming
 *     the missing ranks and saying this spd has no peers (test_named_nodes
 *     joins them across daemons);
 *   - four processes with torchrun's variables and two with SLURM's each call
 *     spc_init_from_env alone and all-reduce right: nobody made the job; a
 *     second launch under the same $SPC_JOB while the first assembles is
 *     refused, the detail naming both launches.
 */
#include <stdlib.h>

#include "sp_test.h"

static const char *const launcher_vars[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
    "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "SLURM_PROCID", "SLURM_NTASKS",
    "SLURM_LOCALID", "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_ID",
    "SLURM_STEP_ID", "SPC_JOB",
};

static void env_clear(void)
{
    for (size_t i = 0; i < sizeof launcher_vars / sizeof launcher_vars[0]; i++)
        unsetenv(launcher_vars[i]);
}

static void env_set(const char *name, const char *value)
{
    CHECK_EQ(setenv(name, value, 1), 0);
}

static void env_u(const char *name, unsigned v)
{
    char s[16];
    snprintf(s, sizeof s, "%u", v);
    env_set(name, s);
}

static void torchrun_env(unsigned rank, unsigned world, unsigned local_world, const char *run_id)
{
    env_u("RANK", rank);
    env_u("WORLD_SIZE", world);
    env_u("LOCAL_RANK", rank % local_world);
    env_u("LOCAL_WORLD_SIZE", local_world);
    env_u("GROUP_WORLD_SIZE", world / local_world);
    env_set("TORCHELASTIC_RUN_ID", run_id);
    env_set("TORCHELASTIC_RESTART_COUNT", "0");
    env_set("MASTER_ADDR", "127.0.0.1");
    env_set("MASTER_PORT", "29500");
}

static void slurm_env(unsigned rank, unsigned world, unsigned nodes, const char *job, const char *step)
{
    env_u("SLURM_PROCID", rank);
    env_u("SLURM_NTASKS", world);
    env_u("SLURM_LOCALID", rank);
    env_u("SLURM_STEP_NUM_NODES", nodes);
    env_set("SLURM_JOB_ID", job);
    env_set("SLURM_STEP_ID", step);
}

static void test_read(void)
{
    spc_launch_t l = SPC_LAUNCH_INIT;

    env_clear();
    torchrun_env(3, 8, 4, "e6f1c0de");
    CHECK_OK(NULL, spc_launch_from_env(&l));
    CHECK_EQ(l.rank, 3u);
    CHECK_EQ(l.world_size, 8u);
    CHECK_EQ(l.local_rank, 3u);
    CHECK_EQ(l.local_world_size, 4u);
    CHECK_EQ(l.nodes, 2u);
    CHECK_STREQ(l.launcher, "torchrun");
    CHECK_STREQ(l.launch, "e6f1c0de.0@127.0.0.1:29500");
    CHECK_STREQ(l.job, "torchrun-e6f1c0de");
    /* torchrun's run id when none was given: the launch names the job. */
    env_set("TORCHELASTIC_RUN_ID", "none");
    CHECK_OK(NULL, spc_launch_from_env(&l));
    CHECK_STREQ(l.launch, "none.0@127.0.0.1:29500");
    CHECK_STREQ(l.job, "torchrun-none.0-127.0.0.1-29500");
    env_set("TORCHELASTIC_RUN_ID", "e6f1c0de");

    /* torchrun under srun: torchrun's processes are the ranks. */
    slurm_env(0, 2, 1, "77", "0");
    CHECK_OK(NULL, spc_launch_from_env(&l));
    CHECK_STREQ(l.launcher, "torchrun");

    env_clear();
    slurm_env(1, 2, 1, "4242", "7");
    CHECK_OK(NULL, spc_launch_from_env(&l));
    CHECK_STREQ(l.launcher, "slurm");
    CHECK_EQ(l.rank, 1u);
    CHECK_EQ(l.local_world_size, 2u);    /* one node: all of them */
    CHECK_EQ(l.nodes, 1u);
    CHECK_STREQ(l.launch, "4242.7");
    CHECK_STREQ(l.job, "slurm-4242.7");
    env_set("SLURM_STEP_NUM_NODES", "2");
    CHECK_OK(NULL, spc_launch_from_env(&l));
    CHECK_EQ(l.local_world_size, 0u);    /* several nodes, tasks per node unsaid */
    CHECK_EQ(l.nodes, 2u);

    /* mpirun inside an sbatch allocation: the batch script's SLURM_PROCID is 0 for all. */
    env_set("OMPI_COMM_WORLD_RANK", "5");
    env_set("OMPI_COMM_WORLD_SIZE", "6");
    env_set("OMPI_COMM_WORLD_LOCAL_RANK", "5");
    env_set("OMPI_COMM_WORLD_LOCAL_SIZE", "6");
    env_set("PMIX_NAMESPACE", "prterun-node1-811@1");
    CHECK_OK(NULL, spc_launch_from_env(&l));
    CHECK_STREQ(l.launcher, "openmpi");
    CHECK_EQ(l.rank, 5u);
    CHECK_EQ(l.world_size, 6u);
    CHECK_STREQ(l.launch, "prterun-node1-811@1");
    CHECK_STREQ(l.job, "openmpi-prterun-node1-811-1");
    CHECK_EQ(l.nodes, 0u);                /* OpenMPI does not say */

    env_set("SPC_JOB", "my-run.1");
    CHECK_OK(NULL, spc_launch_from_env(&l));
    CHECK_STREQ(l.job, "my-run.1");
    CHECK_STREQ(l.launch, "prterun-node1-811@1");
}

static void test_refusals(void)
{
    spc_launch_t l = SPC_LAUNCH_INIT, before;

    env_clear();
    memset(&before, 0x5a, sizeof before);
    l = before;
    l.struct_size = sizeof l;
    before.struct_size = sizeof l;
    CHECK_ST(NULL, spc_launch_from_env(&l), SPC_ERR_NOT_FOUND);
    CHECK_CONTAINS(spc_last_error(NULL), "no launcher's environment: RANK and WORLD_SIZE (torchrun)");
    CHECK(memcmp(&l, &before, sizeof l) == 0);   /* set only on success */

    env_set("RANK", "two");
    env_set("WORLD_SIZE", "4");
    CHECK_ST(NULL, spc_launch_from_env(&l), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(NULL), "$RANK is 'two', not a number");
    env_set("RANK", "4");
    CHECK_ST(NULL, spc_launch_from_env(&l), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(NULL), "$RANK is 4 and $WORLD_SIZE 4");
    env_set("RANK", "-1");
    CHECK_ST(NULL, spc_launch_from_env(&l), SPC_ERR_INVALID_ARG);

    /* RANK and WORLD_SIZE alone, from no launcher that names its runs. */
    env_set("RANK", "0");
    CHECK_ST(NULL, spc_launch_from_env(&l), SPC_ERR_NOT_FOUND);
    CHECK_CONTAINS(spc_last_error(NULL), "nothing names the launch");
    CHECK_CONTAINS(spc_last_error(NULL), "set SPC_JOB");
    env_set("SPC_JOB", "bad name");
    CHECK_ST(NULL, spc_launch_from_env(&l), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(NULL), "$SPC_JOB 'bad' holds byte 0x20 at 3");

    l.struct_size = 8;
    env_set("SPC_JOB", "fine");
    CHECK_ST(NULL, spc_launch_from_env(&l), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(NULL), "spc_launch_t.struct_size is 8");

    env_clear();
}

/* A launch over several nodes joins through each node's spd; one without peers
 * waits for the ranks elsewhere in vain, and its timeout says why. */
static void test_no_peers(spc_handle_t *obs)
{
    spc_launch_t l = SPC_LAUNCH_INIT;
    spc_handle_t *h = NULL;

    env_clear();
    torchrun_env(0, 8, 4, "multi");
    CHECK_ST(NULL, spc_init_from_env(NULL, 300, &l, &h), SPC_ERR_TIMEOUT);
    CHECK_CONTAINS(spc_last_error(NULL), "ranks 1, 2, 3, 4, 5, 6, 7 (7 of 8) have not joined job");
    CHECK_CONTAINS(spc_last_error(NULL), "this spd has no peers");
    CHECK(h == NULL);
    env_clear();
    slurm_env(1, 4, 2, "5", "0");
    CHECK_ST(NULL, spc_init_from_env(NULL, 300, &l, &h), SPC_ERR_TIMEOUT);
    CHECK_CONTAINS(spc_last_error(NULL), "ranks 0, 2, 3 (3 of 4) have not joined job");
    CHECK(h == NULL);
    env_clear();
    CHECK(sp_test_wait_status(obs, "jobs", 0, 5000));
}

/* One rank: its launcher's variables, then spc_init_from_env and an all-reduce. */
typedef struct rank_arg {
    unsigned     rank, world;
    bool         slurm;
    const char  *job, *step;      /* SLURM: the job and step; torchrun: the run id */
    const char  *spc_job;         /* NULL: none */
    spc_status_t expect;
    const char  *detail;
} rank_arg_t;

static int rank_main(void *p)
{
    const rank_arg_t *a = p;
    spc_launch_t l = SPC_LAUNCH_INIT;
    spc_handle_t *h = NULL;

    env_clear();
    if (a->slurm)
        slurm_env(a->rank, a->world, 1, a->job, a->step);
    else
        torchrun_env(a->rank, a->world, a->world, a->job);
    if (a->spc_job != NULL)
        env_set("SPC_JOB", a->spc_job);
    CHECK_ST(NULL, spc_init_from_env(NULL, 20000, &l, &h), a->expect);
    if (a->expect != SPC_OK) {
        CHECK_CONTAINS(spc_last_error(NULL), a->detail);
        CHECK(h == NULL);
        return 0;
    }
    CHECK_EQ(l.rank, a->rank);
    CHECK_EQ(l.world_size, a->world);
    double *x = spc_alloc(h, sizeof *x);
    *x = l.rank + 1;
    CHECK_OK(h, spc_allreduce(h, l.world, x, x, 1, SPC_F64, SPC_SUM, 10000));
    CHECK_EQ(*x, a->world * (a->world + 1) / 2.0);
    spc_detach(h);
    return 0;
}

static void test_launches(spc_handle_t *obs)
{
    rank_arg_t torch[4], slurm[2];
    pid_t pids[6];
    for (unsigned r = 0; r < 4; r++) {
        torch[r] = (rank_arg_t){ .rank = r, .world = 4, .job = "c0ffee" };
        pids[r] = sp_test_fork(rank_main, &torch[r]);
    }
    for (unsigned r = 0; r < 2; r++) {
        slurm[r] = (rank_arg_t){ .rank = r, .world = 2, .slurm = true, .job = "900", .step = "0" };
        pids[4 + r] = sp_test_fork(rank_main, &slurm[r]);
    }
    sp_test_wait_all_ok(pids, 6, 30000);
    CHECK(sp_test_wait_status(obs, "jobs", 0, 5000));

    /* Two steps of one SLURM job under one $SPC_JOB, the second while the first assembles. */
    char id[SPC_JOB_ID_MAX];
    snprintf(id, sizeof id, "%u/nightly", (unsigned)getuid());
    rank_arg_t first[2], second = { .rank = 0, .world = 2, .slurm = true, .job = "900", .step = "2",
                                    .spc_job = "nightly", .expect = SPC_ERR_BUSY,
                                    .detail = "joining job nightly as rank 0 of 2: job " };
    for (unsigned r = 0; r < 2; r++)
        first[r] = (rank_arg_t){ .rank = r, .world = 2, .slurm = true, .job = "900", .step = "1", .spc_job = "nightly" };
    pids[0] = sp_test_fork(rank_main, &first[0]);
    CHECK(sp_test_wait_job_joined(obs, id, 1, 10000));
    pids[1] = sp_test_fork(rank_main, &second);
    sp_test_wait_all_ok(&pids[1], 1, 20000);
    pids[1] = sp_test_fork(rank_main, &first[1]);
    sp_test_wait_all_ok(pids, 2, 30000);
}

/* The second launch's detail names both launch ids. */
static void test_detail(spc_handle_t *obs)
{
    char id[SPC_JOB_ID_MAX];
    snprintf(id, sizeof id, "%u/nightly", (unsigned)getuid());
    rank_arg_t first = { .rank = 0, .world = 2, .slurm = true, .job = "901", .step = "1", .spc_job = "nightly" };
    rank_arg_t second = { .rank = 1, .world = 2, .slurm = true, .job = "901", .step = "2", .spc_job = "nightly",
                          .expect = SPC_ERR_BUSY, .detail = "is held by another launch (901.1, 1 of 2 ranks joined" };
    rank_arg_t third = second;
    third.detail = "this rank's launch is 901.2";
    pid_t pids[2] = { sp_test_fork(rank_main, &first) };
    CHECK(sp_test_wait_job_joined(obs, id, 1, 10000));
    pid_t p = sp_test_fork(rank_main, &second);
    sp_test_wait_all_ok(&p, 1, 20000);
    p = sp_test_fork(rank_main, &third);
    sp_test_wait_all_ok(&p, 1, 20000);
    rank_arg_t last = first;
    last.rank = 1;
    pids[1] = sp_test_fork(rank_main, &last);
    sp_test_wait_all_ok(pids, 2, 30000);
    CHECK(sp_test_wait_status(obs, "jobs", 0, 5000));
}

int main(void)
{
    test_read();
    test_refusals();

    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    spc_handle_t *obs = sp_test_attach();
    test_launches(obs);
    test_detail(obs);
    test_no_peers(obs);
    spc_detach(obs);
    sp_test_daemon_serves();
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    return 0;
}
