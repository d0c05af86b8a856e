/*
 * job.c — jobs and their groups: a job's creation, its members joining (here
 * or on other daemons), its nodes, and what a member, a rank or a node lost
 * does to it; the groups of a job and each client's list of its own.
 *
 * Groups. A job's world is a group; meshes (mesh.c) add dp, sp, Ulysses and ring
 * groups over the same members. Each client keeps the list of groups it is in.
 * The collectives of a group, and how they are matched and fail, are coll.c's.
 */
#include "core/engine.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sodium.h>
#include <sys/random.h>

#include "base/log.h"
#include "core/client.h"
#include "core/coll.h"
#include "core/job.h"
#include "core/mesh.h"
#include "core/transport.h"

/* ---------------------------------------------------------------- groups */

static int membership_add(sp_client_t *c, sp_group_t *g, uint32_t grank)
{
    if (c->nmemb == c->memb_cap) {
        uint32_t cap = c->memb_cap ? c->memb_cap * 2 : 8;
        sp_membership_t *m = realloc(c->memb, cap * sizeof *m);
        if (m == NULL)
            return -1;
        c->memb = m;
        c->memb_cap = cap;
    }
    c->memb[c->nmemb++] = (sp_membership_t){ .group_id = g->id, .group = g, .grank = grank };
    return 0;
}

static void membership_remove(sp_client_t *c, const sp_group_t *g)
{
    for (uint32_t i = 0; i < c->nmemb; i++) {
        if (c->memb[i].group == g) {
            c->memb[i] = c->memb[--c->nmemb];
            return;
        }
    }
}

sp_group_t *sp_client_group(const sp_client_t *c, uint32_t id, uint32_t *grank_p)
{
    for (uint32_t i = 0; i < c->nmemb; i++) {
        if (c->memb[i].group_id == id) {
            *grank_p = c->memb[i].grank;
            return c->memb[i].group;
        }
    }
    return NULL;
}

static void group_free(sp_group_t *g)
{
    free(g->remote);
    free(g->resume_first);
    free(g->next_seq);
    free(g->ranks);
    free(g);
}

sp_group_t *sp_group_create(sp_engine_t *eng, sp_job_t *job, const char *kind, const uint32_t *ranks,
                            uint32_t size)
{
    sp_group_t *g = calloc(1, sizeof *g);
    if (g == NULL)
        return NULL;
    g->next_seq = calloc((size_t)size * SP_CHANNELS, sizeof *g->next_seq);
    g->ranks = malloc((size_t)size * sizeof *g->ranks);
    if (g->next_seq == NULL || g->ranks == NULL) {
        group_free(g);
        return NULL;
    }
    memcpy(g->ranks, ranks, (size_t)size * sizeof *ranks);
    /* Where the ranks live: this daemon's count, and the other daemons (each once). */
    for (uint32_t r = 0; r < size; r++) {
        uint32_t node = job->members[ranks[r]].node;
        if (node == 0) {
            g->nlocal++;
            continue;
        }
        bool seen = false;
        for (uint32_t k = 0; k < g->nremote && !seen; k++)
            seen = g->remote[k] == node;
        if (seen)
            continue;
        uint32_t *nr = realloc(g->remote, (g->nremote + 1) * sizeof *nr);
        if (nr == NULL) {
            group_free(g);
            return NULL;
        }
        g->remote = nr;
        g->remote[g->nremote++] = node;
    }
    g->index = job->ngroups++;
    g->id = eng->next_group_id++;
    if (eng->next_group_id == 0)
        eng->next_group_id = 1;
    g->size = size;
    g->job = job;
    snprintf(g->kind, sizeof g->kind, "%s", kind);
    for (uint32_t r = 0; r < size; r++) {
        sp_client_t *c = job->members[ranks[r]].client;
        if (c != NULL && membership_add(c, g, r) != 0) {
            for (uint32_t k = 0; k < r; k++)
                if (job->members[ranks[k]].client != NULL)
                    membership_remove(job->members[ranks[k]].client, g);
            group_free(g);
            return NULL;
        }
    }
    g->stats = sp_stats_group_new(eng, g);
    g->next = job->groups;
    job->groups = g;
    return g;
}

static bool group_has(const sp_group_t *g, uint32_t rank)
{
    for (uint32_t r = 0; r < g->size; r++)
        if (g->ranks[r] == rank)
            return true;
    return false;
}

static void group_destroy(sp_engine_t *eng, sp_group_t *g)
{
    sp_group_break(eng, g, SPC_ERR_CANCELED, "group destroyed");
    if (g->nremote > 0) {   /* its NCCL communicators go once idle, and the copies kept of its messages */
        SP_TRANSPORT_CALL(eng->xdev_ops, group_gone, eng, g->job->id, g->index);
        SP_TRANSPORT_CALL(eng->net_ops, group_gone, eng, g->job->id, g->index);
    }
    for (uint32_t r = 0; r < g->size; r++) {
        sp_client_t *c = g->job->members != NULL ? g->job->members[g->ranks[r]].client : NULL;
        if (c != NULL)
            membership_remove(c, g);
    }
    sp_stats_group_gone(eng, g->stats);
    group_free(g);
}

uint32_t sp_group_pending_ops(const sp_group_t *g)
{
    uint32_t n = 0;
    for (unsigned ch = 0; ch < SP_CHANNELS; ch++)
        for (const sp_coll_t *coll = g->colls[ch]; coll != NULL; coll = coll->next)
            if (coll->failed == SPC_OK)
                n += coll->arrived;
    return n;
}

/* ---------------------------------------------------------------- jobs */

sp_job_t *sp_job_find(sp_engine_t *eng, const char *id)
{
    for (sp_job_t *j = eng->jobs; j != NULL; j = j->next)
        if (strcmp(j->id, id) == 0)
            return j;
    return NULL;
}

/* Live jobs the client created. Counted rather than kept: there are at most
 * max_clients x max_jobs_per_client, and jobs end without their creator. */
static uint32_t jobs_created_by(const sp_engine_t *eng, uint64_t client_id)
{
    uint32_t n = 0;
    for (const sp_job_t *j = eng->jobs; j != NULL; j = j->next)
        n += j->creator_id == client_id;
    return n;
}

spc_status_t sp_job_create(sp_engine_t *eng, sp_client_t *creator, const uint32_t *allow, size_t nallow,
                           sp_job_t **job_p, sp_err_t *e)
{
    uint8_t token[16];

    if (nallow > SP_JOB_MAX_ALLOW_UIDS)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "%zu uids allowed to join; a job admits at most %u besides its "
                          "owner: grant fewer", nallow, SP_JOB_MAX_ALLOW_UIDS);
    if (jobs_created_by(eng, creator->id) >= (uint64_t)eng->cfg->max_jobs_per_client) {
        sp_err_set(e, SPC_ERR_LIMIT, "this client already has %" PRId64 " live jobs (max_jobs_per_client); a job ends "
                   "when its creator and all its ranks have left", eng->cfg->max_jobs_per_client);
        sp_warn(JOB, "client %" PRIu64 " (pid %d): job refused: %s", creator->id, (int)creator->pid, e->msg);
        return e->status;
    }
    if (getrandom(token, sizeof token, 0) != (ssize_t)sizeof token)
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "no randomness for a job token");
    sp_job_t *job = calloc(1, sizeof *job);
    if (job == NULL)
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
    int n = snprintf(job->id, sizeof job->id, "%.63s:", eng->node);
    for (size_t i = 0; i < sizeof token; i++)
        n += snprintf(job->id + n, sizeof job->id - (size_t)n, "%02x", token[i]);
    if (sp_job_node_index(job, eng->node, true) != 0) {
        free(job);
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
    }
    job->creator_id = creator->id;
    job->created_ns = sp_now_ns();
    job->access = (sp_job_access_t){ .known = true, .owner = creator->uid, .nallow = (uint32_t)nallow };
    for (size_t i = 0; i < nallow; i++)
        job->access.allow[i] = (uid_t)allow[i];
    job->next = eng->jobs;
    eng->jobs = job;
    eng->njobs++;
    sp_info(JOB, "job %s created by client %" PRIu64 " (pid %d, uid %u; %zu other uid%s may join)", job->id,
            creator->id, (int)creator->pid, (unsigned)creator->uid, nallow, nallow == 1 ? "" : "s");
    *job_p = job;
    return SPC_OK;
}

bool sp_job_visible(const sp_job_t *job, const sp_viewer_t *viewer)
{
    if (viewer == NULL || sp_auth_may_see(&job->access, viewer->self, viewer->uid))
        return true;
    for (uint32_t r = 0; r < job->world_size; r++)
        if (job->members[r].client != NULL && job->members[r].client->uid == viewer->uid)
            return true;
    return false;
}

static void job_free(sp_engine_t *eng, sp_job_t *job)
{
    sp_job_t **pp = &eng->jobs;
    while (*pp != NULL && *pp != job)
        pp = &(*pp)->next;
    if (*pp == job) {
        *pp = job->next;
        eng->njobs--;
    }
    sp_info(JOB, "job %s ended", job->id);
    /* A name is for the next launch to take; an id never comes back. */
    if (!job->named) {
        snprintf(eng->ended_jobs[eng->ended_next], SP_JOB_ID_MAX, "%s", job->id);
        eng->ended_next = (eng->ended_next + 1) % SP_ENDED_JOBS;
    }
    while (job->groups != NULL) {
        sp_group_t *g = job->groups;
        job->groups = g->next;
        group_destroy(eng, g);
    }
    while (job->meshes != NULL) {
        sp_mesh_t *m = job->meshes;
        job->meshes = m->next;
        sp_mesh_free(m);
    }
    free(job->members);
    free(job->nodes);
    free(job);
}

static uint32_t job_live_members(const sp_job_t *job)
{
    uint32_t n = 0;
    for (uint32_t r = 0; r < job->world_size; r++)
        n += job->members[r].client != NULL;
    return n;
}

/* A job lives while its creator or one of its ranks is attached: ranks may
 * join later than the creator made it. A named job has no creator: it lives
 * from its first join until its last rank leaves. Once every rank of a started job has
 * left, nobody can join it again, so it ends even if its creator stays: a
 * launcher that keeps one handle for weeks and creates a job per run would
 * otherwise hold them all. Only for jobs wholly on this daemon; a job over
 * several keeps its root until the creator leaves too, as its other daemons'
 * ranks leave on their own time. */
static void job_maybe_free(sp_engine_t *eng, sp_job_t *job)
{
    if (job_live_members(job) > 0)
        return;
    if (job->creator_id == 0 || (job->complete && job->nnodes <= 1 && !job->mirror))
        job_free(eng, job);
}

/* Why job_id cannot be joined when it is not there: it ended (BUSY), or it
 * never was (NOT_FOUND). */
static spc_status_t job_absent(const sp_engine_t *eng, const char *job_id, const char *where, sp_err_t *e)
{
    for (uint32_t i = 0; i < SP_ENDED_JOBS; i++) {
        /* Slots not yet used are empty strings, which no job id is. */
        if (eng->ended_jobs[i][0] != '\0' && strcmp(eng->ended_jobs[i], job_id) == 0)
            return sp_err_set(e, SPC_ERR_BUSY, "job %.*s has ended (every rank left); create a new job", 128, job_id);
    }
    return sp_err_set(e, SPC_ERR_NOT_FOUND, "no job '%.*s' %s", 128, job_id, where);
}

/* Every rank is in: the world group exists from now on. */
static int job_complete(sp_engine_t *eng, sp_job_t *job)
{
    uint32_t *ranks = malloc((size_t)job->world_size * sizeof *ranks);
    for (uint32_t r = 0; ranks != NULL && r < job->world_size; r++)
        ranks[r] = r;
    job->world = ranks != NULL ? sp_group_create(eng, job, "world", ranks, job->world_size) : NULL;
    free(ranks);
    if (job->world == NULL)
        return -1;
    /* The root of a job over daemons draws its nonce; JobReady carries it. */
    if (!job->mirror && job->nnodes > 1)
        job->has_nonce = getrandom(job->nonce, sizeof job->nonce, 0) == (ssize_t)sizeof job->nonce;
    job->complete = true;
    job->complete_ns = sp_now_ns();
    sp_info(JOB, "job %s complete: %u ranks on %u node%s, world group %u", job->id, job->world_size, job->nnodes,
            job->nnodes == 1 ? "" : "s", job->world->id);
    return 0;
}

uint32_t sp_job_node_index(sp_job_t *job, const char *name, bool add)
{
    for (uint32_t i = 0; i < job->nnodes; i++)
        if (strcmp(job->nodes[i], name) == 0)
            return i;
    if (!add)
        return UINT32_MAX;
    char (*n)[SP_NODE_MAX] = realloc(job->nodes, (job->nnodes + 1) * sizeof *n);
    if (n == NULL)
        return UINT32_MAX;
    job->nodes = n;
    snprintf(job->nodes[job->nnodes], SP_NODE_MAX, "%s", name);
    return job->nnodes++;
}

void sp_job_root_node(const char *job_id, char node[SP_NODE_MAX])
{
    size_t n = strcspn(job_id, ":");
    snprintf(node, SP_NODE_MAX, "%.*s", (int)(n < SP_NODE_MAX ? n : SP_NODE_MAX - 1), job_id);
}

sp_job_t *sp_job_mirror(sp_engine_t *eng, const char *job_id, const char *root)
{
    sp_job_t *job = sp_job_find(eng, job_id);
    if (job != NULL)
        return job;
    job = calloc(1, sizeof *job);
    if (job == NULL)
        return NULL;
    snprintf(job->id, sizeof job->id, "%s", job_id);
    if (sp_job_node_index(job, eng->node, true) != 0 || sp_job_node_index(job, root, true) != 1) {
        free(job->nodes);
        free(job);
        return NULL;
    }
    job->mirror = true;
    job->created_ns = sp_now_ns();
    job->next = eng->jobs;
    eng->jobs = job;
    eng->njobs++;
    sp_info(JOB, "job %s: rooted on node %s, joined here through it", job->id, root);
    return job;
}

/* Whether a rank and a world size can be a join's, whatever the job. */
static spc_status_t join_args_check(uint32_t world_size, uint32_t rank, sp_err_t *e)
{
    if (world_size == 0 || world_size > SP_MAX_WORLD)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "world size %u outside [1, %u]", world_size, SP_MAX_WORLD);
    if (rank >= world_size)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "rank %u is not below the world size %u", rank, world_size);
    return SPC_OK;
}

/* The checks every join makes, local or from another daemon; sizes the members. */
static spc_status_t join_check(sp_job_t *job, uint32_t world_size, uint32_t rank, sp_err_t *e)
{
    SP_CHECK(join_args_check(world_size, rank, e));
    if (job->world_size != 0 && world_size != job->world_size)
        return sp_err_set(e, SPC_ERR_MISMATCH, "job %s has world size %u; this rank said %u", job->id, job->world_size,
                          world_size);
    if (job->complete)
        return sp_err_set(e, SPC_ERR_BUSY, "job %s has already started; create a new job", job->id);
    if (job->world_size == 0) {
        job->members = calloc(world_size, sizeof *job->members);
        if (job->members == NULL)
            return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
        job->world_size = world_size;
    }
    sp_member_t *m = &job->members[rank];
    if (m->present)
        return sp_err_set(e, SPC_ERR_BUSY, "rank %u of job %s is already taken by pid %d%s%s", rank, job->id,
                          (int)m->pid, m->node ? " on node " : "", m->node ? job->nodes[m->node] : "");
    return SPC_OK;
}

/* Whether a join of `launch` with `world_size` ranks belongs to the named job
 * that holds the name: else another launch reuses it while it runs. */
static spc_status_t named_job_check(const sp_job_t *job, const char *launch, uint32_t world_size, sp_err_t *e)
{
    if (strcmp(job->launch, launch) != 0)
        return sp_err_set(e, SPC_ERR_BUSY, "job %s is held by another launch (%s, %u of %u ranks joined, for %.0f s); "
                          "this rank's launch is %s: choose another name (SPC_JOB) or wait until it ends", job->id,
                          job->launch, job->joined, job->world_size, (double)(sp_now_ns() - job->created_ns) / 1e9,
                          launch);
    if (job->world_size != 0 && world_size != job->world_size)
        return sp_err_set(e, SPC_ERR_MISMATCH, "job %s of launch %s has %u ranks; this rank says %u: the ranks of "
                          "one launch must agree on the world size", job->id, launch, job->world_size, world_size);
    if (job->complete)
        return sp_err_set(e, SPC_ERR_BUSY, "job %s of launch %s has started with all its %u ranks and takes no more "
                          "joins: a rank that comes back needs a new launch (another launch id, or SPC_JOB)", job->id,
                          launch, job->world_size);
    return SPC_OK;
}

spc_status_t sp_job_join_remote(sp_engine_t *eng, const char *job_id, const char *launch, uint32_t world_size,
                                uint32_t rank, pid_t pid, uid_t uid, const char *node, sp_job_t **job_p,
                                bool *complete_p, sp_err_t *e)
{
    sp_job_t *job = sp_job_find(eng, job_id);
    if (job == NULL || job->mirror) {
        char where[SP_NODE_MAX + 32];
        snprintf(where, sizeof where, "%s on node %s", strchr(job_id, '/') != NULL ? "held" : "rooted", eng->node);
        return job_absent(eng, job_id, where, e);
    }
    SP_CHECK(sp_auth_may_join(&job->access, job->id, uid, e));
    if (job->named)
        SP_CHECK(named_job_check(job, launch, world_size, e));
    spc_status_t st = join_check(job, world_size, rank, e);
    if (st != SPC_OK)
        return st;
    uint32_t idx = sp_job_node_index(job, node, true);
    if (idx == UINT32_MAX)
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
    sp_member_t *m = &job->members[rank];
    *m = (sp_member_t){ .node = idx, .present = true, .pid = pid };
    job->joined++;
    sp_info(JOB, "job %s: rank %u of %u joined on node %s (pid %d)", job->id, rank, world_size, node, (int)pid);
    *complete_p = false;
    if (job->joined == job->world_size) {
        if (job_complete(eng, job) != 0) {
            sp_job_join_remote_cancel(eng, job, rank, node);
            return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
        }
        *complete_p = true;
    }
    *job_p = job;
    return SPC_OK;
}

void sp_job_join_remote_cancel(sp_engine_t *eng, sp_job_t *job, uint32_t rank, const char *node)
{
    (void)eng;
    if (job->complete || rank >= job->world_size)
        return;
    sp_member_t *m = &job->members[rank];
    if (!m->present || m->node == 0 || strcmp(job->nodes[m->node], node) != 0)
        return;
    *m = (sp_member_t){ 0 };
    if (--job->joined == 0) {
        free(job->members);
        job->members = NULL;
        job->world_size = 0;
    }
}

spc_status_t sp_job_ready(sp_engine_t *eng, sp_job_t *job, uint32_t world_size, char *const *rank_node, size_t n,
                          const sp_job_access_t *access, const uint8_t *nonce, size_t nonce_len, sp_err_t *e)
{
    if (!job->mirror || job->complete || world_size != job->world_size || n != world_size)
        return sp_err_set(e, SPC_ERR_PROTOCOL, "job %s: a JobReady for %u ranks does not fit this daemon's view (%u "
                          "ranks, %s)", job->id, world_size, job->world_size, job->complete ? "complete" : "joining");
    if (nonce_len != 0 && nonce_len != sizeof job->nonce)
        return sp_err_set(e, SPC_ERR_PROTOCOL, "job %s: a JobReady with a nonce of %zu bytes", job->id, nonce_len);
    for (uint32_t r = 0; r < world_size; r++) {
        sp_member_t *m = &job->members[r];
        bool here = strcmp(rank_node[r], eng->node) == 0;
        if (here != (m->present && m->node == 0))
            return sp_err_set(e, SPC_ERR_PROTOCOL, "job %s: the root places rank %u on node %s, which this daemon %s",
                              job->id, r, rank_node[r], here ? "does not hold" : "holds");
        if (here)
            continue;
        uint32_t idx = sp_job_node_index(job, rank_node[r], true);
        if (idx == UINT32_MAX)
            return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
        *m = (sp_member_t){ .node = idx, .present = true };
    }
    job->joined = world_size;
    job->access = *access;   /* before the groups: their records keep it */
    job->has_nonce = nonce_len == sizeof job->nonce;
    if (job->has_nonce)
        memcpy(job->nonce, nonce, sizeof job->nonce);
    if (job_complete(eng, job) != 0)
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
    return SPC_OK;
}

/* Records c as `rank` of job, once the job's checks pass (sp_job_join). */
static spc_status_t job_join(sp_engine_t *eng, sp_client_t *c, sp_job_t *job, uint32_t world_size, uint32_t rank,
                             void *join_pending, sp_job_t **job_p, bool *complete_p, sp_err_t *e)
{
    spc_status_t st = join_check(job, world_size, rank, e);
    if (st != SPC_OK)
        return st;
    sp_member_t *m = &job->members[rank];
    m->client = c;
    m->present = true;
    m->node = 0;
    m->pid = c->pid;
    m->join_pending = join_pending;
    job->joined++;
    c->job = job;
    c->rank = rank;
    sp_info(JOB, "job %s: rank %u of %u joined (client %" PRIu64 ", pid %d)", job->id, rank, world_size,
            c->id, (int)c->pid);

    *complete_p = false;
    /* A mirror's world is complete when its root says so (sp_job_ready). */
    if (!job->mirror && job->joined == job->world_size) {
        if (job_complete(eng, job) != 0) {
            sp_job_join_cancel(eng, job, rank);
            return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
        }
        *complete_p = true;
    }
    *job_p = job;
    return SPC_OK;
}

spc_status_t sp_job_join(sp_engine_t *eng, sp_client_t *c, const char *job_id, uint32_t world_size,
                         uint32_t rank, void *join_pending, sp_job_t **job_p, bool *complete_p,
                         sp_err_t *e)
{
    if (c->job != NULL)
        return sp_err_set(e, SPC_ERR_BUSY, "this client is already rank %u of job %s", c->rank, c->job->id);
    sp_job_t *job = sp_job_find(eng, job_id);
    /* A named job is joined by its name, which carries the launch it checks. */
    if (job == NULL || job->named)
        return job_absent(eng, job_id, "on this daemon", e);
    /* Before anything of the job changes: a refused join leaves no trace in it.
     * A mirror whose root has not said whose the job is yet leaves it to the root. */
    if (job->access.known)
        SP_CHECK(sp_auth_may_join(&job->access, job->id, c->uid, e));
    return job_join(eng, c, job, world_size, rank, join_pending, job_p, complete_p, e);
}

void sp_job_named_id(uid_t uid, const char *name, char id[SP_JOB_ID_MAX])
{
    snprintf(id, SP_JOB_ID_MAX, "%u/%s", (unsigned)uid, name);
}

/* Live named jobs of a user. Counted rather than kept, as jobs_created_by. */
static uint32_t named_jobs_of(const sp_engine_t *eng, uid_t uid)
{
    uint32_t n = 0;
    for (const sp_job_t *j = eng->jobs; j != NULL; j = j->next)
        n += j->named && j->access.owner == uid;
    return n;
}

static spc_status_t named_jobs_limit(const sp_engine_t *eng, uid_t uid, sp_err_t *e)
{
    if (named_jobs_of(eng, uid) >= (uint64_t)eng->cfg->max_named_jobs_per_user)
        return sp_err_set(e, SPC_ERR_LIMIT, "uid %u already holds %" PRId64 " named jobs (max_named_jobs_per_user); "
                          "a named job ends when its last rank leaves", (unsigned)uid,
                          eng->cfg->max_named_jobs_per_user);
    return SPC_OK;
}

/* The named job `id` for a join of c, made when there is none. */
static spc_status_t named_job_make(sp_engine_t *eng, sp_client_t *c, const char *id, const char *launch,
                                   sp_job_t **job_p, sp_err_t *e)
{
    SP_CHECK(named_jobs_limit(eng, c->uid, e));
    sp_job_t *job = calloc(1, sizeof *job);
    if (job == NULL || sp_job_node_index(job, eng->node, true) != 0) {
        free(job);
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
    }
    snprintf(job->id, sizeof job->id, "%s", id);
    snprintf(job->launch, sizeof job->launch, "%s", launch);
    job->named = true;
    job->created_ns = sp_now_ns();
    job->access = (sp_job_access_t){ .known = true, .owner = c->uid };
    job->next = eng->jobs;
    eng->jobs = job;
    eng->njobs++;
    sp_info(JOB, "job %s made by the join of client %" PRIu64 " (pid %d), launch %s", job->id, c->id, (int)c->pid,
            job->launch);
    *job_p = job;
    return SPC_OK;
}

spc_status_t sp_job_named_check(const sp_client_t *c, const char *name, const char *launch, uint32_t world_size,
                                uint32_t rank, sp_err_t *e)
{
    const char *bad;
    if ((bad = sp_job_name_problem(name)) != NULL)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "job name '%.*s' %s",
                          (int)sp_job_text_plain(name, SP_JOB_NAME_MAX - 1, SP_JOB_NAME_CHARS), name, bad);
    if ((bad = sp_job_launch_problem(launch)) != NULL)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "launch id '%.*s' %s",
                          (int)sp_job_text_plain(launch, SP_JOB_LAUNCH_MAX - 1, SP_JOB_LAUNCH_CHARS), launch, bad);
    if (c->job != NULL)
        return sp_err_set(e, SPC_ERR_BUSY, "this client is already rank %u of job %s", c->rank, c->job->id);
    return join_args_check(world_size, rank, e);
}

spc_status_t sp_job_join_named(sp_engine_t *eng, sp_client_t *c, const char *name, const char *launch,
                               uint32_t world_size, uint32_t rank, void *join_pending, sp_job_t **job_p,
                               bool *complete_p, sp_err_t *e)
{
    char id[SP_JOB_ID_MAX];

    SP_CHECK(sp_job_named_check(c, name, launch, world_size, rank, e));
    /* Each user names its own jobs: nobody can take a name from another. */
    sp_job_named_id(c->uid, name, id);
    sp_job_t *job = sp_job_find(eng, id);
    if (job != NULL)
        SP_CHECK(named_job_check(job, launch, world_size, e));
    else
        SP_CHECK(named_job_make(eng, c, id, launch, &job, e));
    spc_status_t st = job_join(eng, c, job, world_size, rank, join_pending, job_p, complete_p, e);
    /* A job made for a refused join holds nobody. Found again by its id: a
     * completion that ran out of memory took the join back and may have freed it. */
    if (st != SPC_OK && (job = sp_job_find(eng, id)) != NULL)
        job_maybe_free(eng, job);
    return st;
}

spc_status_t sp_job_mirror_named(sp_engine_t *eng, uid_t uid, const char *name, const char *launch, const char *home,
                                 sp_err_t *e)
{
    char id[SP_JOB_ID_MAX];
    sp_job_named_id(uid, name, id);
    SP_CHECK(named_jobs_limit(eng, uid, e));
    sp_job_t *job = sp_job_mirror(eng, id, home);
    if (job == NULL)
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
    job->named = true;
    snprintf(job->launch, sizeof job->launch, "%s", launch);
    /* The id is the user's own: whose it is needs no word from the home. */
    job->access = (sp_job_access_t){ .known = true, .owner = uid };
    return SPC_OK;
}

/* ---------------------------------------------------------------- resuming after a restart */

_Static_assert(SP_TICKET_NODE_MAX == SP_NODE_MAX, "a ticket holds a job's node names whole");

/* The nodes of a job over daemons, each rank's among them, and its nonce, as
 * a ticket carries them: false when they do not fit one. */
static bool ticket_nodes_fill(const sp_job_t *job, sp_job_ticket_t *t)
{
    if (job->nnodes > SP_TICKET_NODES || (job->nnodes > 1 && !job->has_nonce))
        return false;
    t->nnodes = job->nnodes;
    t->root = job->mirror ? 1 : 0;
    for (uint32_t i = 0; i < job->nnodes; i++)
        snprintf(t->nodes[i], sizeof t->nodes[i], "%s", job->nodes[i]);
    for (uint32_t r = 0; r < job->world_size; r++) {
        uint32_t node = job->members[r].node;
        if (t->nruns > 0 && t->run_node[t->nruns - 1] == node)
            continue;
        if (t->nruns == SP_TICKET_RUNS)
            return false;
        t->run_first[t->nruns] = r;
        t->run_node[t->nruns++] = (uint8_t)node;
    }
    if (job->has_nonce)
        memcpy(t->nonce, job->nonce, sizeof t->nonce);
    return true;
}

/* The node (its index in t->nodes) of rank r of a ticket's job. */
static uint32_t ticket_rank_node(const sp_job_ticket_t *t, uint32_t r)
{
    uint32_t i = 0;
    while (i + 1 < t->nruns && t->run_first[i + 1] <= r)
        i++;
    return t->run_node[i];
}

bool sp_job_ticket(const sp_engine_t *eng, const sp_job_t *job, sp_job_ticket_t *t)
{
    if (!eng->resume_key_set)
        return false;
    memset(t, 0, sizeof *t);
    if (!ticket_nodes_fill(job, t))
        return false;
    t->version = SP_JOB_TICKET_VERSION;
    t->world_size = job->world_size;
    t->owner = job->access.owner;
    t->nallow = job->access.nallow;
    for (uint32_t i = 0; i < job->access.nallow; i++)
        t->allow[i] = job->access.allow[i];
    t->named = job->named;
    snprintf(t->id, sizeof t->id, "%s", job->id);
    snprintf(t->launch, sizeof t->launch, "%s", job->launch);
    sp_auth_ticket_seal(eng->resume_key, t);
    return true;
}

spc_status_t sp_job_ticket_check(const sp_engine_t *eng, const uint8_t *ticket, size_t ticket_len, uid_t uid,
                                 uint32_t rank, sp_job_ticket_t *t_p, sp_err_t *e)
{
    sp_job_ticket_t t;

    if (!eng->resume_key_set)
        return sp_err_set(e, SPC_ERR_UNSUPPORTED, "this spd has no resume key, so it takes no job over (its log says "
                          "why)");
    SP_CHECK(sp_auth_ticket_open(eng->resume_key, ticket, ticket_len, &t, e));
    /* The ticket is spd's word for whose the job is; the caller must be one of them. */
    sp_job_access_t access = { .known = true, .owner = t.owner, .nallow = t.nallow };
    for (uint32_t i = 0; i < t.nallow; i++)
        access.allow[i] = t.allow[i];
    SP_CHECK(sp_auth_may_join(&access, t.id, uid, e));
    if (rank >= t.world_size)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "resume as rank %u of job %s, which has %u ranks", rank, t.id,
                          t.world_size);
    /* Its daemon sealed it; another node's spd, under the same key, does not take it. */
    if (strcmp(t.nodes[0], eng->node) != 0 || ticket_rank_node(&t, rank) != 0)
        return sp_err_set(e, SPC_ERR_PERMISSION, "rank %u of job %s ran on node %s, not on this node (%s)", rank,
                          t.id, t.nodes[ticket_rank_node(&t, rank)], eng->node);
    *t_p = t;
    return SPC_OK;
}

/* A rebuilt job's daemons and its ranks there, as the ticket says: ranks on
 * the others are present (they did not go with this spd), and until each of
 * those daemons accepts the relink, nothing goes there for the job. Before
 * any group: groups read where their ranks are. */
static int resumed_nodes_set(const sp_engine_t *eng, sp_job_t *job, const sp_job_ticket_t *t)
{
    for (uint32_t i = 1; i < t->nnodes; i++)
        if (sp_job_node_index(job, t->nodes[i], true) != i)
            return -1;   /* out of memory, or a name twice (a ticket spd did not seal so) */
    for (uint32_t r = 0; r < t->world_size; r++) {
        uint32_t node = ticket_rank_node(t, r);
        job->members[r] = (sp_member_t){ .node = node, .present = node != 0 };
        job->joined += node != 0;
    }
    job->mirror = t->root != 0;
    if (t->nnodes > 1) {
        memcpy(job->nonce, t->nonce, sizeof job->nonce);
        job->has_nonce = true;
        job->relinking = ((1u << t->nnodes) - 1) & ~1u;
        job->relink_until_ns = sp_now_ns() + (uint64_t)eng->cfg->peer_restart_grace_ms * 1000000;
    }
    return 0;
}

/* The job a ticket names, made complete as its spd had it: its world group is
 * there from the start, and each rank is present from when it comes back. */
static spc_status_t resumed_job_make(sp_engine_t *eng, const sp_job_ticket_t *t, sp_job_t **job_p, sp_err_t *e)
{
    if (t->world_size > SP_MAX_WORLD)
        return sp_err_set(e, SPC_ERR_PROTOCOL, "a resume ticket of %u ranks", t->world_size);
    /* What a named job counts against, a resumed one counts too. A job made
     * by a creator needs a ticket of it, one per client that comes back: there
     * are at most max_clients of them. */
    if (t->named && named_jobs_of(eng, t->owner) >= (uint64_t)eng->cfg->max_named_jobs_per_user)
        return sp_err_set(e, SPC_ERR_LIMIT, "uid %u already holds %" PRId64 " named jobs (max_named_jobs_per_user)",
                          (unsigned)t->owner, eng->cfg->max_named_jobs_per_user);
    sp_job_t *job = calloc(1, sizeof *job);
    uint32_t *ranks = malloc((size_t)t->world_size * sizeof *ranks);
    if (job == NULL || ranks == NULL || sp_job_node_index(job, eng->node, true) != 0 ||
        (job->members = calloc(t->world_size, sizeof *job->members)) == NULL)
        goto err_free;
    snprintf(job->id, sizeof job->id, "%s", t->id);
    snprintf(job->launch, sizeof job->launch, "%s", t->launch);
    job->named = t->named != 0;
    job->world_size = t->world_size;
    job->created_ns = sp_now_ns();
    job->access = (sp_job_access_t){ .known = true, .owner = t->owner, .nallow = t->nallow };
    for (uint32_t i = 0; i < t->nallow; i++)
        job->access.allow[i] = t->allow[i];
    job->resumed = true;
    memcpy(job->ticket_mac, t->mac, sizeof job->ticket_mac);
    if (resumed_nodes_set(eng, job, t) != 0)
        goto err_free;
    for (uint32_t r = 0; r < t->world_size; r++)
        ranks[r] = r;
    job->world = sp_group_create(eng, job, "world", ranks, t->world_size);
    if (job->world == NULL)
        goto err_free;
    job->world->resume_first = calloc((size_t)t->world_size * SP_CHANNELS, sizeof *job->world->resume_first);
    if (job->world->resume_first == NULL)
        goto err_free;
    free(ranks);
    job->complete = true;
    job->complete_ns = sp_now_ns();
    job->next = eng->jobs;
    eng->jobs = job;
    eng->njobs++;
    sp_info(JOB, "job %s: made again from its ranks' tickets after a restart: %u ranks on %u node%s, world group %u",
            job->id, job->world_size, job->nnodes, job->nnodes == 1 ? "" : "s", job->world->id);
    *job_p = job;
    return SPC_OK;

err_free:
    free(ranks);
    if (job != NULL) {
        if (job->world != NULL)
            group_destroy(eng, job->world);
        free(job->members);
        free(job->nodes);
        free(job);
    }
    return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
}

/* Whether a group a resuming rank brings can be the job's (`rank` in it, of
 * the world's ranks, each once, of a kind a mesh has), and agrees with the
 * group of its index another rank brought first; *g_p that one, or NULL. */
static spc_status_t resume_group_check(const sp_job_t *job, uint32_t rank, const sp_resume_group_t *rg,
                                       sp_group_t **g_p, sp_err_t *e)
{
    static const char *const kinds[SP_MESH_KINDS] = { "dp", "sp", "ulysses", "ring" };
    bool kind_ok = false, mine = false;
    for (unsigned k = 0; k < SP_MESH_KINDS; k++)
        kind_ok |= strcmp(rg->kind, kinds[k]) == 0;
    if (!kind_ok || rg->index == 0 || rg->size == 0 || rg->size > job->world_size)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "resume: group #%u of kind '%.12s' and %u ranks cannot be a mesh's "
                          "of job %s", rg->index, rg->kind, rg->size, job->id);
    for (uint32_t i = 0; i < rg->size; i++) {
        if (rg->ranks[i] >= job->world_size)
            return sp_err_set(e, SPC_ERR_INVALID_ARG, "resume: group #%u names rank %u of %u", rg->index,
                              rg->ranks[i], job->world_size);
        for (uint32_t k = 0; k < i; k++)
            if (rg->ranks[k] == rg->ranks[i])
                return sp_err_set(e, SPC_ERR_INVALID_ARG, "resume: group #%u names rank %u twice", rg->index,
                                  rg->ranks[i]);
        mine |= rg->ranks[i] == rank;
    }
    if (!mine)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "resume: group #%u is not one of rank %u's", rg->index, rank);
    sp_group_t *g = sp_job_group_by_index(job, rg->index);
    if (g != NULL && (g->size != rg->size || strcmp(g->kind, rg->kind) != 0 ||
                      memcmp(g->ranks, rg->ranks, rg->size * sizeof *rg->ranks) != 0 || g->resume_first == NULL))
        return sp_err_set(e, SPC_ERR_MISMATCH, "resume: group #%u of job %s came back from another rank with other "
                          "members", rg->index, job->id);
    *g_p = g;
    return SPC_OK;
}

/* Makes the group a resuming rank brings, under its index, or finds it. */
static sp_group_t *resume_group_make(sp_engine_t *eng, sp_job_t *job, const sp_resume_group_t *rg)
{
    sp_group_t *g = sp_job_group_by_index(job, rg->index);
    if (g != NULL)
        return g;
    g = sp_group_create(eng, job, rg->kind, rg->ranks, rg->size);
    if (g == NULL)
        return NULL;
    g->index = rg->index;
    if (job->ngroups <= rg->index)
        job->ngroups = rg->index + 1;
    g->resume_first = calloc((size_t)g->size * SP_CHANNELS, sizeof *g->resume_first);
    return g->resume_first != NULL ? g : NULL;   /* a group without it stays the job's, unused */
}

/* Sets a resuming rank's sequence numbers in a group (checked: resume_seqs_check). */
static void resume_seqs_set(sp_group_t *g, uint32_t grank, const sp_resume_seq_t *seqs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        size_t k = (size_t)seqs[i].channel * g->size + grank;
        g->next_seq[k] = seqs[i].next;
        g->resume_first[k] = seqs[i].first;
    }
}

static uint32_t group_rank_of(const sp_group_t *g, uint32_t rank)
{
    for (uint32_t r = 0; r < g->size; r++)
        if (g->ranks[r] == rank)
            return r;
    return UINT32_MAX;
}

/* The sequence numbers a resuming rank brings, checked before anything is set. */
static spc_status_t resume_seqs_check(const sp_resume_seq_t *seqs, size_t n, sp_err_t *e)
{
    unsigned seen = 0;
    for (size_t i = 0; i < n; i++) {
        if (seqs[i].channel >= SP_CHANNELS || (seen & (1u << seqs[i].channel)))
            return sp_err_set(e, SPC_ERR_INVALID_ARG, "resume: channel %u given twice or outside [0, %u)",
                              seqs[i].channel, SP_CHANNELS);
        if (seqs[i].first > seqs[i].next)
            return sp_err_set(e, SPC_ERR_INVALID_ARG, "resume: channel %u replays from op #%" PRIu64 ", past its next "
                              "op #%" PRIu64, seqs[i].channel, seqs[i].first, seqs[i].next);
        seen |= 1u << seqs[i].channel;
    }
    return SPC_OK;
}

spc_status_t sp_job_resume(sp_engine_t *eng, sp_client_t *c, const uint8_t *ticket, size_t ticket_len, uint32_t rank,
                           const sp_resume_seq_t *seqs, size_t nseqs, const sp_resume_group_t *groups,
                           size_t ngroups, uint32_t *ids, sp_job_t **job_p, sp_err_t *e)
{
    sp_job_ticket_t t;

    if (c->job != NULL)
        return sp_err_set(e, SPC_ERR_BUSY, "this client is already rank %u of job %s", c->rank, c->job->id);
    SP_CHECK(sp_job_ticket_check(eng, ticket, ticket_len, c->uid, rank, &t, e));
    SP_CHECK(resume_seqs_check(seqs, nseqs, e));
    /* As many as the meshes a job may have give a rank. */
    if (ngroups > (size_t)SP_MAX_MESHES * SP_MESH_KINDS)
        return sp_err_set(e, SPC_ERR_LIMIT, "resume: %zu groups of meshes; a rank has at most %u", ngroups,
                          SP_MAX_MESHES * SP_MESH_KINDS);
    for (size_t i = 0; i < ngroups; i++) {
        SP_CHECK(resume_seqs_check(groups[i].seqs, groups[i].nseqs, e));
        for (size_t k = 0; k < i; k++)
            if (groups[k].index == groups[i].index)
                return sp_err_set(e, SPC_ERR_INVALID_ARG, "resume: group #%u brought twice", groups[i].index);
    }

    sp_job_t *job = sp_job_find(eng, t.id);
    if (job != NULL && !job->resumed)
        return sp_err_set(e, SPC_ERR_BUSY, "job %s is live in this spd, which did not take it over from another: a "
                          "rank comes back to it only after spd restarted", job->id);
    if (job != NULL && sodium_memcmp(job->ticket_mac, t.mac, sizeof t.mac) != 0)
        return sp_err_set(e, SPC_ERR_BUSY, "job %s was taken back from another ticket (another launch of its name); "
                          "this rank's launch is %s", job->id, t.launch);
    if (job != NULL && job->members[rank].present)
        return sp_err_set(e, SPC_ERR_BUSY, "rank %u of job %s came back already (pid %d)", rank, job->id,
                          (int)job->members[rank].pid);
    bool made = job == NULL;
    if (made)
        SP_CHECK(resumed_job_make(eng, &t, &job, e));
    /* Every group checked before anything of the job changes. */
    for (size_t i = 0; i < ngroups; i++) {
        sp_group_t *g;
        spc_status_t st = groups[i].size <= t.world_size ? resume_group_check(job, rank, &groups[i], &g, e)
                                                          : sp_err_set(e, SPC_ERR_INVALID_ARG, "resume: a group of "
                                                                       "%u ranks", groups[i].size);
        if (st != SPC_OK) {
            if (made)
                job_maybe_free(eng, job);
            return st;
        }
    }
    sp_group_t *world = job->world;
    if (membership_add(c, world, rank) != 0) {
        if (made)
            job_maybe_free(eng, job);
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
    }
    job->members[rank] = (sp_member_t){ .client = c, .present = true, .pid = c->pid };   /* node 0: here */
    job->joined++;
    c->job = job;
    c->rank = rank;
    resume_seqs_set(world, rank, seqs, nseqs);
    /* A group made here takes c in as it is made (its member is set); one another
     * rank made takes it in now. Out of memory, c leaves, and its groups break. */
    for (size_t i = 0; i < ngroups; i++) {
        bool existed = sp_job_group_by_index(job, groups[i].index) != NULL;
        sp_group_t *g = resume_group_make(eng, job, &groups[i]);
        uint32_t grank = g != NULL ? group_rank_of(g, rank) : UINT32_MAX;
        if (g == NULL || (existed && membership_add(c, g, grank) != 0))
            return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
        resume_seqs_set(g, grank, groups[i].seqs, groups[i].nseqs);
        ids[i] = g->id;
        /* Made after the ranks of another node were lost (that node did not
         * take the job back): broken as the groups made before. */
        for (uint32_t r = 0; !existed && r < g->size; r++)
            if (job->members[g->ranks[r]].node != 0 && !job->members[g->ranks[r]].present)
                sp_group_break(eng, g, SPC_ERR_PEER_LOST, job->lost_why);
    }
    sp_info(JOB, "job %s: rank %u of %u came back (client %" PRIu64 ", pid %d, uid %u), %zu groups of meshes",
            job->id, rank, job->world_size, c->id, (int)c->pid, (unsigned)c->uid, ngroups);
    /* What it saw complete, nobody waits for from it. */
    for (sp_group_t *g = job->groups; g != NULL; g = g->next)
        if (group_rank_of(g, rank) != UINT32_MAX)
            sp_group_resume_check(eng, g);
    *job_p = job;
    return SPC_OK;
}

void sp_job_join_cancel(sp_engine_t *eng, sp_job_t *job, uint32_t rank)
{
    if (job->complete || rank >= job->world_size)
        return;
    sp_member_t *m = &job->members[rank];
    if (m->client != NULL) {
        m->client->job = NULL;
        *m = (sp_member_t){ 0 };
        job->joined--;
        if (job->mirror && eng->on_member_left != NULL)   /* the root counted it too */
            eng->on_member_left(eng->hook_arg, job, rank, false, "join taken back");
    }
    /* Nobody waits any more: the next join may pick the world size afresh. */
    if (job->joined == 0) {
        free(job->members);
        job->members = NULL;
        job->world_size = 0;
    }
    /* Its creator may have left while this rank waited: nobody holds it now. */
    job_maybe_free(eng, job);
}

void sp_job_missing(const sp_job_t *job, char *buf, size_t len)
{
    size_t off = (size_t)snprintf(buf, len, "ranks");
    uint32_t missing = 0, shown = 0;
    for (uint32_t r = 0; r < job->world_size; r++) {
        if (job->members[r].present)
            continue;
        missing++;
        if (shown < 16 && off < len) {
            off += (size_t)snprintf(buf + off, len - off, "%s %u", shown ? "," : "", r);
            shown++;
        }
    }
    if (off < len)
        snprintf(buf + off, len - off, "%s (%u of %u) have not joined job %s", missing > shown ? ", ..." : "",
                 missing, job->world_size, job->id);
}

void sp_job_member_lost(sp_engine_t *eng, sp_client_t *c, const char *why)
{
    sp_job_t *job = c->job;
    char detail[SP_DETAIL_BYTES];

    if (job == NULL)
        return;
    uint32_t rank = c->rank;
    if (!job->complete) {
        c->nmemb = 0;
        sp_job_join_cancel(eng, job, rank);   /* may free the job */
        return;
    }
    snprintf(detail, sizeof detail, "rank %u (pid %d) lost: %s", rank, (int)c->pid, why);
    /* Leaving is normal at the end of a job; it is news only when others wait on it. */
    uint32_t waiting = job->world != NULL ? sp_group_pending_ops(job->world) : 0;
    if (waiting > 0)
        sp_warn(JOB, "job %s: %s; failing %u waiting ops", job->id, detail, waiting);
    else
        sp_info(JOB, "job %s: rank %u (pid %d) left: %s", job->id, rank, (int)c->pid, why);
    /* Clear the member first: completing the broken groups' ops must not see it.
     * Groups without this rank carry on. */
    job->members[rank].client = NULL;
    job->members[rank].present = false;
    for (sp_group_t *g = job->groups; g != NULL; g = g->next)
        if (group_has(g, rank))
            sp_group_break(eng, g, SPC_ERR_PEER_LOST, detail);
    if (job->nnodes > 1 && eng->on_member_left != NULL)
        eng->on_member_left(eng->hook_arg, job, rank, true, detail);
    c->job = NULL;
    c->nmemb = 0;
    job_maybe_free(eng, job);
}

void sp_job_remote_rank_lost(sp_engine_t *eng, sp_job_t *job, uint32_t rank, const char *why)
{
    if (!job->complete || rank >= job->world_size || job->members[rank].node == 0 || !job->members[rank].present)
        return;
    sp_warn(JOB, "job %s: rank %u on node %s lost: %s", job->id, rank, job->nodes[job->members[rank].node], why);
    job->members[rank].present = false;
    for (sp_group_t *g = job->groups; g != NULL; g = g->next)
        for (uint32_t r = 0; r < g->size; r++)
            if (g->ranks[r] == rank)
                sp_group_break_after(eng, g, r, SPC_ERR_PEER_LOST, why);
}

/* The ranks of daemon idx in a complete job are lost: every group with one breaks. */
static void job_node_lost(sp_engine_t *eng, sp_job_t *job, uint32_t idx, const char *node, const char *why)
{
    char detail[SP_DETAIL_BYTES];
    snprintf(detail, sizeof detail, "node %s lost: %s", node, why);
    snprintf(job->lost_why, sizeof job->lost_why, "%s", detail);
    /* Ops with NCCL held for that daemon's restart fail too. */
    SP_TRANSPORT_CALL(eng->xdev_ops, job_node_lost, eng, job->id, node, detail);
    uint32_t lost = 0;
    for (uint32_t r = 0; r < job->world_size; r++) {
        if (job->members[r].node != idx || !job->members[r].present)
            continue;
        job->members[r].present = false;
        lost++;
        for (sp_group_t *g = job->groups; g != NULL; g = g->next)
            for (uint32_t gr = 0; gr < g->size; gr++)
                if (g->ranks[gr] == r)
                    sp_group_break_after(eng, g, gr, SPC_ERR_PEER_LOST, detail);
    }
    if (lost > 0)
        sp_warn(JOB, "job %s: %s; its %u rank%s are lost", job->id, detail, lost, lost == 1 ? "" : "s");
}

/* Whether the job has ranks of daemon idx still present. */
static bool job_has_node(const sp_job_t *job, uint32_t idx)
{
    for (uint32_t r = 0; r < job->world_size; r++)
        if (job->members[r].node == idx && job->members[r].present)
            return true;
    return false;
}

void sp_job_node_down(sp_engine_t *eng, const char *node, const char *why, uint64_t grace_ns)
{
    sp_node_wait_t *w = grace_ns > 0 ? calloc(1, sizeof *w) : NULL;
    if (grace_ns > 0 && w == NULL) {
        sp_warn(JOB, "node %s lost (%s): out of memory to wait for it; its ranks are lost now", node, why);
        grace_ns = 0;
    }
    /* A communicator takes no member back: ops with NCCL fail now, naming it,
     * or, while their jobs wait for it, wait to run again on new ones. */
    if (grace_ns > 0)
        SP_TRANSPORT_CALL(eng->xdev_ops, node_held, eng, node, why);
    else
        SP_TRANSPORT_CALL(eng->xdev_ops, node_lost, eng, node, why);
    uint32_t waiting = 0;
    for (sp_job_t *job = eng->jobs; job != NULL; job = job->next) {
        uint32_t idx = sp_job_node_index(job, node, false);
        if (idx == UINT32_MAX || idx == 0)
            continue;
        if (!job->complete) {
            /* The root forgets that daemon's joins; a mirror's root is gone, and its
             * ranks' joins time out naming the ranks that never came. */
            for (uint32_t r = 0; r < job->world_size; r++)
                if (job->members[r].present && job->members[r].node == idx)
                    sp_job_join_remote_cancel(eng, job, r, node);
        } else if (grace_ns == 0) {
            job_node_lost(eng, job, idx, node, why);
        } else if (job_has_node(job, idx)) {
            sp_warn(JOB, "job %s: node %s lost (%s); waiting %" PRIu64 " ms for it to restart", job->id, node, why,
                    grace_ns / 1000000);
            waiting++;
        }
    }
    if (waiting == 0) {
        free(w);
        return;
    }
    snprintf(w->node, sizeof w->node, "%s", node);
    snprintf(w->why, sizeof w->why, "%s", why);
    w->since_ns = sp_now_ns();
    w->until_ns = w->since_ns + grace_ns;
    w->next = eng->node_waits;
    eng->node_waits = w;
}

/* Whether wait w covers the job's node idx: the job was complete when the link dropped. */
static bool wait_covers(const sp_node_wait_t *w, const sp_job_t *job, uint32_t idx)
{
    return job->complete && job->complete_ns <= w->since_ns && strcmp(job->nodes[idx], w->node) == 0;
}

uint64_t sp_job_node_waits_expire(sp_engine_t *eng, uint64_t now_ns)
{
    uint64_t next = UINT64_MAX;
    for (sp_node_wait_t **pp = &eng->node_waits; *pp != NULL;) {
        sp_node_wait_t *w = *pp;
        if (w->until_ns > now_ns) {
            next = w->until_ns < next ? w->until_ns : next;
            pp = &w->next;
            continue;
        }
        *pp = w->next;
        for (sp_job_t *job = eng->jobs; job != NULL; job = job->next) {
            uint32_t idx = sp_job_node_index(job, w->node, false);
            if (idx != UINT32_MAX && idx != 0 && wait_covers(w, job, idx))
                job_node_lost(eng, job, idx, w->node, w->why);
        }
        free(w);
    }
    for (sp_job_t *job = eng->jobs; job != NULL; job = job->next) {
        if (job->relinking == 0)
            continue;
        if (job->relink_until_ns > now_ns) {
            next = job->relink_until_ns < next ? job->relink_until_ns : next;
            continue;
        }
        const char *why = eng->cfg->peer_restart_grace_ms == 0
                          ? "peer_restart_grace_ms is 0 on this node, so its spd claims no job back after a restart"
                          : "the job was not claimed back from it within peer_restart_grace_ms of this node's spd "
                            "restarting (not every rank here came back, or no link to it came up)";
        for (uint32_t idx = 1; idx < job->nnodes && idx < 32; idx++)
            if (job->relinking & (1u << idx))
                job_node_lost(eng, job, idx, job->nodes[idx], (job->relink_sent & (1u << idx))
                              ? "it did not answer the claim to take the job back within peer_restart_grace_ms of "
                                "this node's spd restarting" : why);
        job->relinking = 0;
    }
    return next;
}

void sp_job_node_waits_defer(sp_engine_t *eng, uint64_t ns)
{
    for (sp_node_wait_t *w = eng->node_waits; w != NULL; w = w->next)
        w->until_ns += ns;
    for (sp_job_t *job = eng->jobs; job != NULL; job = job->next)
        if (job->relinking != 0)
            job->relink_until_ns += ns;
}

bool sp_job_node_waited(const sp_engine_t *eng, const sp_job_t *job, uint32_t idx)
{
    if (idx < 32 && (job->relinking & (1u << idx)))
        return true;   /* rebuilt here: that daemon has not taken the job back yet */
    for (const sp_node_wait_t *w = eng->node_waits; w != NULL; w = w->next)
        if (wait_covers(w, job, idx))
            return true;
    return false;
}

const sp_node_wait_t *sp_job_node_wait(const sp_engine_t *eng, const sp_job_t *job)
{
    const sp_node_wait_t *first = NULL;
    for (const sp_node_wait_t *w = eng->node_waits; w != NULL; w = w->next)
        for (uint32_t idx = 1; idx < job->nnodes; idx++)
            if (wait_covers(w, job, idx) && job_has_node(job, idx) && (first == NULL || w->until_ns < first->until_ns))
                first = w;
    return first;
}

/* ---------------------------------------------------------------- relinking a job over daemons */

bool sp_job_local_back(const sp_job_t *job)
{
    for (uint32_t r = 0; r < job->world_size; r++)
        if (job->members[r].node == 0 && job->members[r].client == NULL)
            return false;
    return true;
}

int sp_job_relink_make(const sp_job_t *job, sp_relink_t *rl, sp_relink_seq_t **seqs_p, char ***names_p)
{
    size_t n = 0;
    for (const sp_group_t *g = job->groups; g != NULL; g = g->next)
        n += (size_t)g->nlocal * SP_CHANNELS;
    sp_relink_seq_t *seqs = calloc(n + 1, sizeof *seqs);
    char **names = calloc(job->world_size, sizeof *names);
    if (seqs == NULL || names == NULL) {
        free(seqs);
        free(names);
        return -1;
    }
    n = 0;
    for (const sp_group_t *g = job->groups; g != NULL; g = g->next) {
        for (uint32_t gr = 0; gr < g->size; gr++) {
            if (job->members[g->ranks[gr]].node != 0)
                continue;   /* another daemon's rank: that daemon says its own */
            for (uint32_t ch = 0; ch < SP_CHANNELS; ch++)
                seqs[n++] = (sp_relink_seq_t){ .group_index = g->index, .rank = g->ranks[gr], .channel = ch,
                                               .next = g->next_seq[(size_t)ch * g->size + gr] };
        }
    }
    for (uint32_t r = 0; r < job->world_size; r++)
        names[r] = (char *)job->nodes[job->members[r].node];
    *rl = (sp_relink_t){ .job_id = job->id, .launch = job->launch, .world_size = job->world_size,
                         .owner = job->access.owner, .rank_node = names, .nrank_node = job->world_size,
                         .nonce = job->nonce, .nonce_len = sizeof job->nonce, .seqs = seqs, .nseqs = n };
    *seqs_p = seqs;
    *names_p = names;
    return 0;
}

/* Whether a relink's sequence numbers name groups of the job and ranks of
 * the claiming daemon (idx) in them, on channels there are. */
static spc_status_t relink_seqs_check(const sp_job_t *job, uint32_t idx, const sp_relink_t *rl, sp_err_t *e)
{
    for (size_t i = 0; i < rl->nseqs; i++) {
        const sp_relink_seq_t *q = &rl->seqs[i];
        const sp_group_t *g = sp_job_group_by_index(job, q->group_index);
        if (g == NULL || q->channel >= SP_CHANNELS || q->rank >= job->world_size ||
            job->members[q->rank].node != idx || group_rank_of(g, q->rank) == UINT32_MAX)
            return sp_err_set(e, SPC_ERR_MISMATCH, "job %s: the relink gives rank %u's op on channel %u of group #%u, "
                              "which is not a rank of node %s in a group of the job here", job->id, q->rank,
                              q->channel, q->group_index, job->nodes[idx]);
    }
    return SPC_OK;
}

/* The checks of a relink from `node` against the job held here (every field). */
static spc_status_t relink_check(const sp_engine_t *eng, const sp_job_t *job, const char *node, uint32_t idx,
                                 const sp_relink_t *rl, sp_err_t *e)
{
    if (!job->complete || idx == UINT32_MAX || idx == 0)
        return sp_err_set(e, SPC_ERR_PERMISSION, "job %s has no ranks on node %s", job->id, node);
    if (!sp_job_node_waited(eng, job, idx) || !job_has_node(job, idx))
        return sp_err_set(e, SPC_ERR_BUSY, "job %s does not wait for node %s (its link did not drop, or "
                          "peer_restart_grace_ms passed)", job->id, node);
    if (!job->has_nonce || rl->nonce_len != sizeof job->nonce ||
        sodium_memcmp(rl->nonce, job->nonce, sizeof job->nonce) != 0)
        return sp_err_set(e, SPC_ERR_PERMISSION, "job %s: the relink's nonce is not the job's (another launch, or a "
                          "forgery)", job->id);
    if (rl->world_size != job->world_size || rl->owner != job->access.owner || strcmp(rl->launch, job->launch) != 0 ||
        rl->nrank_node != job->world_size)
        return sp_err_set(e, SPC_ERR_MISMATCH, "job %s: the relink says %u ranks, owner uid %u, launch '%.64s'; this "
                          "daemon holds %u, uid %u, '%s'", job->id, rl->world_size, rl->owner, rl->launch,
                          job->world_size, (unsigned)job->access.owner, job->launch);
    for (uint32_t r = 0; r < job->world_size; r++)
        if (strcmp(rl->rank_node[r], job->nodes[job->members[r].node]) != 0)
            return sp_err_set(e, SPC_ERR_MISMATCH, "job %s: the relink places rank %u on node %.64s; it ran on %s",
                              job->id, r, rl->rank_node[r], job->nodes[job->members[r].node]);
    return relink_seqs_check(job, idx, rl, e);
}

spc_status_t sp_job_relink_accept(sp_engine_t *eng, const char *node, const sp_relink_t *rl, sp_job_t **job_p,
                                  sp_err_t *e)
{
    sp_job_t *job = sp_job_find(eng, rl->job_id);
    if (job == NULL)
        return sp_err_set(e, SPC_ERR_NOT_FOUND, "no job '%.128s' here", rl->job_id);
    uint32_t idx = sp_job_node_index(job, node, false);
    SP_CHECK(relink_check(eng, job, node, idx, rl, e));
    /* Whole again from now: the wait, from before, covers it no more. */
    job->complete_ns = sp_now_ns();
    SP_TRANSPORT_CALL(eng->xdev_ops, job_node_back, eng, job->id, node);
    sp_info(JOB, "job %s: node %s restarted and took its ranks back", job->id, node);
    *job_p = job;
    return SPC_OK;
}

void sp_job_relinked(sp_engine_t *eng, sp_job_t *job, const char *node, spc_status_t st, const char *why)
{
    uint32_t idx = sp_job_node_index(job, node, false);
    if (idx == UINT32_MAX || idx >= 32 || !(job->relinking & (1u << idx)))
        return;
    job->relinking &= ~(1u << idx);
    if (st == SPC_OK) {
        SP_TRANSPORT_CALL(eng->xdev_ops, job_node_back, eng, job->id, node);
        sp_info(JOB, "job %s: node %s took the job back", job->id, node);
        return;
    }
    char detail[SP_DETAIL_BYTES];
    snprintf(detail, sizeof detail, "did not take the job back after this node's spd restarted: %s", why);
    job_node_lost(eng, job, idx, node, detail);
}

sp_group_t *sp_job_group_by_index(const sp_job_t *job, uint32_t index)
{
    for (sp_group_t *g = job->groups; g != NULL; g = g->next)
        if (g->index == index)
            return g;
    return NULL;
}

void sp_job_creator_gone(sp_engine_t *eng, uint64_t client_id)
{
    sp_job_t *next;
    for (sp_job_t *job = eng->jobs; job != NULL; job = next) {
        next = job->next;
        if (job->creator_id == client_id) {
            job->creator_id = 0;
            job_maybe_free(eng, job);
        }
    }
}

void sp_jobs_cleanup(sp_engine_t *eng)
{
    while (eng->node_waits != NULL) {
        sp_node_wait_t *w = eng->node_waits;
        eng->node_waits = w->next;
        free(w);
    }
    while (eng->jobs != NULL)
        job_free(eng, eng->jobs);
}

void sp_job_fail_all(sp_engine_t *eng, spc_status_t st, const char *detail)
{
    for (sp_job_t *job = eng->jobs; job != NULL; job = job->next)
        for (sp_group_t *g = job->groups; g != NULL; g = g->next)
            sp_group_break(eng, g, st, detail);
}
