/*
 * net_int.h — what the files of the data path share (net.c says how it
 * works): the worker's state, its endpoints, the inboxes of what came, and
 * the calls between them. net.c starts the worker and its endpoints,
 * net_recv.c delivers what comes, net_send.c sends, net_wire.c checks a
 * message's bytes. Every call holds the engine lock.
 */
#ifndef SP_NET_INT_H
#define SP_NET_INT_H

#include <stdalign.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <ucp/api/ucp.h>

#include "cluster/net.h"
#include "cluster/net_wire.h"
#include "core/client.h"
#include "core/coll.h"
#include "core/engine.h"
#include "core/job.h"
#include "core/ops.h"
#include "core/stage.h"
#include "core/transport.h"

#define NET_AM_ID 1

/* A received message; the remote ops made from it hold references. */
struct sp_stage {
    sp_stage_t  *next;         /* in its inbox, by msgno */
    sp_engine_t *eng;
    bool         ready;        /* the payload is in */
    uint32_t     refs;
    uint64_t     arrived_ns;
    uint64_t     msgno;
    const char  *from;         /* hdr.from */
    sp_wire_hdr_t hdr;
    size_t       len;
    size_t       charged;      /* what it counts in its inbox's queued_bytes */
    alignas(SP_WIRE_ALIGN) uint8_t data[];   /* the payload; its tensors at multiples of SP_WIRE_ALIGN */
};

typedef struct net_ep {
    char     node[SP_NODE_MAX];
    ucp_ep_h ep;
    uint64_t next_out;   /* number of the next message to it */
    uint8_t  key[SP_WIRE_MAC_BYTES];   /* seals what goes to it */
} net_ep_t;

/* What came from one daemon, delivered in its order. */
typedef struct inbox {
    char        node[SP_NODE_MAX];
    bool        live;         /* its link is authenticated: messages are taken */
    uint64_t    incarnation;  /* the run its link proved */
    uint8_t     key[SP_WIRE_MAC_BYTES];
    uint64_t    next;         /* msgno to deliver next */
    sp_stage_t *queue;        /* by msgno */
    uint32_t    queued;       /* in queue, and their bytes: bounded by peer_inbox_msgs and _bytes */
    uint64_t    queued_bytes;
    char        broken[SP_DETAIL_BYTES];   /* why its stream cannot go on; "" when it can */
} inbox_t;
/* A message this daemon sent, kept in case its receiver restarts before it
 * completes the collective (peer_restart_grace_ms > 0): of the last NET_KEPT
 * sent per (job, group, channel, node), those peer_restart_keep_bytes holds
 * beside the others. A collective this daemon completed with
 * the receiver's inputs, which the receiver then lost, runs there again from
 * this copy: the inputs of this daemon's ranks may be overwritten since. A
 * message held back while the job waits for its node is kept the same way,
 * and goes when the node takes the job back, though its collective may have
 * completed here meanwhile. The copy of an op on GPU memory holds only
 * descriptors: it goes only as held. */
#define NET_KEPT 2   /* a rank that waits for each op runs at most one collective ahead of another */

typedef struct net_kept {
    struct net_kept *next;
    char      job[SP_JOB_ID_MAX];
    char      node[SP_NODE_MAX];
    uint32_t  group_index, channel, nranks;
    uint64_t  seq;
    bool      held;    /* not sent: the job waited for that node; it goes when the node takes the job back */
    bool      device;  /* an op on GPU memory: its inputs went by NCCL, so the copy cannot run it again */
    size_t    len;
    uint8_t  *bytes;   /* the payload as sent: descriptors, then inputs */
} net_kept_t;

struct sp_net {
    ucp_context_h ctx;
    ucp_worker_h  worker;
    void         *address;
    size_t        address_len;
    int           efd;
    net_ep_t    **eps;          /* each its own allocation: the error handler keeps a pointer */
    uint32_t      neps;
    inbox_t      *inboxes;
    uint32_t      ninboxes;
    uint64_t      incarnation;
    bool          delivering;   /* guards the inboxes against re-entry */
    uint64_t      dropped;      /* messages dropped unread (sp_net_dropped) */
    uint64_t      dropped_logged;
    uint64_t      drop_logged_ns;
    uint64_t      staged;       /* registered memory read for the messages in flight */
    net_kept_t   *kept;
    uint64_t      kept_bytes;   /* of the copies in kept, at most peer_restart_keep_bytes */
    uint64_t      not_kept;     /* messages past that bound, or out of memory, since start */
};

/* The op table's answers, as both ends of a message ask them. */

/* Whether the op's inputs travel as the slices their readers read. */
static inline bool net_sliced(const sp_op_t *op)
{
    return sp_op_kind(op->sqe.opcode)->slices != NULL;
}

/* Whether daemon `node` (a job node index) reads input tensors of group rank r. */
static inline bool net_node_reads(const sp_group_t *g, const sp_op_t *op, uint32_t r, uint32_t node)
{
    return sp_op_kind(op->sqe.opcode)->reads(g, op, r, node);
}

static inline bool net_is_input(const sp_op_t *op, uint32_t r, uint32_t i)
{
    return sp_op_kind(op->sqe.opcode)->input(&op->sqe, r, i);
}

/* net.c: the endpoint to node, NULL when none. */
net_ep_t *sp_net_ep_find(struct sp_net *n, const char *node);

/* net_recv.c: the inboxes and what they deliver. */
inbox_t *sp_net_inbox_find(struct sp_net *n, const char *node);
void     sp_net_inbox_clear(inbox_t *in);
/* Delivers what is next in line from in's daemon; returns how many. */
int      sp_net_inbox_drain(sp_engine_t *eng, inbox_t *in);
/* The worker's active-message handler (arg: the engine). */
ucs_status_t sp_net_on_am(void *arg, const void *header, size_t header_length, void *data, size_t length,
                          const ucp_am_recv_param_t *param);
/* Lets go of a remote op's share of its stage (NULL: none). */
void     sp_net_stage_unref(sp_stage_t *st);

/* net_send.c: the transport's send_coll. */
int      sp_net_send_coll(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll);
/* Answers a message `in` for a collective this daemon's ranks of g are past
 * (it ran or failed here before the sender's daemon restarted): its ranks'
 * descriptors, each failed with SPC_ERR_RESTARTED and detail, which fail the
 * collective there. sqe: the message's first op's, for the kind. */
void     sp_net_send_overtaken(sp_engine_t *eng, sp_group_t *g, const sp_wire_hdr_t *in, const struct sp_sqe *sqe,
                               const char *detail);
/* Sends again, to the node of message `in`, the copy kept of this daemon's
 * message for the same collective: false when none is kept. */
bool     sp_net_send_kept(sp_engine_t *eng, sp_group_t *g, const sp_wire_hdr_t *in);
/* Frees every copy kept (at exit). */
void     sp_net_kept_clear(struct sp_net *n);
/* The transport's group_gone: frees the copies kept of the group's messages. */
void     sp_net_group_gone(sp_engine_t *eng, const char *job, uint32_t group_index);

#endif /* SP_NET_INT_H */
