/*
 * mesh.c — a job's ranks arranged as dp x ring x ulysses.
 *
 * Which ranks share a group is the placement's call (common/sp_place.h): it
 * sorts the ranks by where they run, so that Ulysses groups sit on the ranks
 * joined by the fastest links, rings cross them and dp is outermost, and it
 * chooses the degrees left to it. On one node, ranks that announced their GPU
 * when they joined (JobJoinReq.pci_bus_id) are placed by the links between
 * their GPUs in this node's topology; ranks it cannot tell apart (host ranks,
 * ranks on one GPU, GPUs the topology lacks) keep rank order:
 * rank = dp_rank * sp + ring_rank * ulysses + ulysses_rank, as spclient.h
 * documents.
 *
 * Mesh creation is a control call that every rank makes. Rank r's k-th call
 * names mesh k of the job: the first rank to get there creates it (groups and
 * all), the others find it and must have asked for the same thing. Nobody waits:
 * the groups are fixed by the spec, and an op on a group waits for its ranks anyway.
 */
#include "core/client.h"
#include "core/engine.h"
#include "core/job.h"
#include "core/mesh.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"


/* Places the job's ranks on a mesh of this spec. */
static int name_cmp(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/*
 * Where the job's ranks run, for the placement. On one daemon: this node
 * (eng->topo), on the GPU each rank announced where the topology has it.
 * Across daemons: the job's nodes by name,
 * with nothing known inside them, the same table on every daemon (each builds
 * its groups by itself, and they must come out alike); Ulysses groups then
 * stay inside nodes and rings cross them whatever the rank numbering.
 */
static spc_status_t mesh_place(const sp_engine_t *eng, const sp_job_t *job, const sp_mesh_spec_t *spec,
                               sp_place_t **place_p, sp_err_t *e)
{
    sp_place_loc_t *locs = malloc((size_t)job->world_size * sizeof *locs);
    const char **names = calloc(job->nnodes, sizeof *names);
    sp_topo_t *jt = NULL;
    spc_status_t st;
    if (locs == NULL || names == NULL) {
        st = sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory placing %u ranks", job->world_size);
        goto out;
    }
    for (uint32_t r = 0; r < job->world_size; r++)
        locs[r] = (sp_place_loc_t){ .node = 0, .gpu = -1, .numa = -1 };
    if (job->nnodes < 2) {
        /* Node 0 of eng->topo is this node. */
        for (uint32_t r = 0; r < job->world_size && eng->topo != NULL; r++) {
            const sp_topo_gpu_t *g = sp_topo_find_gpu_bus(&eng->topo->nodes[0], job->members[r].gpu_bus);
            locs[r].gpu = g != NULL ? g->index : -1;
        }
        st = sp_err_from(e, sp_place_compute(eng->topo, locs, job->world_size, spec, place_p, SP_ERR_BUF(e)));
        goto out;
    }
    for (uint32_t k = 0; k < job->nnodes; k++)
        names[k] = job->nodes[k];
    qsort(names, job->nnodes, sizeof *names, name_cmp);
    if ((st = sp_topo_create(&jt)) != SPC_OK) {
        sp_err_set(e, st, "out of memory placing %u ranks", job->world_size);
        goto out;
    }
    for (uint32_t k = 0; k < job->nnodes; k++) {
        sp_topo_node_t *n;
        SP_CHECK_GOTO(sp_err_from(e, sp_topo_add_node(jt, names[k], &n, SP_ERR_BUF(e))), st, out);
    }
    for (uint32_t r = 0; r < job->world_size; r++) {
        const char *mine = job->nodes[job->members[r].node];
        const char **at = bsearch(&mine, names, job->nnodes, sizeof *names, name_cmp);
        locs[r].node = (uint32_t)(at - names);
    }
    st = sp_err_from(e, sp_place_compute(jt, locs, job->world_size, spec, place_p, SP_ERR_BUF(e)));
out:
    sp_topo_free(jt);
    free(names);
    free(locs);
    return st;
}

void sp_mesh_free(sp_mesh_t *m)
{
    if (m == NULL)
        return;
    free(m->dp_groups);
    free(m->sp_groups);
    free(m->ulysses_groups);
    free(m->ring_groups);
    free(m->slot);
    free(m);
}

/* Builds the groups of a new mesh from its placement. Group creation links each
 * group into the job, so on failure the ones made so far are simply left to the job. */
static sp_mesh_t *mesh_build(sp_engine_t *eng, sp_job_t *job, const sp_place_t *pl)
{
    static const char *const kind_name[SP_PLACE_KINDS] = { "dp", "sp", "ulysses", "ring" };
    uint32_t world = job->world_size;
    sp_mesh_t *m = calloc(1, sizeof *m);
    uint32_t *ranks = malloc((size_t)world * sizeof *ranks);
    if (m == NULL || ranks == NULL)
        goto fail;
    m->id = job->nmeshes;
    m->sp = pl->sp;
    m->ulysses = pl->ulysses;
    m->ring = pl->ring;
    m->dp = pl->dp;
    m->heads = pl->heads;
    m->kv_heads = pl->kv_heads;
    snprintf(m->explain, sizeof m->explain, "%s", pl->explain);
    m->dp_groups = calloc(sp_place_ngroups(pl, SP_PLACE_DP), sizeof *m->dp_groups);
    m->sp_groups = calloc(sp_place_ngroups(pl, SP_PLACE_SP), sizeof *m->sp_groups);
    m->ulysses_groups = calloc(sp_place_ngroups(pl, SP_PLACE_ULYSSES), sizeof *m->ulysses_groups);
    m->ring_groups = calloc(sp_place_ngroups(pl, SP_PLACE_RING), sizeof *m->ring_groups);
    m->slot = malloc((size_t)world * sizeof *m->slot);
    if (!m->dp_groups || !m->sp_groups || !m->ulysses_groups || !m->ring_groups || !m->slot)
        goto fail;
    memcpy(m->slot, pl->slot, (size_t)world * sizeof *m->slot);

    sp_group_t **kinds[SP_PLACE_KINDS] = { m->dp_groups, m->sp_groups, m->ulysses_groups, m->ring_groups };
    for (int k = 0; k < SP_PLACE_KINDS; k++) {
        for (uint32_t i = 0; i < sp_place_ngroups(pl, k); i++) {
            uint32_t n = sp_place_group(pl, k, i, ranks);
            if ((kinds[k][i] = sp_group_create(eng, job, kind_name[k], ranks, n)) == NULL)
                goto fail;
        }
    }
    free(ranks);
    return m;

fail:
    free(ranks);
    sp_mesh_free(m);
    return NULL;
}

void sp_mesh_coords(const sp_mesh_t *m, uint32_t rank, uint32_t *dp_rank, uint32_t *sp_rank,
                    uint32_t *ulysses_rank, uint32_t *ring_rank, sp_group_t **dp, sp_group_t **sp,
                    sp_group_t **ulysses, sp_group_t **ring)
{
    uint32_t i = m->slot[rank], d = i / m->sp, s = i % m->sp, k = s / m->ulysses, j = s % m->ulysses;
    *dp_rank = d;
    *sp_rank = s;
    *ring_rank = k;
    *ulysses_rank = j;
    *dp = m->dp_groups[s];
    *sp = m->sp_groups[d];
    *ulysses = m->ulysses_groups[d * m->ring + k];
    *ring = m->ring_groups[d * m->ulysses + j];
}

spc_status_t sp_mesh_create(sp_engine_t *eng, sp_client_t *c, const sp_mesh_spec_t *spec, sp_mesh_t **mesh_p,
                            sp_err_t *e)
{
    sp_job_t *job = c->job;
    sp_place_t *pl;

    if (job == NULL || !job->complete)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "mesh create: this client is in no complete job (join one first)");
    spc_status_t st = mesh_place(eng, job, spec, &pl, e);
    if (st != SPC_OK)
        return sp_err_prefix(e, "%s", st == SPC_ERR_NO_MEMORY ? "" : "mesh refused: ");
    sp_member_t *me = &job->members[c->rank];
    sp_mesh_t *m = job->meshes;
    for (uint32_t k = 0; m != NULL && k < me->meshes_seen; k++)
        m = m->next;
    if (m == NULL) {
        if (job->nmeshes >= SP_MAX_MESHES) {
            st = sp_err_set(e, SPC_ERR_LIMIT, "job %s already has %u meshes", job->id, job->nmeshes);
            goto out;
        }
        m = mesh_build(eng, job, pl);
        if (m == NULL) {
            st = sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory building a mesh");
            goto out;
        }
        sp_mesh_t **pp = &job->meshes;
        while (*pp != NULL)
            pp = &(*pp)->next;
        *pp = m;
        job->nmeshes++;
        sp_info(JOB, "job %s mesh %u: %s", job->id, m->id, m->explain);
    } else {
        /* Compare the resolved degrees: two specs that resolve alike (auto on one
         * rank, the same degrees spelled out on another) describe the same mesh. */
        if (m->sp != pl->sp || m->ulysses != pl->ulysses || m->ring != pl->ring || m->heads != pl->heads ||
            m->kv_heads != pl->kv_heads) {
            st = sp_err_set(e, SPC_ERR_MISMATCH, "mesh %u: rank %u asked for sp %u ulysses %u ring %u heads %u "
                            "kv_heads %u; the mesh has sp %u ulysses %u ring %u heads %u kv_heads %u", m->id, c->rank,
                            pl->sp, pl->ulysses, pl->ring, pl->heads, pl->kv_heads, m->sp, m->ulysses, m->ring,
                            m->heads, m->kv_heads);
            goto out;
        }
    }
    me->meshes_seen++;
    *mesh_p = m;
out:
    sp_place_free(pl);
    return st;
}
