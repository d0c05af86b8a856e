/*
 * exec.c — running a collective whose ranks have all arrived and agree.
 *
 * Host memory on one node: the daemon reads each rank's buffer in place (arena)
 * or by cross-memory attach (registered), and writes the results the same way.
 */
#include "engine.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "sp_kern.h"

_Static_assert((int)SP_DTYPE_F32 == (int)SP_KERN_F32 && (int)SP_DTYPE_F64 == (int)SP_KERN_F64 && (int)SP_DTYPE_F16 == (int)SP_KERN_F16 &&
               (int)SP_DTYPE_BF16 == (int)SP_KERN_BF16 && (int)SP_DTYPE_I32 == (int)SP_KERN_I32 && (int)SP_DTYPE_I64 == (int)SP_KERN_I64 &&
               (int)SP_DTYPE_U8 == (int)SP_KERN_U8, "wire and kernel dtypes agree");
_Static_assert((int)SP_REDOP_SUM == (int)SP_KERN_SUM && (int)SP_REDOP_MAX == (int)SP_KERN_MAX && (int)SP_REDOP_MIN == (int)SP_KERN_MIN,
               "wire and kernel reduction operators agree");

/* Daemon scratch of at least `bytes` (progress thread only). */
static void *scratch(sp_engine_t *eng, size_t bytes)
{
    if (eng->scratch_bytes < bytes) {
        void *p = realloc(eng->scratch, bytes);
        if (p == NULL)
            return NULL;
        eng->scratch = p;
        eng->scratch_bytes = bytes;
    }
    return eng->scratch;
}

void sp_exec_barrier(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll)
{
    for (uint32_t r = 0; r < g->size; r++) {
        sp_op_complete(eng, coll->ops[r], SPC_OK, NULL);
        coll->ops[r] = NULL;
    }
}

/* Fails the whole collective because rank `bad` could not be read: that rank gets
 * its own status, the others learn which rank and why. */
static void fail_all(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll, uint32_t bad, spc_status_t st,
                     const char *why)
{
    char peer[SP_DETAIL_BYTES];
    snprintf(peer, sizeof peer, "rank %u: %s", bad, why);
    for (uint32_t r = 0; r < g->size; r++) {
        sp_op_complete(eng, coll->ops[r], r == bad ? st : SPC_ERR_PEER_REFUSED, r == bad ? why : peer);
        coll->ops[r] = NULL;
    }
}

/*
 * Reduction in rank order: acc = x0; acc = acc (op) x1; ... Every rank then gets
 * acc, so all ranks hold the same bits, and a rerun gives them again. All reads
 * finish before the first write, so send may alias receive on any rank.
 */
void sp_exec_allreduce(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll)
{
    const struct sp_sqe *e = &coll->ops[0]->sqe;
    const uint64_t bytes = e->count * sp_dtype_size(e->dtype);
    char detail[SP_DETAIL_BYTES];

    uint8_t *acc = scratch(eng, 2 * bytes);   /* [acc | staging for registered sends] */
    if (acc == NULL) {
        snprintf(detail, sizeof detail, "daemon out of memory for a %" PRIu64 "-byte reduction", bytes);
        for (uint32_t r = 0; r < g->size; r++) {
            sp_op_complete(eng, coll->ops[r], SPC_ERR_NO_MEMORY, detail);
            coll->ops[r] = NULL;
        }
        return;
    }
    uint8_t *staging = acc + bytes;

    for (uint32_t r = 0; r < g->size; r++) {
        sp_op_t *op = coll->ops[r];
        const void *src = sp_mem_direct(op->client, &op->tensor[0]);
        if (src == NULL) {
            spc_status_t st = sp_mem_read(op->client, &op->tensor[0], r == 0 ? acc : staging, bytes,
                                          detail, sizeof detail);
            if (st != SPC_OK) {
                fail_all(eng, g, coll, r, st, detail);
                return;
            }
            src = r == 0 ? acc : staging;
        }
        if (r == 0) {
            if (src != acc)
                memcpy(acc, src, bytes);
        } else {
            sp_kern_reduce(acc, src, e->count, e->dtype, e->redop);
        }
    }

    for (uint32_t r = 0; r < g->size; r++) {
        sp_op_t *op = coll->ops[r];
        spc_status_t st = sp_mem_write(op->client, &op->tensor[1], acc, bytes, detail, sizeof detail);
        coll->ops[r] = NULL;
        sp_op_complete(eng, op, st, st == SPC_OK ? NULL : detail);
    }
}
