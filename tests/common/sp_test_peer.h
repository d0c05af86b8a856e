/*
 * sp_test_peer.h — the peer protocol spoken by hand, for the tests that attack
 * the links between daemons or claim what only a daemon should: frames read
 * off a socket as they travel, and an insider, a cluster member that is not a
 * daemon (it holds the secret), linked to a daemon as its dialer, with a UCP
 * endpoint to it for data-path messages.
 */
#ifndef SP_TEST_PEER_H
#define SP_TEST_PEER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <ucp/api/ucp.h>

#include "cluster/peer_auth.h"
#include "sp_frame.h"

typedef struct sp_test_frames {
    int     fd;
    uint8_t buf[1 << 16];
    size_t  len;
    bool    eof;
} sp_test_frames_t;

/* The next whole frame (its bytes in *frame, its message returned), or NULL
 * after timeout_ms or at EOF. The frame stays valid until the next call. */
Spd__Msg *sp_test_next_frame(sp_test_frames_t *s, int timeout_ms, uint8_t *frame, size_t *frame_len);

/* Sends m on fd, keeping its encoding in *copy (malloc'd) where copy is not NULL. */
void sp_test_send_msg(int fd, const Spd__Msg *m, uint8_t **copy, size_t *copy_len);

typedef struct sp_test_insider {
    sp_test_frames_t s;
    char             node[64];
    uint64_t         incarnation, their_incarnation;
    uint8_t          transcript[SP_PEER_PROOF_BYTES];
    uint8_t         *their_ucx;
    size_t           their_ucx_len;
    ucp_context_h    ctx;
    ucp_worker_h     worker;
    ucp_ep_h         ep;
} sp_test_insider_t;

/* Dials the daemon at 127.0.0.1:port as `node` and authenticates with secret,
 * as a daemon would; the link is up on the daemon's side once it returns the
 * last proof (sp_test_peer_wait says when). */
void sp_test_insider_link(sp_test_insider_t *x, const char *secret, const char *node, int port);

/* Closes the link and lets UCX's threads stop. */
void sp_test_insider_close(sp_test_insider_t *x);

#endif /* SP_TEST_PEER_H */
