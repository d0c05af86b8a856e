/*
 * peer_auth.h — the proofs of the links between daemons (peer_auth.c has the
 * why; spd.proto the messages).
 */
#ifndef SP_PEER_AUTH_H
#define SP_PEER_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "spclient/status.h"
#include "base/err.h"
#include "spd.pb-c.h"

#define SP_PEER_NONCE_BYTES 32
#define SP_PEER_PROOF_BYTES 32
#define SP_PEER_SECRET_MAX  4096
#define SP_PEER_KEY_BYTES   32
#define SP_PEER_NODE_MAX    64   /* a node name and its NUL */
/* The largest frame a link we accepted may send before its proof checks: a
 * hello or a proof, no more (the proofs name no address until then). */
#define SP_PEER_HELLO_FRAME_MAX 4096

/* The proofs of a link, in the order they are sent (spd.proto, PeerAuth). */
typedef enum sp_peer_step {
    SP_PEER_STEP_DIALER,           /* the dialer's, first */
    SP_PEER_STEP_ACCEPTOR,         /* the acceptor's, with its address, once it checked the dialer's */
    SP_PEER_STEP_DIALER_ADDRESS,   /* the dialer's address, once it checked the acceptor's */
} sp_peer_step_t;

/* The transcript of a link: both PeerHello frames as sent, the dialer's first. */
void sp_peer_transcript(const uint8_t *dialer_hello, size_t dialer_len, const uint8_t *acceptor_hello,
                        size_t acceptor_len, uint8_t out[SP_PEER_PROOF_BYTES]);
/* A proof (spd.proto, PeerAuth): the step's label, the transcript and the address it carries. */
void sp_peer_proof(const uint8_t *secret, size_t secret_len, sp_peer_step_t step,
                   const uint8_t transcript[SP_PEER_PROOF_BYTES], const void *addr, size_t addr_len,
                   uint8_t out[SP_PEER_PROOF_BYTES]);
/* The key that seals data-path messages from one run of a node to one run of another. */
void sp_peer_data_key(const uint8_t *secret, size_t secret_len, const char *from_node, uint64_t from_incarnation,
                      const char *to_node, uint64_t to_incarnation, uint8_t out[SP_PEER_KEY_BYTES]);

/* What a link checks of the other end's messages alone (pure functions: the
 * fuzzer of tests/fuzz calls them without a link). A PeerHello: SPC_OK with
 * *protocol_p the highest peer protocol both ends speak (both ends pick the
 * same from the two hellos), or SPC_ERR_PROTOCOL (no protocol in common, node
 * name, nonce) or SPC_ERR_INVALID_ARG (it names this node) with the reason in
 * detail. A PeerAuth: whether its proof is the one the prover owes (compared
 * in constant time). */
spc_status_t sp_peer_hello_check(const Spd__PeerHello *h, const char *self_node, uint32_t *protocol_p, sp_err_t *e);
/* Whether a proof is the one `step` owes over `transcript`, with an address exactly where that step carries one. */
bool sp_peer_auth_check(const uint8_t *secret, size_t secret_len, sp_peer_step_t step,
                        const uint8_t transcript[SP_PEER_PROOF_BYTES], const Spd__PeerAuth *a);

/* Reads a cluster secret from path (the file of `option`, named in what is
 * logged): a regular file no other user may read, of at least 16 bytes once
 * trailing blanks go. Returns 0, or -1 (logged). */
int sp_peer_read_secret(const char *path, const char *option, uint8_t secret[SP_PEER_SECRET_MAX], size_t *len_p);
/* A short name of a secret that does not reveal it, for logs and spctl status: 16 hex digits
 * of HMAC-SHA256(secret, "spd-secret-id"). */
void sp_peer_secret_id(const uint8_t *secret, size_t secret_len, char out[17]);

#endif /* SP_PEER_AUTH_H */
