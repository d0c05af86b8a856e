/*
 * seq.c — pure helpers for sequence parallelism: the zigzag layout of causal
 * Ring-Attention, cu_seqlens for packed sequences, and how many heads a rank
 * holds after a Ulysses all-to-all. None of them touches a handle or the daemon.
 */
#include <string.h>

#include "internal.h"

/* ================================================================ zigzag */

/* The shape shared by split, merge and positions. S rows are cut into 2P chunks
 * of `chunk` rows; rank r holds chunk r, then chunk 2P-1-r. */
typedef struct zz_shape {
    uint64_t outer;
    uint64_t seq_len;
    uint64_t row_bytes;
    uint64_t chunk;        /* rows per chunk: S / 2P */
    uint32_t P;
} zz_shape_t;

/* Checks P and S and fills z. The byte count of the full array must fit in
 * size_t: memcpy and the caller's buffers can hold no more. */
static bool zz_shape_init(zz_shape_t *z, uint64_t outer, uint64_t seq_len, uint64_t row_bytes, uint32_t P)
{
    uint64_t rows, bytes;
    if (P == 0 || seq_len % (2 * (uint64_t)P) != 0)
        return false;
    if (__builtin_mul_overflow(outer, seq_len, &rows) || __builtin_mul_overflow(rows, row_bytes, &bytes)
        || bytes > SIZE_MAX)
        return false;
    z->outer = outer;
    z->seq_len = seq_len;
    z->row_bytes = row_bytes;
    z->chunk = seq_len / (2 * (uint64_t)P);
    z->P = P;
    return true;
}

/* The global chunk index of rank's half h (0: the early chunk, 1: the late one). */
static uint64_t zz_chunk(const zz_shape_t *z, uint32_t rank, int h)
{
    return h == 0 ? rank : 2 * (uint64_t)z->P - 1 - rank;
}

/* Byte offsets, in the full array and in rank's local array, of rank's half h
 * within outer slice o. A local slice holds 2 * chunk rows. */
static void zz_offsets(const zz_shape_t *z, uint32_t rank, uint64_t o, int h, size_t *full_off, size_t *local_off)
{
    uint64_t full_row = o * z->seq_len + zz_chunk(z, rank, h) * z->chunk;
    uint64_t local_row = o * 2 * z->chunk + (uint64_t)h * z->chunk;
    *full_off = (size_t)(full_row * z->row_bytes);
    *local_off = (size_t)(local_row * z->row_bytes);
}

spc_status_t spc_zigzag_split(const void *full, void *local, uint64_t outer, uint64_t seq_len,
                              uint64_t row_bytes, uint32_t P, uint32_t rank)
{
    zz_shape_t z;
    if (full == NULL || local == NULL || !zz_shape_init(&z, outer, seq_len, row_bytes, P) || rank >= P)
        return SPC_ERR_INVALID_ARG;
    size_t chunk_bytes = (size_t)(z.chunk * z.row_bytes);
    for (uint64_t o = 0; o < z.outer; o++) {
        for (int h = 0; h < 2; h++) {
            size_t fo, lo;
            zz_offsets(&z, rank, o, h, &fo, &lo);
            memcpy((uint8_t *)local + lo, (const uint8_t *)full + fo, chunk_bytes);
        }
    }
    return SPC_OK;
}

spc_status_t spc_zigzag_merge(const void *const *locals, void *full, uint64_t outer, uint64_t seq_len,
                              uint64_t row_bytes, uint32_t P)
{
    zz_shape_t z;
    if (locals == NULL || full == NULL || !zz_shape_init(&z, outer, seq_len, row_bytes, P))
        return SPC_ERR_INVALID_ARG;
    /* Check every pointer before writing anything, so a bad call leaves full alone. */
    for (uint32_t r = 0; r < P; r++)
        if (locals[r] == NULL)
            return SPC_ERR_INVALID_ARG;
    size_t chunk_bytes = (size_t)(z.chunk * z.row_bytes);
    for (uint32_t r = 0; r < P; r++) {
        for (uint64_t o = 0; o < z.outer; o++) {
            for (int h = 0; h < 2; h++) {
                size_t fo, lo;
                zz_offsets(&z, r, o, h, &fo, &lo);
                memcpy((uint8_t *)full + fo, (const uint8_t *)locals[r] + lo, chunk_bytes);
            }
        }
    }
    return SPC_OK;
}

spc_status_t spc_zigzag_positions(uint64_t seq_len, uint32_t P, uint32_t rank, int64_t *pos)
{
    zz_shape_t z;
    /* outer 1, row 1 byte: only P and S matter here. Positions are int64_t, so
     * S must fit in one. */
    if (pos == NULL || seq_len > (uint64_t)INT64_MAX || !zz_shape_init(&z, 1, seq_len, 1, P) || rank >= P)
        return SPC_ERR_INVALID_ARG;
    for (int h = 0; h < 2; h++) {
        uint64_t first = zz_chunk(&z, rank, h) * z.chunk;
        for (uint64_t j = 0; j < z.chunk; j++)
            pos[(uint64_t)h * z.chunk + j] = (int64_t)(first + j);
    }
    return SPC_OK;
}

/* ================================================================ cu_seqlens */

/* Whether row i (> 0) begins a new document: its position restarts at 0 or does
 * not follow the previous one. prev + 1 is computed only when it cannot overflow. */
static bool doc_starts(const int64_t *pos, uint64_t i)
{
    int64_t prev = pos[i - 1];
    return pos[i] == 0 || prev == INT64_MAX || pos[i] != prev + 1;
}

/* Two passes: the first counts documents, so that a too-small cu is refused
 * before anything is written (outputs are set only on success). */
spc_status_t spc_cu_seqlens(const int64_t *position_ids, uint64_t n, int32_t *cu, uint64_t cap,
                            uint64_t *ndocs_p, int32_t *max_len_p)
{
    /* Offsets are int32_t in the flash-attention format, so n must fit one. */
    if (position_ids == NULL || cu == NULL || n == 0 || n > (uint64_t)INT32_MAX)
        return SPC_ERR_INVALID_ARG;
    uint64_t ndocs = 1;   /* row 0 always starts one, wherever its position is */
    for (uint64_t i = 1; i < n; i++)
        ndocs += doc_starts(position_ids, i);
    if (cap < ndocs + 1)
        return SPC_ERR_INVALID_ARG;

    uint64_t k = 0, start = 0;
    int32_t max_len = 0;
    cu[k++] = 0;
    for (uint64_t i = 1; i <= n; i++) {
        if (i < n && !doc_starts(position_ids, i))
            continue;
        int32_t len = (int32_t)(i - start);
        if (len > max_len)
            max_len = len;
        cu[k++] = (int32_t)i;
        start = i;
    }
    if (ndocs_p != NULL)
        *ndocs_p = ndocs;
    if (max_len_p != NULL)
        *max_len_p = max_len;
    return SPC_OK;
}

/* ================================================================ Ulysses heads */

/* Heads per rank; see the rule in spclient.h at spc_alltoall_desc_t. n groups of
 * g heads each. With n >= P whole groups are dealt out, padded to a multiple of
 * P. With n < P, r = P / n ranks share a group: a KV head is replicated to them,
 * a query group's g heads are padded to a multiple of r and split among them. */
uint32_t spc_a2a_local_heads(uint32_t heads, uint32_t kind, uint32_t kv_heads, uint32_t P)
{
    uint32_t n;
    if (kind == SPC_HEADS_KV)
        n = heads;
    else if (kind == SPC_HEADS_Q)
        n = kv_heads == 0 ? heads : kv_heads;
    else
        return 0;
    if (heads == 0 || n == 0 || P == 0 || heads % n != 0)
        return 0;
    uint32_t g = heads / n;
    if (n >= P)
        /* ceil(n / P) * g <= heads for P >= 2 (and == heads for P == 1): no overflow. */
        return (n / P + (n % P != 0)) * g;
    if (P % n != 0)
        return 0;
    if (kind == SPC_HEADS_KV)
        return 1;
    uint32_t r = P / n;
    return g / r + (g % r != 0);
}
