/*
 * stub_kern.c — spd's CUDA launchers (sp_kern_cuda.h) for the stand-in driver:
 * each enqueues the host reference of its kernel on the stream as a stub
 * kernel (stub_launch), naming every byte it reads and writes, so that the
 * stub refuses it where the stream's device may not reach that memory, and
 * runs it in stream order otherwise. Linked into spd_stub (tests/CMakeLists.txt)
 * in place of kernels/cuda; everything else of that spd is spd's own. The host
 * references are the ones the CUDA kernels are tested against, so the bits are
 * those of a GPU.
 */
#include <stdlib.h>
#include <string.h>

#include "sp_kern.h"
#include "sp_kern_a2a.h"
#include "sp_kern_cuda.h"
#include "sp_kern_seq.h"
#include "stub_cuda.h"

/* What a launch returns for memory its device may not reach: the driver's
 * CUDA_ERROR_ILLEGAL_ADDRESS, which the runtime reports as cudaErrorIllegalAddress. */
#define ILLEGAL_ADDRESS 700

int sp_kern_cuda_load(void)
{
    return 0;   /* the host references need no loading */
}

/* Launches fn(arg) over the ranges touched; arg is freed by fn, or here when refused. */
static int launch(void *stream, const char *what, const stub_touch_t *touch, size_t ntouch, void (*fn)(void *),
                  void *arg)
{
    int rc = stub_launch(stream, what, touch, ntouch, fn, arg);
    if (rc != 0)
        free(arg);
    return rc == 0 ? 0 : ILLEGAL_ADDRESS;
}

static stub_ptr_t at(const void *p)
{
    return (stub_ptr_t)(uintptr_t)p;
}

/* ---------------------------------------------------------------- the shift copy */

typedef struct shift_args {
    void       *dst;
    const void *src;
    uint64_t    n;
} shift_args_t;

static void shift_run(void *arg)
{
    shift_args_t *a = arg;
    sp_kern_shift_host(a->dst, a->src, a->n);
    free(a);
}

int sp_kern_shift_cuda(void *dst, const void *src, uint64_t n, void *stream)
{
    shift_args_t *a = malloc(sizeof *a);
    if (a == NULL)
        return -1;
    *a = (shift_args_t){ dst, src, n };
    stub_touch_t touch[2] = { { at(dst), n }, { at(src), src != NULL ? n : 0 } };
    return launch(stream, "copy", touch, 2, shift_run, a);
}

/* ---------------------------------------------------------------- the all-reduce */

typedef struct allreduce_args {
    void       *dst[SP_KERN_A2A_MAX_RANKS];
    const void *src[SP_KERN_A2A_MAX_RANKS];
    uint32_t    P;
    uint64_t    n;
    unsigned    dtype, redop;
    size_t      es;
} allreduce_args_t;

static size_t elem_size(unsigned dtype)
{
    switch (dtype) {
    case SP_KERN_F64: case SP_KERN_I64: return 8;
    case SP_KERN_F32: case SP_KERN_I32: return 4;
    case SP_KERN_F16: case SP_KERN_BF16: return 2;
    default: return 1;
    }
}

/* The fold in rank order as the kernel does it (16-bit types in fp32, rounded
 * once), into a buffer of its own first: a destination may be a source. */
static void allreduce_run(void *arg)
{
    allreduce_args_t *a = arg;
    bool wide = sp_kern_acc_dtype(a->dtype) != a->dtype;
    void *acc = malloc(a->n * (wide ? sizeof(float) : a->es) + 1);
    if (acc != NULL) {
        if (wide) {
            sp_kern_widen(acc, a->src[0], a->n, a->dtype);
            for (uint32_t q = 1; q < a->P; q++)
                sp_kern_reduce_widen(acc, a->src[q], a->n, a->dtype, a->redop);
        } else {
            memcpy(acc, a->src[0], a->n * a->es);
            for (uint32_t q = 1; q < a->P; q++)
                sp_kern_reduce(acc, a->src[q], a->n, a->dtype, a->redop);
        }
        for (uint32_t r = 0; r < a->P; r++) {
            if (wide)
                sp_kern_narrow(a->dst[r], acc, a->n, a->dtype);
            else
                memcpy(a->dst[r], acc, a->n * a->es);
        }
    }
    free(acc);
    free(a);
}

int sp_kern_allreduce_cuda(void *const *dst, const void *const *src, uint32_t P, uint64_t n, unsigned dtype,
                           unsigned redop, void *stream)
{
    if (P == 0 || P > SP_KERN_A2A_MAX_RANKS || !sp_kern_reduce_supported(dtype, redop))
        return -1;
    allreduce_args_t *a = malloc(sizeof *a);
    if (a == NULL)
        return -1;
    *a = (allreduce_args_t){ .P = P, .n = n, .dtype = dtype, .redop = redop, .es = elem_size(dtype) };
    stub_touch_t touch[2 * SP_KERN_A2A_MAX_RANKS];
    for (uint32_t r = 0; r < P; r++) {
        a->dst[r] = dst[r];
        a->src[r] = src[r];
        touch[2 * r] = (stub_touch_t){ at(dst[r]), n * a->es };
        touch[2 * r + 1] = (stub_touch_t){ at(src[r]), n * a->es };
    }
    return launch(stream, "all-reduce", touch, 2 * P, allreduce_run, a);
}

/* ---------------------------------------------------------------- the all-to-all */

typedef struct a2a_args {
    void              *dst;
    const void        *src[SP_KERN_A2A_MAX_RANKS];
    sp_kern_a2a_desc_t d;
    uint32_t           rank;
} a2a_args_t;

static void a2a_run(void *arg)
{
    a2a_args_t *a = arg;
    sp_kern_a2a_host(a->dst, a->src, &a->d, a->rank);
    free(a);
}

int sp_kern_a2a_cuda(void *dst, const void *const *src, const sp_kern_a2a_desc_t *d, uint32_t rank, void *stream)
{
    sp_kern_a2a_geom_t g;
    if (d->ranks > SP_KERN_A2A_MAX_RANKS || sp_kern_a2a_geom(&g, d, rank) != 0)
        return -1;
    a2a_args_t *a = malloc(sizeof *a);
    if (a == NULL)
        return -1;
    *a = (a2a_args_t){ .dst = dst, .d = *d, .rank = rank };
    stub_touch_t touch[1 + SP_KERN_A2A_MAX_RANKS] = { { at(dst), sp_kern_a2a_out_bytes(&g) } };
    for (uint32_t q = 0; q < d->ranks; q++) {
        a->src[q] = src[q];
        touch[1 + q] = (stub_touch_t){ at(src[q]), sp_kern_a2a_src_bytes(&g) };
    }
    return launch(stream, "all-to-all", touch, 1 + d->ranks, a2a_run, a);
}
