/*
 * validate.h — the checks an op passes (validate.c): each rank's request alone,
 * then every rank's against rank 0's.
 */
#ifndef SP_CORE_VALIDATE_H
#define SP_CORE_VALIDATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"

typedef struct sp_group sp_group_t;
typedef struct sp_op sp_op_t;

/* Checks what one rank can check alone: arguments, sizes, regions. Sets
 * op->local. */
void sp_op_validate(sp_op_t *op, uint32_t group_size);
/* The checks of sp_op_validate that need no memory, for the op of a rank of
 * another daemon (client NULL): its arguments and sizes, and need[] set from
 * them, so that what this daemon reads of its inputs follows from the op
 * that its ranks agree on, not from a size the message states. */
void sp_op_validate_remote(sp_op_t *op, uint32_t group_size);
/* Compares every rank's op with rank 0's. Returns false when they disagree, with
 * SPC_ERR_MISMATCH and the detail naming the ranks and fields in e. */
bool sp_coll_agree(const sp_group_t *g, sp_op_t *const *ops, sp_err_t *e);

#endif /* SP_CORE_VALIDATE_H */
