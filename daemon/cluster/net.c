/*
 * net.c — collectives across daemons: the UCX data path. One active message
 * per (collective, daemon pair): descriptors and the inputs the receiver's
 * ranks read, sent from the arenas and read in place from one staging block.
 * Only authenticated runs have an inbox; every header is MACed, every stream
 * bounded and delivered in order. All of it runs under the engine lock (the
 * worker is SERIALIZED). Files: net.c (worker, endpoints, the net transport),
 * net_send.c, net_recv.c, net_wire.c, net_int.h. Why, and what travels:
 * docs/architecture.md, "The data path between daemons".
 */
#include "cluster/net.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucp/api/ucp.h>

#include "base/log.h"
#include "cluster/net_int.h"
#include "core/client.h"
#include "core/engine.h"

/* ================================================================ endpoints */

net_ep_t *sp_net_ep_find(struct sp_net *n, const char *node)
{
    for (uint32_t i = 0; i < n->neps; i++)
        if (strcmp(n->eps[i]->node, node) == 0)
            return n->eps[i];
    return NULL;
}

static void ep_close(struct sp_net *n, net_ep_t *e)
{
    ucp_request_param_t p = { .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE };
    void *req = ucp_ep_close_nbx(e->ep, &p);
    if (UCS_PTR_IS_PTR(req)) {
        while (ucp_request_check_status(req) == UCS_INPROGRESS)
            ucp_worker_progress(n->worker);
        ucp_request_free(req);
    }
    e->ep = NULL;
}

static void on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    (void)ep;
    /* The TCP link between the daemons notices too and fails the jobs' groups. */
    sp_warn(XPORT, "ucx: endpoint to node %s failed: %s", (const char *)arg, ucs_status_string(status));
}

int sp_net_connect(sp_engine_t *eng, const char *node, const void *addr, size_t len,
                   const uint8_t key[SP_NET_KEY_BYTES])
{
    struct sp_net *n = eng->net;
    if (n == NULL || addr == NULL || len == 0) {
        sp_warn(XPORT, "node %s: no UCX address to send data to", node);
        return -1;
    }
    net_ep_t *e = sp_net_ep_find(n, node);
    if (e == NULL) {
        net_ep_t **ne = realloc(n->eps, (n->neps + 1) * sizeof *ne);
        if (ne == NULL)
            return -1;
        n->eps = ne;
        if ((e = calloc(1, sizeof *e)) == NULL)
            return -1;
        n->eps[n->neps++] = e;
        snprintf(e->node, sizeof e->node, "%s", node);
    } else if (e->ep != NULL) {
        ep_close(n, e);
    }
    memcpy(e->key, key, sizeof e->key);
    ucp_ep_params_t p = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = addr,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = { .cb = on_ep_error, .arg = e->node },
    };
    ucs_status_t st = ucp_ep_create(n->worker, &p, &e->ep);
    if (st != UCS_OK) {
        e->ep = NULL;
        sp_error(XPORT, "ucx: cannot reach node %s: %s", node, ucs_status_string(st));
        return -1;
    }
    sp_info(XPORT, "ucx: endpoint to node %s", node);
    return 0;
}

void sp_net_disconnect(sp_engine_t *eng, const char *node)
{
    struct sp_net *n = eng->net;
    if (n == NULL)
        return;
    net_ep_t *e = sp_net_ep_find(n, node);
    if (e != NULL && e->ep != NULL)
        ep_close(n, e);
    /* Both ends saw the link go: both streams start again from 0. */
    if (e != NULL)
        e->next_out = 0;
    inbox_t *in = sp_net_inbox_find(n, node);
    if (in != NULL) {
        sp_net_inbox_clear(in);
        in->live = false;   /* nothing is taken from it until a link authenticates again */
        in->broken[0] = '\0';
    }
}

int sp_net_expect(sp_engine_t *eng, const char *node, uint64_t incarnation, const uint8_t key[SP_NET_KEY_BYTES])
{
    struct sp_net *n = eng->net;
    if (n == NULL)
        return -1;
    inbox_t *in = sp_net_inbox_find(n, node);
    if (in == NULL) {
        inbox_t *ni = realloc(n->inboxes, (n->ninboxes + 1) * sizeof *ni);
        if (ni == NULL)
            return -1;
        n->inboxes = ni;
        in = &n->inboxes[n->ninboxes++];
        memset(in, 0, sizeof *in);
        snprintf(in->node, sizeof in->node, "%s", node);
    } else if (in->live && in->incarnation == incarnation) {
        return 0;   /* its other link, to the same run: the stream goes on */
    }
    sp_net_inbox_clear(in);   /* a new run, or the first link since the last went: numbering starts again */
    in->broken[0] = '\0';
    in->incarnation = incarnation;
    memcpy(in->key, key, sizeof in->key);
    in->live = true;
    return 0;
}

bool sp_net_take_broken(sp_engine_t *eng, char *node, size_t nlen, char *why, size_t wlen)
{
    struct sp_net *n = eng->net;
    for (uint32_t i = 0; n != NULL && i < n->ninboxes; i++) {
        inbox_t *in = &n->inboxes[i];
        if (in->live && in->broken[0] != '\0') {
            snprintf(node, nlen, "%s", in->node);
            snprintf(why, wlen, "%s", in->broken);
            in->live = false;   /* taken: dropped until its link authenticates again */
            return true;
        }
    }
    return false;
}

uint64_t sp_net_dropped(sp_engine_t *eng)
{
    return eng->net != NULL ? eng->net->dropped : 0;
}

void sp_net_kept_counts(sp_engine_t *eng, uint64_t *bytes, uint64_t *not_kept)
{
    *bytes = eng->net != NULL ? eng->net->kept_bytes : 0;
    *not_kept = eng->net != NULL ? eng->net->not_kept : 0;
}


/* ================================================================ the worker */

/* Progresses the worker; returns the events handled. */
static int net_progress(sp_engine_t *eng, uint64_t now)
{
    struct sp_net *n = eng->net;
    if (n == NULL)
        return 0;
    int work = 0;
    while (ucp_worker_progress(n->worker) != 0)
        work++;
    if (!n->delivering) {   /* messages that waited for their job or group */
        n->delivering = true;
        for (uint32_t i = 0; i < n->ninboxes; i++)
            work += sp_net_inbox_drain(eng, &n->inboxes[i]);
        n->delivering = false;
    }
    return work;
}

void sp_net_poll_locked(sp_engine_t *eng)
{
    struct sp_net *n = eng->net;
    if (n == NULL)
        return;
    /* Armed: the fd signals the next event. Busy: events came meanwhile, go on. */
    do
        net_progress(eng, 0);   /* the worker keeps no clock */
    while (ucp_worker_arm(n->worker) == UCS_ERR_BUSY);
}

int sp_net_efd(sp_engine_t *eng)
{
    return eng->net != NULL ? eng->net->efd : -1;
}

size_t sp_net_address(sp_engine_t *eng, const void **addr_p)
{
    struct sp_net *n = eng->net;
    *addr_p = n != NULL ? n->address : NULL;
    return n != NULL ? n->address_len : 0;
}

/* The transport's op_release: a rank of another daemon's op completed. */
static void net_op_release(sp_op_t *op)
{
    sp_net_stage_unref(op->stage);
    for (unsigned i = 0; i < SP_MAX_TENSORS; i++)
        free(op->own[i]);
}

/* What the engine asks of the data path (core/transport.h). */
static const sp_transport_ops_t net_ops = {
    .cleanup    = sp_net_cleanup,
    .progress   = net_progress,
    .op_release = net_op_release,
    .send_coll  = sp_net_send_coll,
    .group_gone = sp_net_group_gone,
};

int sp_net_init(sp_engine_t *eng, uint64_t incarnation)
{
    struct sp_net *n = calloc(1, sizeof *n);
    ucp_config_t *config = NULL;
    ucs_status_t st;
    if (n == NULL)
        return -1;
    n->efd = -1;
    /* UCX's TCP transport moves 8 KiB segments by default, each one a pass of
     * the progress loop on both daemons; 256 KiB segments moved a 16 MiB shift
     * 2.5x faster between two daemons here (spbench shift --nodes 2). UCX reads
     * its transports' settings from the environment only (ucp_config_modify
     * reaches the UCP layer), so they go there, unless already set: the
     * operator's UCX_TCP_TX_SEG_SIZE and UCX_TCP_RX_SEG_SIZE win. */
    setenv("UCX_TCP_TX_SEG_SIZE", "256k", 0);
    setenv("UCX_TCP_RX_SEG_SIZE", "256k", 0);
    if ((st = ucp_config_read(NULL, NULL, &config)) != UCS_OK)
        goto fail;
    ucp_params_t cp = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
        .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
        .name = "spd",
    };
    st = ucp_init(&cp, config, &n->ctx);
    ucp_config_release(config);
    if (st != UCS_OK)
        goto fail;
    ucp_worker_params_t wp = { .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                               .thread_mode = UCS_THREAD_MODE_SERIALIZED };
    if ((st = ucp_worker_create(n->ctx, &wp, &n->worker)) != UCS_OK)
        goto fail;
    ucp_am_handler_param_t hp = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                      UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
        .id = NET_AM_ID,
        .flags = UCP_AM_FLAG_WHOLE_MSG,
        .cb = sp_net_on_am,
        .arg = eng,
    };
    ucp_address_t *addr;
    if ((st = ucp_worker_set_am_recv_handler(n->worker, &hp)) != UCS_OK ||
        (st = ucp_worker_get_efd(n->worker, &n->efd)) != UCS_OK ||
        (st = ucp_worker_get_address(n->worker, &addr, &n->address_len)) != UCS_OK)
        goto fail;
    n->address = malloc(n->address_len);
    if (n->address == NULL) {
        ucp_worker_release_address(n->worker, addr);
        st = UCS_ERR_NO_MEMORY;
        goto fail;
    }
    memcpy(n->address, addr, n->address_len);
    ucp_worker_release_address(n->worker, addr);
    /* This run, as its links proved it (sp_peers_t.incarnation): the
     * receivers' inboxes restart with it and their keys name it. */
    n->incarnation = incarnation;
    eng->net = n;
    eng->net_ops = &net_ops;
    unsigned major, minor, release;
    ucp_get_version(&major, &minor, &release);
    sp_info(XPORT, "ucx %u.%u.%u: data to other daemons by active messages (worker address %zu bytes)", major, minor,
            release, n->address_len);
    return 0;

fail:
    sp_error(XPORT, "ucx: cannot start the data path to other daemons: %s", ucs_status_string(st));
    if (n->worker != NULL)
        ucp_worker_destroy(n->worker);
    if (n->ctx != NULL)
        ucp_cleanup(n->ctx);
    free(n);
    return -1;
}

void sp_net_cleanup(sp_engine_t *eng)
{
    struct sp_net *n = eng->net;
    if (n == NULL)
        return;
    for (uint32_t i = 0; i < n->neps; i++) {
        if (n->eps[i]->ep != NULL)
            ep_close(n, n->eps[i]);
        free(n->eps[i]);
    }
    for (uint32_t i = 0; i < n->ninboxes; i++)
        sp_net_inbox_clear(&n->inboxes[i]);
    sp_net_kept_clear(n);
    free(n->inboxes);
    free(n->eps);
    free(n->address);
    ucp_worker_destroy(n->worker);
    ucp_cleanup(n->ctx);
    free(n);
    eng->net = NULL;
    eng->net_ops = NULL;
}
