/*
 * err.h — how an error travels inside the daemon: one carrier, a status and its detail.
 *
 * A function that can fail takes `sp_err_t *e` as its last parameter and returns
 * spc_status_t. On failure it returns the status it recorded in e, so the two
 * never differ: `return sp_err_set(e, SPC_ERR_LIMIT, "...")`. The caller reads
 * e only after a failure. A function that returns something else (a pointer,
 * a bool) says failure by that value, and the status is the carrier's.
 *
 * The status is the one the client will see (spclient/status.h), and the detail
 * is sized to what a completion entry carries (SP_DETAIL_BYTES), so an error can
 * be answered or posted as it is. The function that first sees an error writes
 * its detail; a caller may put its context in front (sp_err_prefix). Setup code
 * unwinds with SP_CHECK_GOTO to labels named for what they undo.
 */
#ifndef SP_BASE_ERR_H
#define SP_BASE_ERR_H

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "sp_shm.h"
#include "spclient/status.h"

#define SP_ERR_MSG SP_DETAIL_BYTES

typedef struct sp_err {
    spc_status_t status;        /* SPC_OK until something failed */
    char         msg[SP_ERR_MSG];  /* why, NUL terminated; "" with SPC_OK */
} sp_err_t;

#define SP_ERR_INIT { SPC_OK, "" }

/* Records status st and the detail fmt; returns st. */
static inline spc_status_t sp_err_vset(sp_err_t *e, spc_status_t st, const char *fmt, va_list ap)
    __attribute__((format(printf, 3, 0)));
static inline spc_status_t sp_err_vset(sp_err_t *e, spc_status_t st, const char *fmt, va_list ap)
{
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    e->status = st;
    return st;
}

static inline spc_status_t sp_err_set(sp_err_t *e, spc_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static inline spc_status_t sp_err_set(sp_err_t *e, spc_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    sp_err_vset(e, st, fmt, ap);
    va_end(ap);
    return st;
}

/* Puts the context fmt in front of e's detail ("mesh refused: " + detail);
 * the status stays. Returns it. */
static inline spc_status_t sp_err_prefix(sp_err_t *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static inline spc_status_t sp_err_prefix(sp_err_t *e, const char *fmt, ...)
{
    char detail[SP_ERR_MSG];
    va_list ap;

    memcpy(detail, e->msg, sizeof detail);
    va_start(ap, fmt);
    int n = vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    if (n >= 0 && (size_t)n < sizeof e->msg)
        snprintf(e->msg + n, sizeof e->msg - (size_t)n, "%s", detail);
    return e->status;
}

/* Records st from a callee outside the daemon (common/, which spctl shares)
 * that wrote its detail into SP_ERR_BUF(e). Returns st:
 * `st = sp_err_from(e, sp_topo_load(path, &topo, SP_ERR_BUF(e)));` */
static inline spc_status_t sp_err_from(sp_err_t *e, spc_status_t st)
{
    if (st != SPC_OK)
        e->status = st;
    return st;
}

/* e's detail as such a callee takes it: a buffer and its size. */
#define SP_ERR_BUF(e) (e)->msg, sizeof (e)->msg

/* One line per call that may fail: return its status to the caller. */
#define SP_CHECK(call)                      \
    do {                                    \
        spc_status_t sp__st = (call);       \
        if (sp__st != SPC_OK)               \
            return sp__st;                  \
    } while (0)

/* One line per call in setup code: keep its status in st and, if it failed,
 * go to the label that undoes what was done before it. */
#define SP_CHECK_GOTO(call, st, label)      \
    do {                                    \
        if (((st) = (call)) != SPC_OK)      \
            goto label;                     \
    } while (0)

#endif /* SP_BASE_ERR_H */
