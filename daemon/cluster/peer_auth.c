/*
 * peer_auth.c — what the links between daemons prove, and with what: the
 * transcript, the proofs, the data-path keys, the checks of a hello and of a
 * proof, and the cluster secret file. Pure functions of their arguments (but
 * for reading the file), so that tests/fuzz runs the code spd runs. Why the
 * proofs are what they are (mutual, ordered, bound to one link and role):
 * docs/architecture.md, "What the proofs prove: peer_auth.c".
 */
#include "cluster/peer_auth.h"

#include <errno.h>
#include <fcntl.h>
#include <sodium.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/log.h"
#include "sp_msg.h"
#include "version.h"

#define PEER_LABEL "spd-peer-2"

static const char *step_label(sp_peer_step_t step)
{
    switch (step) {
    case SP_PEER_STEP_DIALER:         return PEER_LABEL " dialer";
    case SP_PEER_STEP_ACCEPTOR:       return PEER_LABEL " acceptor";
    case SP_PEER_STEP_DIALER_ADDRESS: return PEER_LABEL " dialer address";
    }
    return "?";
}

static void hash_framed(crypto_hash_sha256_state *st, const uint8_t *bytes, size_t len)
{
    uint8_t n[8];
    for (int i = 0; i < 8; i++)
        n[i] = (uint8_t)((uint64_t)len >> (8 * i));
    crypto_hash_sha256_update(st, n, sizeof n);
    crypto_hash_sha256_update(st, bytes, len);
}

void sp_peer_transcript(const uint8_t *dialer_hello, size_t dialer_len, const uint8_t *acceptor_hello,
                        size_t acceptor_len, uint8_t out[SP_PEER_PROOF_BYTES])
{
    crypto_hash_sha256_state st;
    crypto_hash_sha256_init(&st);
    hash_framed(&st, (const uint8_t *)PEER_LABEL, sizeof PEER_LABEL - 1);
    hash_framed(&st, dialer_hello, dialer_len);
    hash_framed(&st, acceptor_hello, acceptor_len);
    crypto_hash_sha256_final(&st, out);
}

void sp_peer_proof(const uint8_t *secret, size_t secret_len, sp_peer_step_t step,
                   const uint8_t transcript[SP_PEER_PROOF_BYTES], const void *addr, size_t addr_len,
                   uint8_t out[SP_PEER_PROOF_BYTES])
{
    const char *label = step_label(step);
    crypto_auth_hmacsha256_state st;
    crypto_auth_hmacsha256_init(&st, secret, secret_len);
    crypto_auth_hmacsha256_update(&st, (const unsigned char *)label, strlen(label) + 1);
    crypto_auth_hmacsha256_update(&st, transcript, SP_PEER_PROOF_BYTES);
    crypto_auth_hmacsha256_update(&st, addr, addr_len);
    crypto_auth_hmacsha256_final(&st, out);
    sodium_memzero(&st, sizeof st);
}

void sp_peer_data_key(const uint8_t *secret, size_t secret_len, const char *from_node, uint64_t from_incarnation,
                      const char *to_node, uint64_t to_incarnation, uint8_t out[SP_PEER_KEY_BYTES])
{
    static const char label[] = PEER_LABEL " data";
    uint8_t inc[8];
    crypto_auth_hmacsha256_state st;
    crypto_auth_hmacsha256_init(&st, secret, secret_len);
    crypto_auth_hmacsha256_update(&st, (const unsigned char *)label, sizeof label);
    crypto_auth_hmacsha256_update(&st, (const unsigned char *)from_node, strlen(from_node) + 1);
    for (int i = 0; i < 8; i++)
        inc[i] = (uint8_t)(from_incarnation >> (8 * i));
    crypto_auth_hmacsha256_update(&st, inc, sizeof inc);
    crypto_auth_hmacsha256_update(&st, (const unsigned char *)to_node, strlen(to_node) + 1);
    for (int i = 0; i < 8; i++)
        inc[i] = (uint8_t)(to_incarnation >> (8 * i));
    crypto_auth_hmacsha256_update(&st, inc, sizeof inc);
    crypto_auth_hmacsha256_final(&st, out);
    sodium_memzero(&st, sizeof st);
}

spc_status_t sp_peer_hello_check(const Spd__PeerHello *h, const char *self_node, uint32_t *protocol_p, sp_err_t *e)
{
    uint32_t hi = h->protocol_max > h->protocol ? h->protocol_max : h->protocol;
    uint32_t protocol = sp_protocol_pick(h->protocol, hi, SP_PEER_PROTOCOL_MIN, SP_PEER_PROTOCOL_VERSION);
    if (protocol == 0)   /* which side is behind, so that the log says what to upgrade */
        return sp_err_set(e, SPC_ERR_PROTOCOL, "peer (spd %s) speaks peer protocols %u to %u, this spd %s %u to %u: "
                          "upgrade %s (proto/sp_msg.h says what each peer protocol changed)", h->version, h->protocol,
                          hi, SPD_VERSION, SP_PEER_PROTOCOL_MIN, SP_PEER_PROTOCOL_VERSION,
                          hi < SP_PEER_PROTOCOL_MIN ? "the peer's spd" : "this spd");
    size_t n = strlen(h->node);
    if (n == 0 || n >= SP_PEER_NODE_MAX || h->nonce.len != SP_PEER_NONCE_BYTES)
        return sp_err_set(e, SPC_ERR_PROTOCOL, "PeerHello without a node name (under 64 bytes) and a 32-byte nonce");
    if (strcmp(h->node, self_node) == 0)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "the other end is node %s too (this daemon itself, or two nodes "
                          "named alike)", self_node);
    *protocol_p = protocol;
    return SPC_OK;
}

bool sp_peer_auth_check(const uint8_t *secret, size_t secret_len, sp_peer_step_t step,
                        const uint8_t transcript[SP_PEER_PROOF_BYTES], const Spd__PeerAuth *a)
{
    /* The dialer's first proof comes before it may know where our data goes,
     * so it carries no address; the other two must. */
    bool want_addr = step != SP_PEER_STEP_DIALER;
    if (a->proof.len != SP_PEER_PROOF_BYTES || (a->ucx_address.len > 0) != want_addr)
        return false;
    uint8_t want[SP_PEER_PROOF_BYTES];
    sp_peer_proof(secret, secret_len, step, transcript, a->ucx_address.data, a->ucx_address.len, want);
    return crypto_verify_32(a->proof.data, want) == 0;
}

int sp_peer_read_secret(const char *path, const char *option, uint8_t secret[SP_PEER_SECRET_MAX], size_t *len_p)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        sp_error(CFG, "%s %s: %s", option, path, strerror(errno));
        return -1;
    }
    struct stat st;
    ssize_t n = -1;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        sp_error(CFG, "%s %s is not a regular file", option, path);
    } else if (st.st_mode & 077) {
        sp_error(CFG, "%s %s is open to other users (mode %03o); chmod 600 it", option, path,
                 (unsigned)(st.st_mode & 0777));
    } else if ((n = read(fd, secret, SP_PEER_SECRET_MAX)) < 0) {
        sp_error(CFG, "%s %s: %s", option, path, strerror(errno));
    }
    close(fd);
    if (n < 0)
        return -1;
    while (n > 0 && (secret[n - 1] == '\n' || secret[n - 1] == '\r' || secret[n - 1] == ' ' ||
                     secret[n - 1] == '\t'))
        n--;
    if (n < 16) {
        sp_error(CFG, "%s %s holds %zd bytes; use a secret of at least 16", option, path, n);
        return -1;
    }
    *len_p = (size_t)n;
    return 0;
}

void sp_peer_secret_id(const uint8_t *secret, size_t secret_len, char out[17])
{
    static const char label[] = "spd-secret-id";
    uint8_t mac[crypto_auth_hmacsha256_BYTES];
    crypto_auth_hmacsha256_state st;
    crypto_auth_hmacsha256_init(&st, secret, secret_len);
    crypto_auth_hmacsha256_update(&st, (const unsigned char *)label, sizeof label - 1);
    crypto_auth_hmacsha256_final(&st, mac);
    sodium_memzero(&st, sizeof st);
    for (int i = 0; i < 8; i++)
        snprintf(out + 2 * i, 3, "%02x", mac[i]);
}
