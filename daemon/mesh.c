/*
 * mesh.c — a job's ranks arranged as dp x ring x ulysses.
 *
 * Layout on one node: rank = dp_rank * sp + ring_rank * ulysses + ulysses_rank.
 * Ulysses innermost keeps each all-to-all group on consecutive ranks (the ranks a
 * launcher puts closest together); rings cross the Ulysses groups; dp is outermost.
 *
 * Mesh creation is a control call that every rank makes. Rank r's k-th call
 * names mesh k of the job: the first rank to get there creates it (groups and
 * all), the others find it and must have asked for the same thing. Nobody waits:
 * the groups are fixed by the spec, and an op on a group waits for its ranks anyway.
 */
#include "engine.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"

#define SP_MAX_MESHES 64   /* per job: meshes are made once per model, not per step */

/* Whether u can hold the heads without dummies or uneven KV replication. */
static bool ulysses_fits(uint32_t u, uint32_t heads, uint32_t kv)
{
    return heads % u == 0 && (kv % u == 0 || u % kv == 0);
}

spc_status_t sp_mesh_plan(const sp_mesh_spec_t *spec, uint32_t world, sp_mesh_spec_t *out, char *explain,
                          size_t len)
{
    uint32_t sp = spec->sp, u = spec->ulysses, ring = spec->ring;
    uint32_t heads = spec->heads, kv = spec->kv_heads ? spec->kv_heads : spec->heads;

    if (sp == 0 || world % sp != 0) {
        snprintf(explain, len, "sp %u does not divide the world of %u ranks", sp, world);
        return SPC_ERR_INVALID_ARG;
    }
    if (heads == 0) {
        snprintf(explain, len, "heads must be positive");
        return SPC_ERR_INVALID_ARG;
    }
    if (heads % kv != 0) {
        snprintf(explain, len, "%u kv_heads do not divide %u heads", kv, heads);
        return SPC_ERR_INVALID_ARG;
    }
    if ((u != 0 && sp % u != 0) || (ring != 0 && sp % ring != 0)) {
        snprintf(explain, len, "ulysses %u and ring %u must divide sp %u", u, ring, sp);
        return SPC_ERR_INVALID_ARG;
    }
    const char *why;
    if (u == 0 && ring == 0) {
        u = 1;
        for (uint32_t d = sp; d >= 1; d--) {
            if (sp % d == 0 && ulysses_fits(d, heads, kv)) {
                u = d;
                break;
            }
        }
        ring = sp / u;
        why = "the largest divisor of sp that divides the heads without dummies and fits the kv heads";
    } else if (u == 0) {
        u = sp / ring;
        why = "sp / ring";
    } else if (ring == 0) {
        ring = sp / u;
        why = "as asked";
    } else {
        why = "as asked";
    }
    if (u * ring != sp) {
        snprintf(explain, len, "ulysses %u x ring %u is not sp %u", u, ring, sp);
        return SPC_ERR_INVALID_ARG;
    }
    if (kv < u && u % kv != 0) {
        snprintf(explain, len, "ulysses %u cannot replicate %u kv heads evenly (use a ulysses degree that %u divides "
                 "or that divides %u)", u, kv, kv, kv);
        return SPC_ERR_INVALID_ARG;
    }
    if (u > heads) {
        snprintf(explain, len, "ulysses %u exceeds the %u heads: some ranks would hold only dummy heads", u, heads);
        return SPC_ERR_INVALID_ARG;
    }
    *out = (sp_mesh_spec_t){ .sp = sp, .ulysses = u, .ring = ring, .heads = heads, .kv_heads = kv };

    size_t off = (size_t)snprintf(explain, len, "dp %u x sp %u (ulysses %u x ring %u); ulysses %u: %s", world / sp,
                                  sp, u, ring, u, why);
    if (off < len && heads % u != 0) {
        uint32_t padded = (heads + u - 1) / u * u;
        off += (size_t)snprintf(explain + off, len - off, "; %u dummy heads pad %u to %u (+%u%% all-to-all bytes)",
                                padded - heads, heads, padded, (padded - heads) * 100 / heads);
    }
    if (off < len && kv < u)
        snprintf(explain + off, len - off, "; kv heads replicated %u times", u / kv);
    return SPC_OK;
}

void sp_mesh_free(sp_mesh_t *m)
{
    if (m == NULL)
        return;
    free(m->dp_groups);
    free(m->sp_groups);
    free(m->ulysses_groups);
    free(m->ring_groups);
    free(m);
}

/* Builds the groups of a new mesh. Group creation links each group into the job,
 * so on failure the ones made so far are simply left to the job. */
static sp_mesh_t *mesh_build(sp_engine_t *eng, sp_job_t *job, const sp_mesh_spec_t *d, const char *explain)
{
    uint32_t world = job->world_size, sp = d->sp, u = d->ulysses, ring = d->ring, dp = world / sp;
    sp_mesh_t *m = calloc(1, sizeof *m);
    uint32_t *ranks = malloc((size_t)world * sizeof *ranks);
    if (m == NULL || ranks == NULL)
        goto fail;
    m->id = job->nmeshes;
    m->sp = sp;
    m->ulysses = u;
    m->ring = ring;
    m->dp = dp;
    m->heads = d->heads;
    m->kv_heads = d->kv_heads;
    snprintf(m->explain, sizeof m->explain, "%s", explain);
    m->dp_groups = calloc(sp, sizeof *m->dp_groups);
    m->sp_groups = calloc(dp, sizeof *m->sp_groups);
    m->ulysses_groups = calloc((size_t)dp * ring, sizeof *m->ulysses_groups);
    m->ring_groups = calloc((size_t)dp * u, sizeof *m->ring_groups);
    if (!m->dp_groups || !m->sp_groups || !m->ulysses_groups || !m->ring_groups)
        goto fail;

    for (uint32_t s = 0; s < sp; s++) {
        for (uint32_t i = 0; i < dp; i++)
            ranks[i] = i * sp + s;
        if ((m->dp_groups[s] = sp_group_create(eng, job, "dp", ranks, dp)) == NULL)
            goto fail;
    }
    for (uint32_t i = 0; i < dp; i++) {
        for (uint32_t s = 0; s < sp; s++)
            ranks[s] = i * sp + s;
        if ((m->sp_groups[i] = sp_group_create(eng, job, "sp", ranks, sp)) == NULL)
            goto fail;
        for (uint32_t k = 0; k < ring; k++) {
            for (uint32_t j = 0; j < u; j++)
                ranks[j] = i * sp + k * u + j;
            if ((m->ulysses_groups[i * ring + k] = sp_group_create(eng, job, "ulysses", ranks, u)) == NULL)
                goto fail;
        }
        for (uint32_t j = 0; j < u; j++) {
            for (uint32_t k = 0; k < ring; k++)
                ranks[k] = i * sp + k * u + j;
            if ((m->ring_groups[i * u + j] = sp_group_create(eng, job, "ring", ranks, ring)) == NULL)
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
    uint32_t d = rank / m->sp, s = rank % m->sp, k = s / m->ulysses, j = s % m->ulysses;
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
                            char *err, size_t errlen)
{
    sp_job_t *job = c->job;
    char explain[256];
    sp_mesh_spec_t d;

    if (job == NULL || !job->complete) {
        snprintf(err, errlen, "mesh create: this client is in no complete job (join one first)");
        return SPC_ERR_INVALID_ARG;
    }
    spc_status_t st = sp_mesh_plan(spec, job->world_size, &d, explain, sizeof explain);
    if (st != SPC_OK) {
        snprintf(err, errlen, "mesh refused: %s", explain);
        return st;
    }
    sp_member_t *me = &job->members[c->rank];
    sp_mesh_t *m = job->meshes;
    for (uint32_t k = 0; m != NULL && k < me->meshes_seen; k++)
        m = m->next;
    if (m == NULL) {
        if (job->nmeshes >= SP_MAX_MESHES) {
            snprintf(err, errlen, "job %s already has %u meshes", job->id, job->nmeshes);
            return SPC_ERR_LIMIT;
        }
        m = mesh_build(eng, job, &d, explain);
        if (m == NULL) {
            snprintf(err, errlen, "out of memory building a mesh");
            return SPC_ERR_NO_MEMORY;
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
        if (m->sp != d.sp || m->ulysses != d.ulysses || m->ring != d.ring || m->heads != d.heads ||
            m->kv_heads != d.kv_heads) {
            snprintf(err, errlen, "mesh %u: rank %u asked for sp %u ulysses %u ring %u heads %u kv_heads %u; the "
                     "mesh has sp %u ulysses %u ring %u heads %u kv_heads %u", m->id, c->rank, d.sp, d.ulysses,
                     d.ring, d.heads, d.kv_heads, m->sp, m->ulysses, m->ring, m->heads, m->kv_heads);
            return SPC_ERR_MISMATCH;
        }
    }
    me->meshes_seen++;
    *mesh_p = m;
    return SPC_OK;
}
