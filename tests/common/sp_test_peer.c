/*
 * sp_test_peer.c — the peer protocol spoken by hand (sp_test_peer.h).
 */
#include "sp_test_peer.h"

#include <poll.h>
#include <sodium.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sp_test.h"

Spd__Msg *sp_test_next_frame(sp_test_frames_t *s, int timeout_ms, uint8_t *frame, size_t *frame_len)
{
    uint64_t end = sp_test_now_ms() + (uint64_t)timeout_ms;
    for (;;) {
        sp_frame_t f;
        sp_frame_result_t r = sp_frame_parse(s->buf, s->len, sizeof s->buf - SP_FRAME_HDR_BYTES, &f);
        if (r == SP_FRAME_OK) {
            Spd__Msg *m = sp_msg_decode(&f);
            CHECK(m != NULL);
            memcpy(frame, s->buf, f.frame_bytes);
            *frame_len = f.frame_bytes;
            memmove(s->buf, s->buf + f.frame_bytes, s->len - f.frame_bytes);
            s->len -= f.frame_bytes;
            return m;
        }
        CHECK(r == SP_FRAME_NEED_MORE);
        int left = (int)(end - sp_test_now_ms());
        struct pollfd p = { .fd = s->fd, .events = POLLIN };
        if (s->eof || left <= 0 || poll(&p, 1, left) <= 0)
            return NULL;
        ssize_t n = read(s->fd, s->buf + s->len, sizeof s->buf - s->len);
        if (n <= 0) {
            s->eof = true;
            return NULL;
        }
        s->len += (size_t)n;
    }
}

void sp_test_send_msg(int fd, const Spd__Msg *m, uint8_t **copy, size_t *copy_len)
{
    uint8_t *buf;
    size_t len;
    CHECK(sp_msg_encode(m, &buf, &len) == 0);
    CHECK(write(fd, buf, len) == (ssize_t)len);
    if (copy != NULL) {
        *copy = buf;
        *copy_len = len;
    } else {
        free(buf);
    }
}

static void send_proof(sp_test_insider_t *x, const char *secret, sp_peer_step_t step, const void *addr, size_t len)
{
    uint8_t proof[SP_PEER_PROOF_BYTES];
    sp_peer_proof((const uint8_t *)secret, strlen(secret), step, x->transcript, addr, len, proof);
    Spd__Msg m = SPD__MSG__INIT;
    Spd__PeerAuth pa = SPD__PEER_AUTH__INIT;
    pa.proof = (ProtobufCBinaryData){ sizeof proof, proof };
    pa.ucx_address = (ProtobufCBinaryData){ len, (uint8_t *)addr };
    m.body_case = SPD__MSG__BODY_PEER_AUTH;
    m.peer_auth = &pa;
    sp_test_send_msg(x->s.fd, &m, NULL, NULL);
}

void sp_test_insider_link(sp_test_insider_t *x, const char *secret, const char *node, int port)
{
    static uint8_t frame[1 << 16];
    size_t flen;
    memset(x, 0, sizeof *x);
    snprintf(x->node, sizeof x->node, "%s", node);
    randombytes_buf(&x->incarnation, sizeof x->incarnation);

    ucp_config_t *cfg;
    CHECK(ucp_config_read(NULL, NULL, &cfg) == UCS_OK);
    ucp_params_t cp = { .field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_AM };
    CHECK(ucp_init(&cp, cfg, &x->ctx) == UCS_OK);
    ucp_config_release(cfg);
    ucp_worker_params_t wp = { .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                               .thread_mode = UCS_THREAD_MODE_SINGLE };
    CHECK(ucp_worker_create(x->ctx, &wp, &x->worker) == UCS_OK);
    ucp_address_t *mine;
    size_t mine_len;
    CHECK(ucp_worker_get_address(x->worker, &mine, &mine_len) == UCS_OK);

    x->s.fd = sp_test_tcp_connect(NULL, port);
    uint8_t nonce[SP_PEER_NONCE_BYTES], *hello;
    size_t hello_len;
    randombytes_buf(nonce, sizeof nonce);
    Spd__Msg m = SPD__MSG__INIT;
    Spd__PeerHello ph = SPD__PEER_HELLO__INIT;
    ph.protocol = SP_PEER_PROTOCOL_VERSION;
    ph.node = x->node;
    ph.nonce = (ProtobufCBinaryData){ sizeof nonce, nonce };
    ph.version = "insider";
    ph.incarnation = x->incarnation;
    m.body_case = SPD__MSG__BODY_PEER_HELLO;
    m.peer_hello = &ph;
    sp_test_send_msg(x->s.fd, &m, &hello, &hello_len);

    Spd__Msg *r = sp_test_next_frame(&x->s, 5000, frame, &flen);
    CHECK(r != NULL && r->body_case == SPD__MSG__BODY_PEER_HELLO);
    x->their_incarnation = r->peer_hello->incarnation;
    sp_msg_free(r);
    sp_peer_transcript(hello, hello_len, frame, flen, x->transcript);
    free(hello);
    send_proof(x, secret, SP_PEER_STEP_DIALER, NULL, 0);

    r = sp_test_next_frame(&x->s, 5000, frame, &flen);
    CHECK(r != NULL && r->body_case == SPD__MSG__BODY_PEER_AUTH);
    CHECK(sp_peer_auth_check((const uint8_t *)secret, strlen(secret), SP_PEER_STEP_ACCEPTOR, x->transcript,
                             r->peer_auth));
    x->their_ucx_len = r->peer_auth->ucx_address.len;
    x->their_ucx = malloc(x->their_ucx_len);
    CHECK(x->their_ucx != NULL);
    memcpy(x->their_ucx, r->peer_auth->ucx_address.data, x->their_ucx_len);
    sp_msg_free(r);
    send_proof(x, secret, SP_PEER_STEP_DIALER_ADDRESS, mine, mine_len);
    ucp_worker_release_address(x->worker, mine);

    ucp_ep_params_t ep = { .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
                           .address = (ucp_address_t *)x->their_ucx,
                           .err_mode = UCP_ERR_HANDLING_MODE_PEER };   /* as spd's: UCX wants both ends alike */
    CHECK(ucp_ep_create(x->worker, &ep, &x->ep) == UCS_OK);
}

void sp_test_insider_close(sp_test_insider_t *x)
{
    ucp_ep_destroy(x->ep);
    ucp_worker_destroy(x->worker);
    ucp_cleanup(x->ctx);
    free(x->their_ucx);
    close(x->s.fd);
    memset(x, 0, sizeof *x);
}
