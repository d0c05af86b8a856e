/* The struct_size rule, call by call: a caller built against an older, smaller
 * struct (declared here as its first version) still works, the fields it lacks
 * taking their defaults, and the bytes past its struct_size are never read; a
 * struct_size short of the first version, larger than the library's struct or
 * not a size at all is refused with SPC_ERR_INVALID_ARG naming the struct. */
#include <stddef.h>

#include "sp_test.h"

#define TIMEOUT_MS 10000

/* Each first version, as a caller's older spclient.h declared it, with bytes
 * after it that are not the caller's: 0xff there would read as a channel out
 * of range, an impossible kv_heads, ... */
#define AFTER(type) struct { type v; unsigned char after[64]; }
#define GARBAGE_AFTER(b) memset(&(b), 0xff, sizeof (b))

typedef struct {
    size_t      struct_size;
    const char *socket_path;
    const char *name;
    uint32_t    flags;
    uint32_t    sq_entries;
    uint64_t    arena_bytes;
} attach_params_v1_t;    /* before timeout_ms */

typedef struct {
    size_t struct_size;
} job_params_v1_t;       /* before allow_uids */

typedef struct {
    size_t   struct_size;
    uint32_t sp, ulysses, ring, heads;
} mesh_spec_v1_t;        /* before kv_heads */

typedef struct {
    size_t       struct_size;
    spc_opcode_t opcode;
    spc_group_t  group;
    spc_dtype_t  dtype;
    spc_redop_t  redop;
    uint64_t     count;
    uint32_t     ntensors;
    spc_tensor_t tensors[SPC_OP_MAX_TENSORS];
} op_v1_t;               /* before timeout_ms, flags, channel, root, params */

typedef struct {
    size_t           struct_size;
    spc_group_t      group;
    spc_dtype_t      dtype;
    uint32_t         direction, layout, batch, seq_len, kv_heads, ntensors;
    spc_a2a_tensor_t tensors[4];
} alltoall_desc_v1_t;    /* before timeout_ms */

typedef struct {
    size_t      struct_size;
    spc_group_t group;
    uint32_t    channel, flags, ntensors;
    struct {
        const void *send;
        void       *recv;
        uint64_t    bytes;
    } tensors[4];
} shift_desc_v1_t;       /* before timeout_ms */

/* The first versions are prefixes of today's structs. */
_Static_assert(sizeof(attach_params_v1_t) == offsetof(spc_attach_params_t, timeout_ms), "attach v1");
_Static_assert(sizeof(job_params_v1_t) == offsetof(spc_job_params_t, allow_uids), "job v1");
_Static_assert(sizeof(mesh_spec_v1_t) == offsetof(spc_mesh_spec_t, kv_heads), "mesh v1");
_Static_assert(sizeof(op_v1_t) == offsetof(spc_op_t, timeout_ms), "op v1");
_Static_assert(sizeof(alltoall_desc_v1_t) == offsetof(spc_alltoall_desc_t, timeout_ms), "alltoall v1");
_Static_assert(sizeof(shift_desc_v1_t) == offsetof(spc_shift_desc_t, timeout_ms), "shift v1");

/* A refusal of struct_size `size` in *s, whose detail names `type`. */
#define CHECK_REFUSED(h, call, s, size, type)                                      \
    do {                                                                           \
        (s).struct_size = (size);                                                  \
        CHECK_ST(h, call, SPC_ERR_INVALID_ARG);                                    \
        CHECK_CONTAINS(spc_last_error(h), type ".struct_size is");                 \
    } while (0)

/* For each struct: the first version's size and what is not a size. */
#define CHECK_SIZES_REFUSED(h, call, s, type, first)                               \
    do {                                                                           \
        CHECK_REFUSED(h, call, s, (first) - sizeof(size_t), type);                 \
        CHECK_REFUSED(h, call, s, sizeof(s) + 8, type);                            \
        CHECK_REFUSED(h, call, s, (size_t)1 << 40, type);                          \
        CHECK_REFUSED(h, call, s, (first) + 4, type);                              \
        (s).struct_size = sizeof(s);                                               \
    } while (0)

static void test_attach_and_job(const sp_test_daemon_t *d)
{
    AFTER(attach_params_v1_t) a;
    GARBAGE_AFTER(a);
    a.v = (attach_params_v1_t){ .struct_size = sizeof a.v, .socket_path = d->sock, .name = "v1", .arena_bytes = 1 << 20 };
    spc_handle_t *h;
    CHECK_OK(NULL, spc_attach((const spc_attach_params_t *)&a.v, &h));
    uint64_t size, used;
    spc_arena_usage(h, &size, &used);
    CHECK_EQ(size, 1 << 20);
    CHECK_OK(h, spc_noop(h, TIMEOUT_MS));

    AFTER(job_params_v1_t) j;
    GARBAGE_AFTER(j);
    j.v.struct_size = sizeof j.v;
    char id[SPC_JOB_ID_MAX];
    CHECK_OK(h, spc_job_create_with(h, (const spc_job_params_t *)&j.v, id, sizeof id));
    spc_detach(h);

    spc_attach_params_t p = SPC_ATTACH_PARAMS_INIT;
    CHECK_EQ(p.struct_size, sizeof p);
    CHECK(p.socket_path == NULL && p.timeout_ms == 0);
    p.socket_path = d->sock;
    CHECK_SIZES_REFUSED(NULL, spc_attach(&p, &h), p, "spc_attach_params_t", sizeof(size_t));
    CHECK_OK(NULL, spc_attach(&p, &h));
    spc_job_params_t jp = SPC_JOB_PARAMS_INIT;
    CHECK_SIZES_REFUSED(h, spc_job_create_with(h, &jp, id, sizeof id), jp, "spc_job_params_t", sizeof(size_t));
    CHECK_OK(h, spc_job_create_with(h, &jp, id, sizeof id));
    spc_detach(h);
}

/* One rank, its own world: every call of an op runs to completion. */
static void test_ops(void)
{
    spc_handle_t *h = sp_test_attach();
    char id[SPC_JOB_ID_MAX];
    spc_group_t world;
    CHECK_OK(h, spc_job_create(h, id, sizeof id));
    CHECK_OK(h, spc_job_join(h, id, 1, 0, TIMEOUT_MS, &world));

    /* A mesh without kv_heads: kv_heads takes its default (heads). */
    AFTER(mesh_spec_v1_t) ms;
    GARBAGE_AFTER(ms);
    ms.v = (mesh_spec_v1_t){ .struct_size = sizeof ms.v, .sp = 1, .heads = 2 };
    spc_mesh_t m;
    CHECK_OK(h, spc_mesh_create(h, (const spc_mesh_spec_t *)&ms.v, &m));
    CHECK_EQ(m.sp, 1);
    spc_mesh_spec_t spec = SPC_MESH_SPEC_INIT;
    spec.sp = 1;
    spec.heads = 2;
    CHECK_SIZES_REFUSED(h, spc_mesh_create(h, &spec, &m), spec, "spc_mesh_spec_t",
                        offsetof(spc_mesh_spec_t, kv_heads));
    CHECK_OK(h, spc_mesh_create(h, &spec, &m));   /* the same spec: the next mesh */

    /* An all-reduce without timeout_ms, channel, flags, root, params. */
    float *x = spc_alloc(h, 4 * sizeof *x);
    for (int i = 0; i < 4; i++)
        x[i] = (float)i;
    AFTER(op_v1_t) o;
    GARBAGE_AFTER(o);
    o.v = (op_v1_t){ .struct_size = sizeof o.v, .opcode = SPC_OP_ALLREDUCE, .group = world, .dtype = SPC_F32,
                     .redop = SPC_SUM, .count = 4, .ntensors = 2, .tensors = { { .ptr = x }, { .ptr = x } } };
    spc_request_t *r;
    CHECK_OK(h, spc_submit(h, (const spc_op_t *)&o.v, &r));
    CHECK_OK(h, spc_wait(r, TIMEOUT_MS));
    spc_request_release(r);
    CHECK(x[3] == 3.0f);
    spc_op_t op = SPC_OP_INIT;
    op.opcode = SPC_OP_BARRIER;
    op.group = world;
    CHECK_SIZES_REFUSED(h, spc_submit(h, &op, &r), op, "spc_op_t", offsetof(spc_op_t, timeout_ms));
    CHECK_OK(h, sp_test_submit_wait(h, &op, TIMEOUT_MS));

    /* An all-to-all of one rank is a copy. */
    float *send = spc_alloc(h, 2 * 4 * sizeof *send), *recv = spc_alloc(h, 2 * 4 * sizeof *recv);
    for (int i = 0; i < 8; i++)
        send[i] = (float)(i + 1);
    AFTER(alltoall_desc_v1_t) a;
    GARBAGE_AFTER(a);
    a.v = (alltoall_desc_v1_t){ .struct_size = sizeof a.v, .group = world, .dtype = SPC_F32,
                                .direction = SPC_SEQ_TO_HEAD, .layout = SPC_LAYOUT_BSHD, .batch = 1, .seq_len = 2,
                                .ntensors = 1, .tensors = { { .send = send, .recv = recv, .heads = 2, .head_dim = 2 } } };
    CHECK_OK(h, spc_alltoall(h, (const spc_alltoall_desc_t *)&a.v, TIMEOUT_MS));
    CHECK(memcmp(send, recv, 8 * sizeof *send) == 0);
    spc_alltoall_desc_t ad = SPC_ALLTOALL_DESC_INIT;
    memcpy(&ad, &a.v, sizeof a.v);
    ad.struct_size = sizeof ad;
    CHECK_SIZES_REFUSED(h, spc_alltoall(h, &ad, TIMEOUT_MS), ad, "spc_alltoall_desc_t",
                        offsetof(spc_alltoall_desc_t, timeout_ms));
    CHECK_OK(h, spc_alltoall(h, &ad, TIMEOUT_MS));

    /* A cyclic shift of one rank sends to itself. */
    memset(recv, 0, 8 * sizeof *recv);
    AFTER(shift_desc_v1_t) s;
    GARBAGE_AFTER(s);
    s.v = (shift_desc_v1_t){ .struct_size = sizeof s.v, .group = world, .ntensors = 1,
                             .tensors = { { .send = send, .recv = recv, .bytes = 8 * sizeof *send } } };
    CHECK_OK(h, spc_shift(h, (const spc_shift_desc_t *)&s.v, TIMEOUT_MS));
    CHECK(memcmp(send, recv, 8 * sizeof *send) == 0);
    spc_shift_desc_t sd = SPC_SHIFT_DESC_INIT;
    memcpy(&sd, &s.v, sizeof s.v);
    sd.struct_size = sizeof sd;
    CHECK_SIZES_REFUSED(h, spc_shift(h, &sd, TIMEOUT_MS), sd, "spc_shift_desc_t",
                        offsetof(spc_shift_desc_t, timeout_ms));
    CHECK_OK(h, spc_shift(h, &sd, TIMEOUT_MS));

    /* An uneven all-to-all of one rank is a copy; its first version is the whole struct. */
    memset(recv, 0, 8 * sizeof *recv);
    uint64_t n8 = 8;
    spc_alltoallv_desc_t vd = SPC_ALLTOALLV_DESC_INIT;
    CHECK(vd.send == NULL && vd.timeout_ms == 0);
    vd.group = world;
    vd.dtype = SPC_F32;
    vd.send = send;
    vd.recv = recv;
    vd.send_counts = vd.recv_counts = &n8;
    CHECK_SIZES_REFUSED(h, spc_alltoallv(h, &vd, TIMEOUT_MS), vd, "spc_alltoallv_desc_t", sizeof vd);
    CHECK_OK(h, spc_alltoallv(h, &vd, TIMEOUT_MS));
    CHECK(memcmp(send, recv, 8 * sizeof *send) == 0);

    /* NULL is refused by name too. */
    CHECK_ST(h, spc_submit(h, NULL, &r), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(h), "spc_op_t is required");
    spc_detach(h);
}

int main(void)
{
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    test_attach_and_job(&d);
    test_ops();
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    return 0;
}
