/*
 * launch.c — a rank started by a launcher (torchrun, mpirun, srun) finds its
 * place and its job in the launcher's environment: spc_launch_from_env and
 * spc_init_from_env (spclient.h).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* The variables one launcher sets for each process it starts; NULL: none. */
typedef struct launcher {
    const char *name;
    const char *rank, *world_size, *local_rank, *local_world_size, *nodes;
} launcher_t;

/* In the order spclient.h gives, and why. */
static const launcher_t launchers[] = {
    { "torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE" },
    { "openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
      "OMPI_COMM_WORLD_LOCAL_SIZE", NULL },
    { "slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
      "SLURM_STEP_NUM_NODES" },
};

/* $name as a number of [0, UINT32_MAX]; absent is `dflt`. */
static spc_status_t env_u32(const char *name, uint32_t dflt, uint32_t *v_p)
{
    const char *v = getenv(name);
    if (v == NULL || *v == '\0') {
        *v_p = dflt;
        return SPC_OK;
    }
    char *end;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (*end != '\0' || errno != 0 || x > UINT32_MAX || v[0] == '-')
        return spc__fail(NULL, SPC_ERR_INVALID_ARG, "$%s is '%.32s', not a number", name, v);
    *v_p = (uint32_t)x;
    return SPC_OK;
}

static const char *env_str(const char *name)
{
    const char *v = getenv(name);
    return v != NULL ? v : "";
}

/* Appends the pieces of a launch id, "" ones left out, each after its separator. */
static void launch_add(char *buf, size_t len, const char *sep, const char *piece)
{
    size_t n = strlen(buf);
    if (piece[0] != '\0' && n < len)
        snprintf(buf + n, len - n, "%s%s", n > 0 ? sep : "", piece);
}

/* The launch id of launcher l: what one run of it shares and the next does not. */
static void launch_id(const launcher_t *l, char *buf, size_t len)
{
    buf[0] = '\0';
    if (strcmp(l->name, "torchrun") == 0) {
        /* The run id is "none" unless --rdzv-id or --standalone set it; the
         * rendezvous address and a restart's count tell those runs apart. */
        launch_add(buf, len, "", env_str("TORCHELASTIC_RUN_ID"));
        launch_add(buf, len, ".", env_str("TORCHELASTIC_RESTART_COUNT"));
        launch_add(buf, len, "@", env_str("MASTER_ADDR"));
        launch_add(buf, len, ":", env_str("MASTER_PORT"));
    } else if (strcmp(l->name, "openmpi") == 0) {
        const char *ns = env_str("PMIX_NAMESPACE");
        launch_add(buf, len, "", ns[0] != '\0' ? ns : env_str("OMPI_MCA_ess_base_jobid"));
    } else {
        launch_add(buf, len, "", env_str("SLURM_JOB_ID"));
        launch_add(buf, len, ".", env_str("SLURM_STEP_ID"));
    }
    /* Whatever a launcher puts there, what spd is sent is a launch id. */
    sp_job_text_clean(buf, SP_JOB_LAUNCH_CHARS);
}

/* The job name: $SPC_JOB, else the launcher's name and its launch id (for
 * torchrun its run id alone, when one was given: restarts then share it). */
static spc_status_t job_name(const launcher_t *l, const char *launch, char name[SPC_JOB_NAME_MAX])
{
    const char *given = getenv("SPC_JOB");
    const char *bad;
    if (given != NULL && given[0] != '\0') {
        if ((bad = sp_job_name_problem(given)) != NULL)
            return spc__fail(NULL, SPC_ERR_INVALID_ARG, "$SPC_JOB '%.*s' %s",
                             (int)sp_job_text_plain(given, SPC_JOB_NAME_MAX - 1, SP_JOB_NAME_CHARS), given, bad);
        snprintf(name, SPC_JOB_NAME_MAX, "%s", given);
        return SPC_OK;
    }
    if (launch[0] == '\0')
        return spc__fail(NULL, SPC_ERR_NOT_FOUND, "%s's rank variables are set, but nothing names the launch (%s): "
                         "set SPC_JOB to a name every rank of this launch shares", l->name,
                         strcmp(l->name, "torchrun") == 0 ? "TORCHELASTIC_RUN_ID, MASTER_ADDR, MASTER_PORT" :
                         strcmp(l->name, "openmpi") == 0 ? "PMIX_NAMESPACE" : "SLURM_JOB_ID");
    const char *run_id = env_str("TORCHELASTIC_RUN_ID");
    bool named_run = strcmp(l->name, "torchrun") == 0 && run_id[0] != '\0' && strcmp(run_id, "none") != 0;
    snprintf(name, SPC_JOB_NAME_MAX, "%s-%s", l->name, named_run ? run_id : launch);
    sp_job_text_clean(name, SP_JOB_NAME_CHARS);
    return SPC_OK;
}

/* $name as a number, 0 when name is NULL or the variable absent. */
static spc_status_t env_count(const char *name, uint32_t *v_p)
{
    if (name == NULL) {
        *v_p = 0;
        return SPC_OK;
    }
    return env_u32(name, 0, v_p);
}

/* Where the ranks are. SLURM names the nodes of a job in SLURM_NNODES, of a
 * step in SLURM_STEP_NUM_NODES; a launch on one node holds every rank there. */
static spc_status_t launch_place(const launcher_t *found, spc_launch_t *l)
{
    spc_status_t st = env_count(found->local_world_size, &l->local_world_size);
    if (st == SPC_OK)
        st = env_count(found->nodes, &l->nodes);
    if (st == SPC_OK && l->nodes == 0 && strcmp(found->name, "slurm") == 0)
        st = env_u32("SLURM_NNODES", 0, &l->nodes);
    if (st == SPC_OK && l->nodes == 1)
        l->local_world_size = l->world_size;
    return st;
}

spc_status_t spc_launch_from_env(spc_launch_t *launch_p)
{
    spc_launch_t l = SPC_LAUNCH_INIT;
    const launcher_t *found = NULL;
    spc_status_t st;

    for (size_t i = 0; i < sizeof launchers / sizeof launchers[0] && found == NULL; i++)
        if (getenv(launchers[i].rank) != NULL && getenv(launchers[i].world_size) != NULL)
            found = &launchers[i];
    if (found == NULL)
        return spc__fail(NULL, SPC_ERR_NOT_FOUND, "no launcher's environment: RANK and WORLD_SIZE (torchrun), "
                         "OMPI_COMM_WORLD_RANK and _SIZE (mpirun) or SLURM_PROCID and SLURM_NTASKS (srun)");
    if ((st = env_u32(found->rank, 0, &l.rank)) != SPC_OK || (st = env_u32(found->world_size, 0, &l.world_size)) !=
        SPC_OK || (st = env_u32(found->local_rank, 0, &l.local_rank)) != SPC_OK)
        return st;
    if (l.world_size == 0 || l.rank >= l.world_size)
        return spc__fail(NULL, SPC_ERR_INVALID_ARG, "$%s is %u and $%s %u: a rank below a world size of at least 1",
                         found->rank, l.rank, found->world_size, l.world_size);
    if ((st = launch_place(found, &l)) != SPC_OK)
        return st;
    snprintf(l.launcher, sizeof l.launcher, "%s", found->name);
    launch_id(found, l.launch, sizeof l.launch);
    if ((st = job_name(found, l.launch, l.job)) != SPC_OK)
        return st;
    return spc__struct_write(NULL, spc_launch_t, launch_p, world, &l);
}

spc_status_t spc_init_from_env(const spc_attach_params_t *params, int timeout_ms, spc_launch_t *launch_p,
                               spc_handle_t **h_p)
{
    spc_launch_t l = SPC_LAUNCH_INIT;
    spc_handle_t *h;
    spc_status_t st;

    if (h_p == NULL)
        return spc__fail(NULL, SPC_ERR_INVALID_ARG, "h_p is required");
    /* Checked before anything is attached, so a failure leaves nothing behind. */
    if ((st = spc__struct_write(NULL, spc_launch_t, launch_p, world, &l)) != SPC_OK)
        return st;
    if ((st = spc_launch_from_env(&l)) != SPC_OK)
        return st;
    /* Ranks on several nodes join through their own nodes' spd: the daemons
     * find the job's home among themselves (the one where rank 0 joined). */
    if ((st = spc_attach(params, &h)) != SPC_OK)
        return st;
    st = spc_job_join_named(h, l.job, l.launch, l.world_size, l.rank, timeout_ms, &l.world);
    if (st != SPC_OK) {
        spc__fail(NULL, st, "joining job %s as rank %u of %u: %s", l.job, l.rank, l.world_size, spc_last_error(h));
        spc_detach(h);
        return st;
    }
    spc__struct_write(NULL, spc_launch_t, launch_p, world, &l);
    *h_p = h;
    return SPC_OK;
}
