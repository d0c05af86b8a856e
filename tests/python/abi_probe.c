/* What the Python binding's ctypes declarations must agree with: the size of
 * each public struct, the offset and size of each of its fields, and the
 * values of the enums and flags the binding names, as the compiler sees
 * spclient.h. A library of its own for test_abi.py, since libspclient
 * exports spc_* only. */
#include <stddef.h>
#include <string.h>

#include "spclient/spclient.h"

#define PROBE_API __attribute__((visibility("default")))

/* The element of spc_shift_desc_t.tensors, a struct without a name. */
typedef __typeof__(((spc_shift_desc_t *)0)->tensors[0]) shift_tensor_t;

typedef struct {
    const char *type, *field;   /* field NULL: the struct itself */
    size_t      offset, size;
} probe_field_t;

#define STRUCT(T) { #T, NULL, 0, sizeof(T) }
#define FIELD(T, f) { #T, #f, offsetof(T, f), sizeof ((T *)0)->f }

static const probe_field_t fields[] = {
    STRUCT(spc_attach_params_t),
    FIELD(spc_attach_params_t, struct_size),
    FIELD(spc_attach_params_t, socket_path),
    FIELD(spc_attach_params_t, name),
    FIELD(spc_attach_params_t, flags),
    FIELD(spc_attach_params_t, sq_entries),
    FIELD(spc_attach_params_t, arena_bytes),
    FIELD(spc_attach_params_t, timeout_ms),

    STRUCT(spc_job_params_t),
    FIELD(spc_job_params_t, struct_size),
    FIELD(spc_job_params_t, allow_uids),
    FIELD(spc_job_params_t, nallow_uids),

    STRUCT(spc_mesh_spec_t),
    FIELD(spc_mesh_spec_t, struct_size),
    FIELD(spc_mesh_spec_t, sp),
    FIELD(spc_mesh_spec_t, ulysses),
    FIELD(spc_mesh_spec_t, ring),
    FIELD(spc_mesh_spec_t, heads),
    FIELD(spc_mesh_spec_t, kv_heads),

    STRUCT(spc_mesh_t),
    FIELD(spc_mesh_t, id),
    FIELD(spc_mesh_t, dp),
    FIELD(spc_mesh_t, sp),
    FIELD(spc_mesh_t, ulysses),
    FIELD(spc_mesh_t, ring),
    FIELD(spc_mesh_t, dp_group),
    FIELD(spc_mesh_t, sp_group),
    FIELD(spc_mesh_t, ulysses_group),
    FIELD(spc_mesh_t, ring_group),
    FIELD(spc_mesh_t, dp_rank),
    FIELD(spc_mesh_t, sp_rank),
    FIELD(spc_mesh_t, ulysses_rank),
    FIELD(spc_mesh_t, ring_rank),
    FIELD(spc_mesh_t, explain),

    STRUCT(spc_a2a_tensor_t),
    FIELD(spc_a2a_tensor_t, send),
    FIELD(spc_a2a_tensor_t, recv),
    FIELD(spc_a2a_tensor_t, heads),
    FIELD(spc_a2a_tensor_t, head_dim),
    FIELD(spc_a2a_tensor_t, kind),
    FIELD(spc_a2a_tensor_t, flags),

    STRUCT(spc_alltoall_desc_t),
    FIELD(spc_alltoall_desc_t, struct_size),
    FIELD(spc_alltoall_desc_t, group),
    FIELD(spc_alltoall_desc_t, dtype),
    FIELD(spc_alltoall_desc_t, direction),
    FIELD(spc_alltoall_desc_t, layout),
    FIELD(spc_alltoall_desc_t, batch),
    FIELD(spc_alltoall_desc_t, seq_len),
    FIELD(spc_alltoall_desc_t, kv_heads),
    FIELD(spc_alltoall_desc_t, ntensors),
    FIELD(spc_alltoall_desc_t, tensors),
    FIELD(spc_alltoall_desc_t, timeout_ms),
    FIELD(spc_alltoall_desc_t, more_tensors),

    STRUCT(spc_alltoallv_desc_t),
    FIELD(spc_alltoallv_desc_t, struct_size),
    FIELD(spc_alltoallv_desc_t, group),
    FIELD(spc_alltoallv_desc_t, dtype),
    FIELD(spc_alltoallv_desc_t, send),
    FIELD(spc_alltoallv_desc_t, recv),
    FIELD(spc_alltoallv_desc_t, send_counts),
    FIELD(spc_alltoallv_desc_t, recv_counts),
    FIELD(spc_alltoallv_desc_t, timeout_ms),

    STRUCT(spc_device_span_t),
    FIELD(spc_device_span_t, ptr),
    FIELD(spc_device_span_t, bytes),

    STRUCT(spc_launch_t),
    FIELD(spc_launch_t, struct_size),
    FIELD(spc_launch_t, rank),
    FIELD(spc_launch_t, world_size),
    FIELD(spc_launch_t, local_rank),
    FIELD(spc_launch_t, local_world_size),
    FIELD(spc_launch_t, nodes),
    FIELD(spc_launch_t, launcher),
    FIELD(spc_launch_t, job),
    FIELD(spc_launch_t, launch),
    FIELD(spc_launch_t, world),

    STRUCT(spc_device_cache_info_t),
    FIELD(spc_device_cache_info_t, struct_size),
    FIELD(spc_device_cache_info_t, regions),
    FIELD(spc_device_cache_info_t, limit),
    FIELD(spc_device_cache_info_t, registrations),
    FIELD(spc_device_cache_info_t, dropped),
    FIELD(spc_device_cache_info_t, merged),

    STRUCT(spc_resume_info_t),
    FIELD(spc_resume_info_t, struct_size),
    FIELD(spc_resume_info_t, resumes),
    FIELD(spc_resume_info_t, replayed),
    FIELD(spc_resume_info_t, retried),
    FIELD(spc_resume_info_t, last_gap_ms),

    STRUCT(spc_device_entry_t),
    FIELD(spc_device_entry_t, base),
    FIELD(spc_device_entry_t, size),
    FIELD(spc_device_entry_t, region),
    FIELD(spc_device_entry_t, chunks),

    STRUCT(shift_tensor_t),
    FIELD(shift_tensor_t, send),
    FIELD(shift_tensor_t, recv),
    FIELD(shift_tensor_t, bytes),

    STRUCT(spc_shift_desc_t),
    FIELD(spc_shift_desc_t, struct_size),
    FIELD(spc_shift_desc_t, group),
    FIELD(spc_shift_desc_t, channel),
    FIELD(spc_shift_desc_t, flags),
    FIELD(spc_shift_desc_t, ntensors),
    FIELD(spc_shift_desc_t, tensors),
    FIELD(spc_shift_desc_t, timeout_ms),

    STRUCT(spc_lse_merge_desc_t),
    FIELD(spc_lse_merge_desc_t, struct_size),
    FIELD(spc_lse_merge_desc_t, memory),
    FIELD(spc_lse_merge_desc_t, layout),
    FIELD(spc_lse_merge_desc_t, batch),
    FIELD(spc_lse_merge_desc_t, seq_len),
    FIELD(spc_lse_merge_desc_t, heads),
    FIELD(spc_lse_merge_desc_t, head_dim),
    FIELD(spc_lse_merge_desc_t, out),
    FIELD(spc_lse_merge_desc_t, lse),
    FIELD(spc_lse_merge_desc_t, out_a),
    FIELD(spc_lse_merge_desc_t, lse_a),
    FIELD(spc_lse_merge_desc_t, out_b),
    FIELD(spc_lse_merge_desc_t, lse_b),
    FIELD(spc_lse_merge_desc_t, cu_stream),
};

#define CONST(c) { #c, (long)(c) }

static const struct { const char *name; long value; } consts[] = {
    CONST(SPC_F32), CONST(SPC_F64), CONST(SPC_F16), CONST(SPC_BF16), CONST(SPC_I32), CONST(SPC_I64), CONST(SPC_U8),
    CONST(SPC_SUM), CONST(SPC_MAX), CONST(SPC_MIN),
    CONST(SPC_SEQ_TO_HEAD), CONST(SPC_HEAD_TO_SEQ),
    CONST(SPC_LAYOUT_BSHD), CONST(SPC_LAYOUT_SBHD),
    CONST(SPC_HEADS_Q), CONST(SPC_HEADS_KV),
    CONST(SPC_A2A_SUM_REPLICAS), CONST(SPC_SHIFT_LINEAR), CONST(SPC_SHIFT_REVERSE),
    CONST(SPC_JOB_ID_MAX), CONST(SPC_MEMORY_HOST), CONST(SPC_MEMORY_CUDA),
};

static const probe_field_t *find(const char *type, const char *field)
{
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        const probe_field_t *f = &fields[i];
        if (strcmp(f->type, type) == 0 && (field == NULL ? f->field == NULL : f->field && !strcmp(f->field, field)))
            return f;
    }
    return NULL;
}

/* sizeof the struct; -1 when the probe does not know it. */
PROBE_API long sp_probe_sizeof(const char *type)
{
    const probe_field_t *f = find(type, NULL);
    return f ? (long)f->size : -1;
}

/* offsetof and sizeof a field; -1 when the probe does not know it. */
PROBE_API long sp_probe_offsetof(const char *type, const char *field)
{
    const probe_field_t *f = find(type, field);
    return f ? (long)f->offset : -1;
}

PROBE_API long sp_probe_field_size(const char *type, const char *field)
{
    const probe_field_t *f = find(type, field);
    return f ? (long)f->size : -1;
}

/* The number of fields the probe knows of a struct: what the binding must declare. */
PROBE_API long sp_probe_nfields(const char *type)
{
    long n = 0;
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        n += fields[i].field != NULL && strcmp(fields[i].type, type) == 0;
    return n;
}

/* A constant's value into *value_p; 0 when the probe does not know the name. */
PROBE_API int sp_probe_const(const char *name, long *value_p)
{
    for (size_t i = 0; i < sizeof consts / sizeof consts[0]; i++) {
        if (strcmp(consts[i].name, name) == 0) {
            *value_p = consts[i].value;
            return 1;
        }
    }
    return 0;
}
