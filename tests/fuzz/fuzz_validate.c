/*
 * fuzz_validate.c — fuzz harness: what a client writes into its submission ring.
 *
 * The input (fuzz_validate.h) is a group size and two ops, each an SQ entry and
 * its argument slot as a client may write them, bytes unchecked. A fake client
 * owns an arena and a few regions, host and GPU (records only: no segment, no
 * import, no GPU). For each op, as the daemon does, the harness:
 *   1. copies the entry and its slot with sp_op_copy_in (engine.c's sq_consume);
 *   2. refuses it where sp_op_dispatch would before validation (too many tensors,
 *      a channel out of range, an opcode that takes no group);
 *   3. runs sp_op_validate; an op it accepts must name, for every tensor, bytes
 *      of one kind of memory that its client owns (sp_mem_check of the extent
 *      validation recorded), on one GPU if they are on a GPU; and for an
 *      all-to-all, every slice that net.c would send of an input must lie
 *      inside that input, and all of them together be no more than it;
 *   4. compares the group's ops with sp_coll_agree: rank 0 submitted A, every
 *      other rank B, the ranks on one daemon or alternating between two. Ops of other daemons reach it having passed only the
 *      tensor count (net.c), so it is fed any ops with at most SP_MAX_TENSORS
 *      tensors; an op never disagrees with a copy of itself.
 * Built with libFuzzer (SP_FUZZ=ON) it is fuzzed; otherwise tests/fuzz/replay.c
 * gives it a main() and ctest runs it over tests/fuzz/corpus/validate.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/client.h"
#include "core/job.h"
#include "core/mem.h"
#include "core/ops.h"
#include "core/validate.h"

#include "fuzz.h"
#include "fuzz_validate.h"

/* All-to-all slices are enumerated for inputs up to this size: the walk visits
 * every row for every rank. */
#define RANGES_MAX_BYTES (16u << 10)

/* FUZZ_VERBOSE=1 in the environment: say what became of each input (for
 * writing seeds; the fuzzer runs quiet). */
static bool verbose;

static sp_client_t client;
static sp_region_t regions[FV_NREGIONS];

static void client_init(void)
{
    if (client.regions != NULL)
        return;
    for (size_t i = 0; i < FV_NREGIONS; i++) {
        regions[i] = (sp_region_t){ .id = fv_regions[i].id, .kind = fv_regions[i].kind, .gpu = fv_regions[i].gpu,
                                    .addr = (uint64_t)(i + 1) << 44, .length = fv_regions[i].length };
    }
    verbose = getenv("FUZZ_VERBOSE") != NULL;
    client.id = 1;
    client.layout.arena_bytes = FV_ARENA_BYTES;
    client.regions = regions;
    client.nregions = client.regions_cap = FV_NREGIONS;
}

typedef struct ranges {
    uint64_t need, total;
} ranges_t;

static void range_seen(void *arg, uint64_t off, uint64_t len)
{
    ranges_t *r = arg;
    FUZZ_CHECK(len > 0 && off < r->need && len <= r->need - off, "slice of %llu bytes at %llu of a %llu-byte input",
               (unsigned long long)len, (unsigned long long)off, (unsigned long long)r->need);
    r->total += len;
}

/* Step 3's properties of an op that passed validation. */
static void check_accepted(const sp_op_t *op, uint32_t P)
{
    const struct sp_sqe *e = &op->sqe;
    sp_err_t err = SP_ERR_INIT;

    for (unsigned i = 0; i < e->ntensors; i++) {
        const struct sp_tensor_ref *t = &op->tensor[i];
        FUZZ_CHECK(sp_mem_check(op->client, t, op->need[i], &err) == SPC_OK, "tensor %u: %s", i, err.msg);
        const sp_region_t *r = sp_mem_device(op->client, t);
        if (op->device)
            FUZZ_CHECK(r != NULL && r->gpu == op->gpu, "tensor %u of a GPU %d op is not there", i, op->gpu);
        else
            FUZZ_CHECK(r == NULL, "tensor %u of a host op is in GPU memory", i);
    }
    if (e->opcode != SP_OP_ALLTOALL)
        return;
    const struct sp_a2a_params *a = &op->params.a2a;
    bool all[FV_MAX_RANKS], one[FV_MAX_RANKS];
    for (uint32_t q = 0; q < P; q++) {
        all[q] = true;
        one[q] = q == P - 1;
    }
    for (uint32_t i = 0; i < a->ntensors; i++) {
        if (op->need[2 * i] > RANGES_MAX_BYTES)
            continue;
        uint32_t ranks[2] = { 0, P - 1 };
        for (int k = 0; k < 2; k++) {
            ranges_t r = { .need = op->need[2 * i] };
            sp_a2a_ranges(a, (uint32_t)sp_dtype_size(e->dtype), P, i, ranks[k], all, range_seen, &r);
            FUZZ_CHECK(r.total <= r.need, "tensor %u rank %u: slices of %llu bytes of a %llu-byte input", i, ranks[k],
                       (unsigned long long)r.total, (unsigned long long)r.need);
            r.total = 0;
            sp_a2a_ranges(a, (uint32_t)sp_dtype_size(e->dtype), P, i, ranks[k], one, range_seen, &r);
            FUZZ_CHECK(r.total <= r.need, "tensor %u rank %u (one reader): %llu bytes of %llu", i, ranks[k],
                       (unsigned long long)r.total, (unsigned long long)r.need);
        }
    }
}

/* Steps 1 to 3 for one op; false when sp_op_dispatch would refuse it first. */
static bool load_and_validate(sp_op_t *op, const uint8_t *bytes, uint32_t P)
{
    struct sp_sqe sqe;
    struct sp_sq_args args;

    memcpy(&sqe, bytes, sizeof sqe);
    memcpy(&args, bytes + sizeof sqe, sizeof args);
    struct sp_sq_slot slot = sp_sq_slot_of(&args);
    sp_op_copy_in(op, &sqe, &slot);
    op->client = &client;
    if (op->sqe.ntensors > SP_MAX_TENSORS)
        return false;
    if (op->sqe.channel >= SP_CHANNELS || op->sqe.opcode == SP_OP_NOOP || op->sqe.opcode > SP_OP_ALLTOALLV)
        return true;   /* refused or completed by dispatch, but a peer daemon's op could still say this */
    sp_op_validate(op, P);
    if (verbose)
        fprintf(stderr, "  %s over %u ranks: %s%s%s\n", sp_op_name(op->sqe.opcode), P,
                spc_status_name(op->local.status), op->local.status != SPC_OK ? ": " : "", op->local.msg);
    if (op->local.status == SPC_OK)
        check_accepted(op, P);
    else
        FUZZ_CHECK(op->local.msg[0] != '\0' && memchr(op->local.msg, '\0', sizeof op->local.msg) != NULL,
                   "refused (%d) without a reason", (int)op->local.status);
    return true;
}

static bool same_op(const sp_op_t *a, const sp_op_t *b)
{
    return memcmp(&a->sqe, &b->sqe, sizeof a->sqe) == 0 && memcmp(a->tensor, b->tensor, sizeof a->tensor) == 0 &&
           memcmp(&a->params, &b->params, sizeof a->params) == 0 && a->device == b->device && a->gpu == b->gpu;
}

/* Whether the same op on every rank of P pairs up. Most kinds compare ranks'
 * parameters for equality, so the same op always does; an uneven all-to-all
 * pairs rank i's send to j with j's receive from i, which the same op on every
 * rank meets only when all its counts are one number. */
static bool same_op_pairs(const sp_op_t *a, uint32_t P)
{
    if (a->sqe.opcode != SP_OP_ALLTOALLV)
        return true;
    for (uint32_t k = 1; k < 2 * P; k++)
        if (a->params.a2av.counts[k] != a->params.a2av.counts[0])
            return false;
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static uint8_t in[FV_INPUT_BYTES];

    client_init();
    memset(in, 0, sizeof in);
    memcpy(in, data, size < sizeof in ? size : sizeof in);
    if (size <= FV_HDR_BYTES + FV_OP_BYTES)   /* no op B: every rank submitted A */
        memcpy(in + FV_HDR_BYTES + FV_OP_BYTES, in + FV_HDR_BYTES, FV_OP_BYTES);
    uint32_t P = (uint32_t)(in[0] % FV_MAX_RANKS) + 1;

    sp_op_t *a = calloc(1, sizeof *a), *b = calloc(1, sizeof *b);
    FUZZ_CHECK(a != NULL && b != NULL, "out of memory");
    bool a_in = load_and_validate(a, in + FV_HDR_BYTES, P);
    bool b_in = load_and_validate(b, in + FV_HDR_BYTES + FV_OP_BYTES, P);

    if (a_in && b_in) {
        /* The job: a world of 2P + 1 ranks, or of P when the group is the world. */
        sp_member_t members[2 * FV_MAX_RANKS + 1];
        sp_job_t job = { .id = "fuzz-node:0", .members = members };
        uint32_t job_ranks[FV_MAX_RANKS];
        sp_group_t g = { .id = 7, .size = P, .kind = "ring", .job = &job, .ranks = job_ranks };
        sp_op_t *ops[FV_MAX_RANKS];
        sp_err_t e = SP_ERR_INIT;
        bool world = in[1] & FV_F_WORLD;

        job.world_size = world ? P : 2 * P + 1;
        job.world = world ? &g : NULL;
        for (uint32_t k = 0; k < job.world_size; k++)
            members[k] = (sp_member_t){ .node = (in[1] & FV_F_NODES) ? k % 2 : 0, .present = true };
        for (uint32_t r = 0; r < P; r++) {
            job_ranks[r] = world ? r : 2 * r + 1;
            ops[r] = r == 0 ? a : b;
        }
        bool agree = sp_coll_agree(&g, ops, &e);
        if (verbose)
            fprintf(stderr, "  agree: %s%s\n", agree ? "yes" : "no: ", e.msg);
        FUZZ_CHECK(memchr(e.msg, '\0', sizeof e.msg) != NULL, "detail not terminated");
        FUZZ_CHECK(agree == (e.status == SPC_OK) && agree == (e.msg[0] == '\0'), "agree %d with %s '%s'", agree,
                   spc_status_name(e.status), e.msg);
        /* Only an op kind that exists is agreed on: sp_op_dispatch refuses the rest first. */
        if ((P == 1 || same_op(a, b)) && sp_op_kind(a->sqe.opcode) != NULL && same_op_pairs(a, P))
            FUZZ_CHECK(agree, "ranks with the same op disagree: %s", e.msg);
    }
    free(a);
    free(b);
    return 0;
}
