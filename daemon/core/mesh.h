/*
 * mesh.h — a job's meshes (mesh.c): its world cut into dp, sp, ulysses and
 * ring groups.
 */
#ifndef SP_CORE_MESH_H
#define SP_CORE_MESH_H

#include <stdint.h>

#include "sp_place.h"
#include "spclient/status.h"
#include "base/err.h"

typedef struct sp_engine sp_engine_t;
typedef struct sp_client sp_client_t;
typedef struct sp_group sp_group_t;
typedef struct sp_mesh sp_mesh_t;

#define SP_MAX_MESHES 64   /* per job: meshes are made once per model, not per step */
#define SP_MESH_KINDS 4    /* dp, sp, ulysses, ring: the groups of a rank in a mesh */

/* A mesh: world = dp x ring x ulysses, ulysses innermost, its ranks placed by
 * sp_place_compute (common/sp_place.h). */
struct sp_mesh {
    sp_mesh_t    *next;           /* job->meshes, in creation order */
    uint32_t      id;             /* index in the job */
    uint32_t      sp, ulysses, ring, dp, heads, kv_heads;
    char          explain[256];
    sp_group_t  **dp_groups;      /* [sp] by sp rank */
    sp_group_t  **sp_groups;      /* [dp] */
    sp_group_t  **ulysses_groups; /* [dp * ring] */
    sp_group_t  **ring_groups;    /* [dp * ulysses] */
    uint32_t     *slot;           /* [world]: each job rank's slot, dp_rank * sp + ring_rank * ulysses + ulysses_rank */
};

typedef sp_place_spec_t sp_mesh_spec_t;

/* Creates the job's next mesh for this rank, or finds the one an earlier rank
 * created and checks that the spec agrees. */
spc_status_t sp_mesh_create(sp_engine_t *eng, sp_client_t *c, const sp_mesh_spec_t *spec, sp_mesh_t **mesh_p,
                            sp_err_t *e);
/* This rank's coordinates and groups in a mesh. */
void sp_mesh_coords(const sp_mesh_t *m, uint32_t rank, uint32_t *dp_rank, uint32_t *sp_rank,
                    uint32_t *ulysses_rank, uint32_t *ring_rank, sp_group_t **dp, sp_group_t **sp,
                    sp_group_t **ulysses, sp_group_t **ring);
void sp_mesh_free(sp_mesh_t *m);

#endif /* SP_CORE_MESH_H */
