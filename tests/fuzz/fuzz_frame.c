/*
 * fuzz_frame.c — fuzz harness: bytes from a control connection, as spd reads them.
 *
 * The input is what a Unix socket (a client, spctl) or a TCP link (another
 * daemon) delivers: frames back to back. For each frame, as session.c's and
 * peer.c's on_read do, the harness:
 *   1. parses it with sp_frame_parse under the daemon's default frame limit,
 *      and checks that no prefix of the bytes answers differently from the
 *      whole (short of NEED_MORE): a frame that arrives in pieces is judged
 *      as one that arrives at once;
 *   2. decodes its payload as spd.Msg; a message that decodes is encoded and
 *      decoded again, and the two encodings must be the same bytes;
 *   3. makes the checks that spd makes of one message alone, before anything
 *      acts on it: RegisterDeviceReq (with its range and cuMem chunk list)
 *      and StreamCreateReq (handlers.c),
 *      PeerHello and PeerAuth (peer.c), the root node of a job id (job.c),
 *      a mesh spec through the placement (common/sp_place.c), and the status
 *      of an Error through the status table (what a client shows);
 *   4. stops where spd drops the connection, at a frame error; a payload that
 *      does not decode is skipped, as the control socket answers it with an
 *      Error and reads on.
 * Built with libFuzzer (SP_FUZZ=ON) it is fuzzed; otherwise tests/fuzz/replay.c
 * gives it a main() and ctest runs it over tests/fuzz/corpus/frame.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cluster/peer.h"
#include "ctl/server.h"
#include "sp_msg.h"
#include "sp_place.h"

#include "fuzz.h"
#include "core/job.h"

#define SELF_NODE "fuzz-self"

/* Mesh specs are placed over a world of at most this many ranks (the mesh
 * request does not carry the world; the frame's seq stands in for it). */
#define MESH_WORLD_MAX 1024u

/* FUZZ_VERBOSE=1 in the environment: say what became of each frame (for
 * writing seeds; the fuzzer runs quiet). */
static int verbose = -1;

static const uint8_t secret[32] = "a cluster secret, for the fuzzer";
static const uint8_t nonce_a[SP_PEER_NONCE_BYTES] = "the verifier's nonce, 32 bytes!";
static const uint8_t nonce_b[SP_PEER_NONCE_BYTES] = "the prover's nonce, 32 bytes ..";

/* Every prefix of buf[0..len) answers NEED_MORE or what the whole answers. */
static void check_prefixes(const uint8_t *buf, size_t len, sp_frame_result_t whole, const sp_frame_t *f)
{
    size_t upto = whole == SP_FRAME_OK ? f->frame_bytes : len;
    for (size_t k = 0; k < upto && k <= SP_FRAME_HDR_BYTES; k++) {
        sp_frame_t pf;
        sp_frame_result_t r = sp_frame_parse(buf, k, SP_FRAME_DEFAULT_LIMIT, &pf);
        FUZZ_CHECK(r == SP_FRAME_NEED_MORE || (r == whole && r != SP_FRAME_OK), "prefix of %zu bytes: %d, whole: %d", k,
                   (int)r, (int)whole);
    }
    if (whole == SP_FRAME_OK && f->frame_bytes > SP_FRAME_HDR_BYTES) {
        sp_frame_t pf;
        FUZZ_CHECK(sp_frame_parse(buf, f->frame_bytes - 1, SP_FRAME_DEFAULT_LIMIT, &pf) == SP_FRAME_NEED_MORE,
                   "a frame one byte short is not NEED_MORE");
    }
}

/* Whether m, or a message inside it, kept fields that spd.proto does not name. */
static bool has_unknown(const ProtobufCMessage *m)
{
    const ProtobufCMessageDescriptor *d = m->descriptor;
    const char *base = (const char *)m;

    if (m->n_unknown_fields > 0)
        return true;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->type != PROTOBUF_C_TYPE_MESSAGE)
            continue;
        if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) && *(const uint32_t *)(base + f->quantifier_offset) != f->id)
            continue;
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = *(const size_t *)(base + f->quantifier_offset);
            ProtobufCMessage *const *v = *(ProtobufCMessage *const *const *)(base + f->offset);
            for (size_t k = 0; k < n; k++)
                if (has_unknown(v[k]))
                    return true;
        } else {
            const ProtobufCMessage *sub = *(ProtobufCMessage *const *)(base + f->offset);
            if (sub != NULL && has_unknown(sub))
                return true;
        }
    }
    return false;
}

/*
 * Encoding, decoding and encoding again gives the same bytes. protobuf-c keeps
 * the fields a schema does not name and writes them back; it reads a field
 * number 0 written as a long varint, and writes it as one it then refuses. So
 * a message with unknown fields may fail to decode again: spd ignores such
 * fields and never sends a message it received.
 */
static void check_reencode(const Spd__Msg *msg)
{
    uint8_t *a = NULL, *b = NULL;
    size_t alen, blen;
    sp_frame_t f;

    FUZZ_CHECK(sp_msg_encode(msg, &a, &alen) == 0, "a decoded message does not encode");
    FUZZ_CHECK(sp_frame_parse(a, alen, SP_FRAME_MAX_LIMIT, &f) == SP_FRAME_OK && f.frame_bytes == alen,
               "an encoded message is not one whole frame");
    Spd__Msg *again = sp_msg_decode(&f);
    if (again == NULL) {
        FUZZ_CHECK(has_unknown(&msg->base), "an encoded message without unknown fields does not decode");
        free(a);
        return;
    }
    FUZZ_CHECK(again->body_case == msg->body_case && again->seq == msg->seq, "body %d seq %u came back as %d seq %u",
               (int)msg->body_case, msg->seq, (int)again->body_case, again->seq);
    FUZZ_CHECK(sp_msg_encode(again, &b, &blen) == 0, "a re-decoded message does not encode");
    FUZZ_CHECK(alen == blen && memcmp(a, b, alen) == 0, "encodings differ (%zu and %zu bytes)", alen, blen);
    sp_msg_free(again);
    free(a);
    free(b);
}

static void check_job_id(const char *job_id)
{
    char root[SP_NODE_MAX];
    sp_job_root_node(job_id, root);
    size_t n = strlen(root);
    FUZZ_CHECK(n < SP_NODE_MAX && strncmp(root, job_id, n) == 0, "root node of a job id: %zu bytes", n);
}

/* Whether s is made of letters, digits and `allowed` only. */
static bool all_plain(const char *s, const char *allowed)
{
    for (; *s != '\0'; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
              strchr(allowed, *s) != NULL))
            return false;
    return true;
}

/* A named join's name and launch id as spd checks them (sp_job_join_named):
 * what passes is short and plain, and a job id made of it cannot be taken
 * for an id of a created job (those hold ':'). */
static void check_job_name(const char *name, const char *launch)
{
    if (sp_job_name_problem(name) == NULL) {
        size_t n = strlen(name);
        FUZZ_CHECK(n > 0 && n < SP_JOB_NAME_MAX && all_plain(name, SP_JOB_NAME_CHARS) && name[0] != '.' &&
                   name[0] != '_' && name[0] != '-' && strchr(name, ':') == NULL, "job name '%.80s' passed", name);
    }
    if (sp_job_launch_problem(launch) == NULL)
        FUZZ_CHECK(strlen(launch) < SP_JOB_LAUNCH_MAX && all_plain(launch, SP_JOB_LAUNCH_CHARS),
                   "launch id '%.140s' passed", launch);
    /* The client's clean-up makes any text a launch id. */
    char clean[SP_JOB_LAUNCH_MAX];
    snprintf(clean, sizeof clean, "%s", name);
    sp_job_text_clean(clean, SP_JOB_LAUNCH_CHARS);
    FUZZ_CHECK(clean[0] == '\0' || sp_job_launch_problem(clean) == NULL, "cleaned '%s' is no launch id", clean);
}

static void check_mesh(uint32_t seq, const Spd__MeshCreateReq *r)
{
    uint32_t world = seq % MESH_WORLD_MAX + 1;
    sp_place_loc_t *locs = malloc(world * sizeof *locs);
    FUZZ_CHECK(locs != NULL, "out of memory");
    for (uint32_t k = 0; k < world; k++)
        locs[k] = (sp_place_loc_t){ .node = 0, .gpu = -1, .numa = -1 };
    sp_place_spec_t spec = { .sp = r->sp, .ulysses = r->ulysses, .ring = r->ring, .heads = r->heads,
                             .kv_heads = r->kv_heads };
    sp_place_t *p = NULL;
    char err[256];
    if (sp_place_compute(NULL, locs, world, &spec, &p, err, sizeof err) == SPC_OK) {
        FUZZ_CHECK(p->dp * p->sp == world && p->ulysses * p->ring == p->sp, "placed %u x %u (%u x %u) for %u ranks",
                   p->dp, p->sp, p->ulysses, p->ring, world);
        /* Every job rank has exactly one slot. */
        for (uint32_t k = 0; k < world; k++)
            FUZZ_CHECK(p->slot[k] < world && p->order[p->slot[k]] == k, "rank %u: slot %u", k, p->slot[k]);
        if (verbose)
            fprintf(stderr, "    placed: %s\n", p->explain);
        sp_place_free(p);
    } else {
        if (verbose)
            fprintf(stderr, "    not placed: %s\n", err);
        FUZZ_CHECK(memchr(err, '\0', sizeof err) != NULL && err[0] != '\0', "a refusal without a reason");
    }
    free(locs);
}

/* What the driver may be shown as a PCI bus id: 1 to 31 characters. */
static bool bus_id_ok(const char *s)
{
    size_t n = strlen(s);
    return n >= 1 && n <= 31;
}

/* The checks of step 3, by body. */
static void check_body(const Spd__Msg *msg)
{
    sp_err_t e = SP_ERR_INIT;

    FUZZ_CHECK(strlen(sp_msg_body_name(msg)) > 0, "a body without a name");
    switch (msg->body_case) {
    case SPD__MSG__BODY_REGISTER_DEVICE_REQ: {
        const Spd__RegisterDeviceReq *r = msg->register_device_req;
        sp_gpu_export_t x;
        sp_gpu_chunk_t *chunks = NULL;
        if (sp_server_check_register_device(r, &x, &chunks, &e) == SPC_OK) {
            /* What the driver and the import may then rely on. */
            FUZZ_CHECK(r->uuid.len == 16 && bus_id_ok(r->pci_bus_id), "a RegisterDeviceReq passed with a UUID of %zu",
                       r->uuid.len);
            FUZZ_CHECK(x.base != 0 && x.size != 0 && x.base + x.size > x.base && r->length != 0 &&
                       r->offset <= x.size && r->length <= x.size - r->offset, "a device range that does not fit");
            if (x.nchunks == 0) {
                FUZZ_CHECK(r->ipc_handle.len == SP_GPU_IPC_HANDLE_BYTES && chunks == NULL, "an IPC handle of %zu bytes",
                           r->ipc_handle.len);
            } else {
                uint64_t end = 0;
                FUZZ_CHECK(r->ipc_handle.len == 0 && x.nchunks <= SP_DEVICE_MAX_CHUNKS, "%u chunks", x.nchunks);
                for (uint32_t k = 0; k < x.nchunks; k++) {
                    FUZZ_CHECK(chunks[k].fd >= 0 && chunks[k].size > 0 && chunks[k].offset == end &&
                               chunks[k].size <= x.size - end, "chunk %u", k);
                    end += chunks[k].size;
                }
                FUZZ_CHECK(end == x.size, "chunks cover %llu of %llu bytes", (unsigned long long)end,
                           (unsigned long long)x.size);
            }
            free(chunks);
        }
        break;
    }
    case SPD__MSG__BODY_STREAM_CREATE_REQ: {
        const Spd__StreamCreateReq *r = msg->stream_create_req;
        if (sp_server_check_stream_create(r, &e) == SPC_OK)
            FUZZ_CHECK(r->uuid.len == 16 && bus_id_ok(r->pci_bus_id), "a StreamCreateReq passed with a UUID of %zu",
                       r->uuid.len);
        break;
    }
    case SPD__MSG__BODY_PEER_HELLO: {
        const Spd__PeerHello *h = msg->peer_hello;
        uint32_t protocol = 0;
        if (sp_peer_hello_check(h, SELF_NODE, &protocol, &e) == SPC_OK) {
            FUZZ_CHECK(protocol >= SP_PEER_PROTOCOL_MIN && protocol <= SP_PEER_PROTOCOL_VERSION &&
                       protocol >= h->protocol && (protocol == h->protocol || protocol <= h->protocol_max),
                       "a PeerHello passed with peer protocol %u chosen", protocol);
            /* What on_hello does next: keep the name, take the transcript, prove ourselves. */
            uint8_t t[SP_PEER_PROOF_BYTES], other[SP_PEER_PROOF_BYTES], proof[SP_PEER_PROOF_BYTES];
            FUZZ_CHECK(h->nonce.len == SP_PEER_NONCE_BYTES && strlen(h->node) < 64, "a PeerHello passed");
            sp_peer_transcript(h->nonce.data, h->nonce.len, nonce_a, sizeof nonce_a, t);
            sp_peer_transcript(nonce_a, sizeof nonce_a, h->nonce.data, h->nonce.len, other);
            /* The two orders hash alike only when both sides sent the same bytes. */
            bool same = h->nonce.len == sizeof nonce_a && memcmp(h->nonce.data, nonce_a, sizeof nonce_a) == 0;
            FUZZ_CHECK(same || memcmp(t, other, sizeof t) != 0, "the transcript ignores who dialled");
            sp_peer_proof(secret, sizeof secret, SP_PEER_STEP_DIALER, t, NULL, 0, proof);
            /* A proof made with the secret checks at its step only, over its transcript only. */
            Spd__PeerAuth a = SPD__PEER_AUTH__INIT;
            a.proof.data = proof;
            a.proof.len = sizeof proof;
            FUZZ_CHECK(sp_peer_auth_check(secret, sizeof secret, SP_PEER_STEP_DIALER, t, &a), "own proof refused");
            FUZZ_CHECK(same || !sp_peer_auth_check(secret, sizeof secret, SP_PEER_STEP_DIALER, other, &a),
                       "a proof for another transcript");
            a.ucx_address.data = (uint8_t *)nonce_b;
            a.ucx_address.len = sizeof nonce_b;
            FUZZ_CHECK(!sp_peer_auth_check(secret, sizeof secret, SP_PEER_STEP_ACCEPTOR, t, &a),
                       "a dialer's proof taken as the acceptor's");
        }
        break;
    }
    case SPD__MSG__BODY_PEER_AUTH: {
        /* Nothing the fuzzer writes holds the secret, at any step. */
        uint8_t t[SP_PEER_PROOF_BYTES];
        sp_peer_transcript(nonce_a, sizeof nonce_a, nonce_b, sizeof nonce_b, t);
        for (int step = SP_PEER_STEP_DIALER; step <= SP_PEER_STEP_DIALER_ADDRESS; step++)
            FUZZ_CHECK(!sp_peer_auth_check(secret, sizeof secret, (sp_peer_step_t)step, t, msg->peer_auth),
                       "a forged PeerAuth passed");
        break;
    }
    case SPD__MSG__BODY_JOB_JOIN_REQ:
        check_job_id(msg->job_join_req->job_id);
        check_job_name(msg->job_join_req->name, msg->job_join_req->launch);
        break;
    case SPD__MSG__BODY_PEER_JOIN:
        check_job_id(msg->peer_join->job_id);
        (void)sp_job_launch_problem(msg->peer_join->launch);
        break;
    case SPD__MSG__BODY_PEER_NAME_QUERY:
        (void)sp_job_name_problem(msg->peer_name_query->name);
        break;
    case SPD__MSG__BODY_PEER_NAME_REP:
        (void)sp_job_name_problem(msg->peer_name_rep->name);
        (void)sp_job_launch_problem(msg->peer_name_rep->launch);
        break;
    case SPD__MSG__BODY_JOB_READY:
        check_job_id(msg->job_ready->job_id);
        for (size_t k = 0; k < msg->job_ready->n_rank_node; k++)
            (void)strlen(msg->job_ready->rank_node[k]);
        break;
    case SPD__MSG__BODY_MESH_CREATE_REQ:
        check_mesh(msg->seq, msg->mesh_create_req);
        break;
    case SPD__MSG__BODY_ERROR: {
        /* What spc_call does with a daemon's Error: a non-negative status is a protocol error. */
        spc_status_t st = (spc_status_t)msg->error->status;
        if (st >= 0)
            st = SPC_ERR_PROTOCOL;
        FUZZ_CHECK(spc_status_name(st) != NULL && spc_status_message(st) != NULL, "status %d", (int)st);
        (void)strlen(msg->error->detail);
        break;
    }
    default:
        break;
    }
    if (verbose && e.status != SPC_OK)
        fprintf(stderr, "    refused: %s\n", e.msg);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    size_t off = 0;

    if (verbose < 0)
        verbose = getenv("FUZZ_VERBOSE") != NULL;
    for (;;) {
        sp_frame_t f;
        sp_frame_result_t r = sp_frame_parse(data + off, size - off, SP_FRAME_DEFAULT_LIMIT, &f);
        check_prefixes(data + off, size - off, r, &f);
        if (r != SP_FRAME_OK) {
            if (verbose)
                fprintf(stderr, "  %zu bytes left: %s\n", size - off, sp_frame_result_str(r));
            FUZZ_CHECK(strlen(sp_frame_result_str(r)) > 0, "result %d has no text", (int)r);
            return 0;
        }
        FUZZ_CHECK(f.frame_bytes == SP_FRAME_HDR_BYTES + f.length && f.frame_bytes <= size - off,
                   "frame of %zu bytes with %zu left", f.frame_bytes, size - off);
        Spd__Msg *msg = sp_msg_decode(&f);
        off += f.frame_bytes;
        if (verbose)
            fprintf(stderr, "  frame of %u bytes: %s\n", f.length, msg ? sp_msg_body_name(msg) : "does not decode");
        if (msg == NULL)
            continue;
        check_reencode(msg);
        check_body(msg);
        sp_msg_free(msg);
    }
}
