/*
 * net_wire.h — what one daemon sends another on the data path (net.c), and
 * the checks the receiver makes of it before any of it is used.
 *
 * A message is an active message header (sp_wire_hdr_t) and a payload: for a
 * collective, the descriptors of the sender's ranks (sp_wire_rank_t, back to
 * back from byte 0), then the inputs the receiver's ranks read, each at a
 * multiple of SP_WIRE_ALIGN. Every byte of it is another daemon's word: a peer
 * of another version, or a message damaged on the way, must cost the receiver
 * the message, never its memory. These checks (net_wire.c) are apart from the
 * UCX plumbing so that tests/fuzz/fuzz_peer.c runs the code spd runs on any bytes.
 */
#ifndef SP_NET_WIRE_H
#define SP_NET_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "core/client.h"
#include "core/job.h"

#define SP_WIRE_MAGIC 0x73706e33u   /* "spn3": follows SP_PEER_PROTOCOL_VERSION */
#define SP_WIRE_MAC_BYTES 32
#define SP_WIRE_ALIGN 64            /* every input starts on a cache line of the receiver's stage */

/* A collective's message sent again after a daemon restarted (net_send.c,
 * kept copies): a receiver past that collective drops it, never answers it. */
#define SP_WIRE_AGAIN 1u

enum sp_wire_kind {
    SP_WIRE_COLL = 1,        /* ranks' descriptors and inputs for one collective */
    SP_WIRE_RANK_LOST = 2,   /* a rank of the sender left the job; payload: why */
};

/* The active message header. */
typedef struct sp_wire_hdr {
    uint32_t magic;
    uint32_t kind;
    char     from[SP_NODE_MAX];   /* the sending daemon's node */
    uint64_t incarnation;         /* the sender's run: numbering restarts with it */
    uint64_t msgno;               /* per (sender, receiver), from 0 */
    char     job[SP_JOB_ID_MAX];
    uint32_t nranks;              /* SP_WIRE_COLL */
    uint32_t group_index;         /* SP_WIRE_COLL */
    uint32_t channel;             /* SP_WIRE_COLL */
    uint32_t rank;                /* SP_WIRE_RANK_LOST: job rank; SP_WIRE_COLL: SP_WIRE_AGAIN or 0 */
    uint64_t seq;                 /* SP_WIRE_COLL */
    uint8_t  mac[SP_WIRE_MAC_BYTES];   /* sp_net_header_seal: binds all of the above to the link's key */
} sp_wire_hdr_t;

/* One rank's descriptor at the start of the payload; its inputs follow. */
typedef struct sp_wire_rank {
    uint32_t             grank;
    int32_t              local_status;
    char                 local_detail[SP_DETAIL_BYTES];
    struct sp_sqe        sqe;
    struct sp_tensor_ref tensor[SP_MAX_TENSORS];
    uint64_t             need[SP_MAX_TENSORS];
    uint8_t              params[sizeof(((sp_op_t *)0)->params)];
    uint64_t             off[SP_MAX_TENSORS];   /* input i in the payload; UINT64_MAX: not carried */
    uint64_t             plen[SP_MAX_TENSORS];  /* its bytes there: need[i], or the packed slices' */
    uint32_t             packed;                /* bit i: input i is packed slices (sp_a2a_ranges order) */
    uint32_t             memory;                /* 0: host; 1 + g: the sender's GPU g (its inputs go by NCCL) */
} sp_wire_rank_t;

/* One descriptor of a collective's message, as the receiver took it. */
typedef struct sp_wire_arrival {
    uint32_t grank;   /* its group rank */
    sp_op_t *op;      /* NULL: refused */
} sp_wire_arrival_t;

/* Copies a message's header out of the bytes UCX gives (which it does not
 * align) into *hdr_p. False when they are not a header of ours: another size
 * or magic, an unknown kind, a node or job name without its NUL. */
bool sp_net_header_read(const void *bytes, size_t len, sp_wire_hdr_t *hdr_p);

/*
 * The header's MAC: HMAC-SHA256 under the key of (sender's run, receiver's
 * run) that their link agreed (sp_peer_data_key), over every header byte as
 * sent but the MAC and over the payload's length. Seal sets it; check says
 * whether a received header carries it. A message that does not check was not
 * sent by the node it names, to this run, on this key: it is dropped unread.
 * The payload is not covered (tensors are too big to hash at line rate): an
 * attacker on the path can change data, as it can read it (docs/operations.md).
 */
void sp_net_header_seal(sp_wire_hdr_t *h, uint64_t payload_len, const uint8_t key[SP_WIRE_MAC_BYTES]);
bool sp_net_header_check(const sp_wire_hdr_t *h, uint64_t payload_len, const uint8_t key[SP_WIRE_MAC_BYTES]);

/*
 * Takes a collective's message (header h, payload[0, len)) that another
 * daemon sent for group g. Returns h->nranks, with arrivals[k] for descriptor
 * k: its op, or NULL where the descriptor is refused (e says why, for the
 * first one refused). Returns -1 (e set) when the whole message is refused:
 * a channel out of range, a sender that is no other daemon of g's job, more
 * descriptors than g has ranks or than the payload holds. arrivals has room
 * for g->size.
 * An op it makes is a rank of another daemon (client and stage NULL): each
 * input this daemon's ranks read points into the payload, which must outlive
 * the op, or into a buffer of the op's own (op->own, freed with the op).
 */
int sp_net_coll_take(const sp_group_t *g, const sp_wire_hdr_t *h, const uint8_t *payload, size_t len,
                     sp_wire_arrival_t *arrivals, sp_err_t *e);

#endif /* SP_NET_WIRE_H */
