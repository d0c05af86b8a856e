/*
 * seeds.c — writes the seed corpora of the fuzz harnesses:
 *
 *   fuzz_seeds DIR     DIR/frame/seed-*: a frame of every spd.Msg body, as the
 *                      daemon, its clients and its peers send them, and a few
 *                      streams of frames; DIR/validate/seed-*: valid SQ entries
 *                      of every opcode (host and GPU memory, every kind of
 *                      all-to-all), and ops that validation or agreement refuse;
 *                      DIR/http/seed-*: requests to the metrics endpoint, each
 *                      status it answers, and heads at and past its limit;
 *                      DIR/peer/seed-*: messages of the data path between
 *                      daemons, of every opcode, as net.c sends them (host and
 *                      GPU memory, a refused rank, a lost rank), and messages
 *                      and descriptors that the receiver refuses.
 *
 * The seeds are written by the encoders the product uses (sp_msg_encode, the
 * structs of sp_shm.h and net_wire.h, sp_op_validate for the bytes an op
 * spans, the op table's slices for those of an all-to-all or a
 * reduce-scatter), so they follow spd.proto, the ring layout and the wire; the
 * test fuzz_seeds checks that tests/fuzz/corpus holds what this writes. After
 * a change of either, rewrite them: build/tests/fuzz/fuzz_seeds tests/fuzz/corpus.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/client.h"
#include "core/ops.h"
#include "core/validate.h"
#include "obs/metrics.h"
#include "sp_msg.h"
#include "sp_ulysses.h"

#include "fuzz_peer.h"
#include "fuzz_validate.h"

static const char *out_dir;

static void die(const char *what, const char *path)
{
    fprintf(stderr, "fuzz_seeds: %s %s: %s\n", what, path, strerror(errno));
    exit(1);
}

static void put(const char *harness, const char *name, const void *data, size_t len)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", out_dir, harness);
    if (mkdir(path, 0755) != 0 && errno != EEXIST)
        die("mkdir", path);
    snprintf(path, sizeof path, "%s/%s/seed-%s", out_dir, harness, name);
    FILE *f = fopen(path, "wb");
    if (f == NULL || fwrite(data, 1, len, f) != len || fclose(f) != 0)
        die("writing", path);
}

/* ================================================================ frames */

/* A stream of frames, built message by message. */
typedef struct stream {
    uint8_t buf[1 << 16];
    size_t  len;
} stream_t;

static void add_msg(stream_t *s, const Spd__Msg *m)
{
    uint8_t *b;
    size_t n;
    if (sp_msg_encode(m, &b, &n) != 0 || s->len + n > sizeof s->buf) {
        fprintf(stderr, "fuzz_seeds: cannot encode a %s\n", sp_msg_body_name(m));
        exit(1);
    }
    memcpy(s->buf + s->len, b, n);
    s->len += n;
    free(b);
}

static void put_msg_as(const char *name, const Spd__Msg *m)
{
    stream_t s = { .len = 0 };
    add_msg(&s, m);
    put("frame", name, s.buf, s.len);
}

static void put_msg(const Spd__Msg *m)
{
    put_msg_as(sp_msg_body_name(m), m);
}

static uint8_t handle[64], uuid[16], nonce[32], proof[32], ucx_addr[24];

#define MSG(var, kind, field, value)      \
    Spd__Msg var = SPD__MSG__INIT;        \
    var.seq = 7;                          \
    var.body_case = SPD__MSG__BODY_##kind; \
    var.field = (value)

static void frame_seeds(void)
{
    for (size_t i = 0; i < sizeof handle; i++)
        handle[i] = (uint8_t)(i * 7 + 1);
    for (size_t i = 0; i < sizeof uuid; i++)
        uuid[i] = (uint8_t)(0xa0 + i);
    for (size_t i = 0; i < sizeof nonce; i++) {
        nonce[i] = (uint8_t)(i * 13 + 5);
        proof[i] = (uint8_t)(i * 29 + 3);
    }
    memset(ucx_addr, 0x5a, sizeof ucx_addr);

    Spd__Hello hello = SPD__HELLO__INIT;
    hello.protocol = SP_PROTOCOL_MIN;
    hello.protocol_max = SP_PROTOCOL_VERSION;
    hello.role = SPD__HELLO__ROLE__CLIENT;
    hello.name = "train.py";
    hello.sq_entries = 256;
    hello.arena_bytes = 256u << 20;
    MSG(m_hello, HELLO, hello, &hello);
    put_msg(&m_hello);

    Spd__Welcome welcome = SPD__WELCOME__INIT;
    welcome.protocol = SP_PROTOCOL_VERSION;
    welcome.version = "0.1.0";
    welcome.client_id = 3;
    welcome.daemon_pid = 4242;
    welcome.node = "node-a";
    welcome.segment_bytes = 268881920;
    MSG(m_welcome, WELCOME, welcome, &welcome);
    put_msg(&m_welcome);

    Spd__Error error = SPD__ERROR__INIT;
    error.status = SPC_ERR_MISMATCH;
    error.detail = "rank 1 sent dtype fp64, rank 0 sent fp32";
    MSG(m_error, ERROR, error, &error);
    put_msg(&m_error);

    Spd__Ok ok = SPD__OK__INIT;
    MSG(m_ok, OK, ok, &ok);
    put_msg(&m_ok);

    Spd__RegisterReq reg = SPD__REGISTER_REQ__INIT;
    reg.addr = 0x7f3a12340000;
    reg.length = 1u << 20;
    MSG(m_reg, REGISTER_REQ, register_req, &reg);
    put_msg(&m_reg);

    Spd__RegisterRep reg_rep = SPD__REGISTER_REP__INIT;
    reg_rep.region = 5;
    MSG(m_reg_rep, REGISTER_REP, register_rep, &reg_rep);
    put_msg(&m_reg_rep);

    Spd__DeregisterReq dereg = SPD__DEREGISTER_REQ__INIT;
    dereg.region = 5;
    MSG(m_dereg, DEREGISTER_REQ, deregister_req, &dereg);
    put_msg(&m_dereg);

    Spd__RegisterDeviceReq dev = SPD__REGISTER_DEVICE_REQ__INIT;
    dev.ipc_handle = (ProtobufCBinaryData){ sizeof handle, handle };
    dev.alloc_base = 0x7f0000000000;
    dev.alloc_size = 64u << 20;
    dev.buffer_id = 17;
    dev.pci_bus_id = "0000:3B:00.0";
    dev.uuid = (ProtobufCBinaryData){ sizeof uuid, uuid };
    dev.device = 0;
    dev.offset = 1u << 20;
    dev.length = 8u << 20;
    MSG(m_dev, REGISTER_DEVICE_REQ, register_device_req, &dev);
    put_msg(&m_dev);

    /* cuMem memory: no IPC handle, three physical chunks back to back. */
    Spd__DeviceChunk ch[3] = { SPD__DEVICE_CHUNK__INIT, SPD__DEVICE_CHUNK__INIT, SPD__DEVICE_CHUNK__INIT };
    Spd__DeviceChunk *chp[3] = { &ch[0], &ch[1], &ch[2] };
    for (int i = 0; i < 3; i++) {
        ch[i].offset = (uint64_t)i * (2u << 20);
        ch[i].size = i < 2 ? 2u << 20 : 4u << 20;
        ch[i].buffer_id = 100 + (uint64_t)i;
        ch[i].block_id = 200 + (uint64_t)i;
        ch[i].fd = 10 + i;
    }
    Spd__RegisterDeviceReq vmm = dev;
    vmm.ipc_handle = (ProtobufCBinaryData){ 0, NULL };
    vmm.alloc_size = 8u << 20;
    vmm.buffer_id = 0;
    vmm.offset = 1u << 20;
    vmm.length = 6u << 20;
    vmm.n_chunks = 3;
    vmm.chunks = chp;
    MSG(m_vmm, REGISTER_DEVICE_REQ, register_device_req, &vmm);
    put_msg_as("register_device_req-cumem", &m_vmm);

    Spd__StreamCreateReq sc = SPD__STREAM_CREATE_REQ__INIT;
    sc.pci_bus_id = "0000:3B:00.0";
    sc.uuid = (ProtobufCBinaryData){ sizeof uuid, uuid };
    sc.device = 0;
    MSG(m_sc, STREAM_CREATE_REQ, stream_create_req, &sc);
    put_msg(&m_sc);

    Spd__StreamCreateRep sc_rep = SPD__STREAM_CREATE_REP__INIT;
    sc_rep.slot = 2;
    MSG(m_sc_rep, STREAM_CREATE_REP, stream_create_rep, &sc_rep);
    put_msg(&m_sc_rep);

    Spd__StreamDestroyReq sd = SPD__STREAM_DESTROY_REQ__INIT;
    sd.slot = 2;
    MSG(m_sd, STREAM_DESTROY_REQ, stream_destroy_req, &sd);
    put_msg(&m_sd);

    Spd__JobCreateReq jc = SPD__JOB_CREATE_REQ__INIT;
    MSG(m_jc, JOB_CREATE_REQ, job_create_req, &jc);
    put_msg(&m_jc);

    static char job_id[] = "node-a:5f1c0e2d9b8a7f6e5d4c3b2a19081726";
    Spd__JobCreateRep jc_rep = SPD__JOB_CREATE_REP__INIT;
    jc_rep.job_id = job_id;
    MSG(m_jc_rep, JOB_CREATE_REP, job_create_rep, &jc_rep);
    put_msg(&m_jc_rep);

    Spd__JobJoinReq join = SPD__JOB_JOIN_REQ__INIT;
    join.job_id = job_id;
    join.world_size = 8;
    join.rank = 3;
    join.timeout_ms = 20000;
    MSG(m_join, JOB_JOIN_REQ, job_join_req, &join);
    put_msg(&m_join);

    /* A rank of a torchrun launch joining its job by name. */
    Spd__JobJoinReq named = join;
    named.job_id = "";
    named.name = "torchrun-9abecfe6-9cfd-4add-b393-5cd0f0828f56";
    named.launch = "9abecfe6-9cfd-4add-b393-5cd0f0828f56.0@localhost:60069";
    MSG(m_named, JOB_JOIN_REQ, job_join_req, &named);
    put_msg_as("job_join_req-named", &m_named);

    Spd__JobJoinRep join_rep = SPD__JOB_JOIN_REP__INIT;
    join_rep.world_group = 6;
    join_rep.world_size = 8;
    join_rep.rank = 3;
    MSG(m_join_rep, JOB_JOIN_REP, job_join_rep, &join_rep);
    put_msg(&m_join_rep);

    /* seq 7: fuzz_frame places it over a world of 8 ranks. */
    Spd__MeshCreateReq mesh = SPD__MESH_CREATE_REQ__INIT;
    mesh.sp = 4;
    mesh.heads = 12;
    mesh.kv_heads = 2;
    MSG(m_mesh, MESH_CREATE_REQ, mesh_create_req, &mesh);
    put_msg(&m_mesh);

    Spd__MeshCreateRep mesh_rep = SPD__MESH_CREATE_REP__INIT;
    mesh_rep.mesh_id = 0;
    mesh_rep.dp = 2;
    mesh_rep.sp = 4;
    mesh_rep.ulysses = 2;
    mesh_rep.ring = 2;
    mesh_rep.dp_group = 7;
    mesh_rep.sp_group = 8;
    mesh_rep.ulysses_group = 10;
    mesh_rep.ring_group = 14;
    mesh_rep.sp_rank = 3;
    mesh_rep.ulysses_rank = 1;
    mesh_rep.ring_rank = 1;
    mesh_rep.explain = "dp 2 x sp 4 (ulysses 2 x ring 2); ulysses 2: the largest divisor of sp that fits the kv heads";
    MSG(m_mesh_rep, MESH_CREATE_REP, mesh_create_rep, &mesh_rep);
    put_msg(&m_mesh_rep);

    Spd__QueryReq q = SPD__QUERY_REQ__INIT;
    q.topic = "config";
    q.arg = "op_timeout_ms";
    MSG(m_q, QUERY_REQ, query_req, &q);
    put_msg(&m_q);

    Spd__Field f_s = SPD__FIELD__INIT, f_i = SPD__FIELD__INIT, f_d = SPD__FIELD__INIT;
    f_s.key = "node";
    f_s.value_case = SPD__FIELD__VALUE_S;
    f_s.s = "node-a";
    f_i.key = "clients";
    f_i.value_case = SPD__FIELD__VALUE_I;
    f_i.i = -3;
    f_d.key = "uptime_s";
    f_d.value_case = SPD__FIELD__VALUE_D;
    f_d.d = 12.5;
    Spd__Field *fields0[] = { &f_s, &f_i }, *fields1[] = { &f_d };
    Spd__Record rec0 = SPD__RECORD__INIT, rec1 = SPD__RECORD__INIT;
    rec0.n_fields = 2;
    rec0.fields = fields0;
    rec1.n_fields = 1;
    rec1.fields = fields1;
    Spd__Record *recs[] = { &rec0, &rec1 };
    Spd__QueryRep q_rep = SPD__QUERY_REP__INIT;
    q_rep.n_records = 2;
    q_rep.records = recs;
    MSG(m_q_rep, QUERY_REP, query_rep, &q_rep);
    put_msg(&m_q_rep);

    Spd__Bye bye = SPD__BYE__INIT;
    MSG(m_bye, BYE, bye, &bye);
    put_msg(&m_bye);

    Spd__PeerHello ph = SPD__PEER_HELLO__INIT;
    ph.protocol = SP_PEER_PROTOCOL_MIN;
    ph.protocol_max = SP_PEER_PROTOCOL_VERSION;
    ph.node = "node-b";
    ph.nonce = (ProtobufCBinaryData){ sizeof nonce, nonce };
    ph.version = "0.1.0";
    ph.incarnation = 0x1234567890abcdefull;
    MSG(m_ph, PEER_HELLO, peer_hello, &ph);
    put_msg(&m_ph);

    Spd__PeerAuth pa = SPD__PEER_AUTH__INIT;
    pa.proof = (ProtobufCBinaryData){ sizeof proof, proof };
    MSG(m_pa, PEER_AUTH, peer_auth, &pa);
    put_msg(&m_pa);

    Spd__PeerBeat pb = SPD__PEER_BEAT__INIT;
    pb.seq = 41;
    pb.sent_ns = 123456789012;
    pb.ack = true;
    MSG(m_pb, PEER_BEAT, peer_beat, &pb);
    put_msg(&m_pb);

    Spd__PeerJoin pj = SPD__PEER_JOIN__INIT;
    pj.job_id = job_id;
    pj.world_size = 8;
    pj.rank = 5;
    pj.pid = 777;
    MSG(m_pj, PEER_JOIN, peer_join, &pj);
    put_msg(&m_pj);

    Spd__PeerJoinRep pjr = SPD__PEER_JOIN_REP__INIT;
    pjr.job_id = job_id;
    pjr.rank = 5;
    pjr.status = SPC_ERR_INVALID_ARG;
    pjr.detail = "rank 5 has already joined";
    MSG(m_pjr, PEER_JOIN_REP, peer_join_rep, &pjr);
    put_msg(&m_pjr);

    Spd__PeerNameQuery pnq = SPD__PEER_NAME_QUERY__INIT;
    pnq.round = 7;
    pnq.uid = 1000;
    pnq.name = "nightly";
    MSG(m_pnq, PEER_NAME_QUERY, peer_name_query, &pnq);
    put_msg(&m_pnq);

    Spd__PeerNameRep pnr = SPD__PEER_NAME_REP__INIT;
    pnr.round = 7;
    pnr.uid = 1000;
    pnr.name = "nightly";
    pnr.held = true;
    pnr.launch = "77.1";
    pnr.world_size = 8;
    pnr.joined = 3;
    MSG(m_pnr, PEER_NAME_REP, peer_name_rep, &pnr);
    put_msg(&m_pnr);

    char *nodes[] = { "node-a", "node-a", "node-b", "node-b" };
    Spd__JobReady jr = SPD__JOB_READY__INIT;
    jr.job_id = job_id;
    jr.world_size = 4;
    jr.n_rank_node = 4;
    jr.rank_node = nodes;
    MSG(m_jr, JOB_READY, job_ready, &jr);
    put_msg(&m_jr);

    static uint8_t nccl_unique_id[128];
    for (size_t i = 0; i < sizeof nccl_unique_id; i++)
        nccl_unique_id[i] = (uint8_t)(i * 31 + 7);
    Spd__NcclId ni = SPD__NCCL_ID__INIT;
    ni.job_id = job_id;
    ni.group_index = 2;
    ni.channel = 1;
    ni.seq = 5;
    ni.unique_id = (ProtobufCBinaryData){ sizeof nccl_unique_id, nccl_unique_id };
    MSG(m_ni, NCCL_ID, nccl_id, &ni);
    put_msg(&m_ni);

    /* A client's session: several frames in one read. */
    stream_t s = { .len = 0 };
    add_msg(&s, &m_hello);
    add_msg(&s, &m_reg);
    add_msg(&s, &m_jc);
    add_msg(&s, &m_join);
    add_msg(&s, &m_mesh);
    add_msg(&s, &m_bye);
    put("frame", "session", s.buf, s.len);

    /* A peer link: hello, auth, beats, a join. */
    s.len = 0;
    add_msg(&s, &m_ph);
    add_msg(&s, &m_pa);
    add_msg(&s, &m_pb);
    add_msg(&s, &m_pj);
    add_msg(&s, &m_jr);
    put("frame", "peer-link", s.buf, s.len);

    /* A payload that does not decode, then a frame that does: spd answers the
     * first with an Error and reads on. */
    static const uint8_t junk[] = { 0xff, 0xff, 0xff, 0xff, 0x0f };
    s.len = 0;
    sp_frame_header_write(s.buf, sizeof junk);
    memcpy(s.buf + SP_FRAME_HDR_BYTES, junk, sizeof junk);
    s.len = SP_FRAME_HDR_BYTES + sizeof junk;
    add_msg(&s, &m_bye);
    put("frame", "undecodable-then-bye", s.buf, s.len);

    /* A frame cut short: its header announces more than arrives. */
    s.len = 0;
    add_msg(&s, &m_dev);
    put("frame", "truncated", s.buf, s.len / 2);
}

/* ================================================================ ops */

typedef struct fv_input {
    uint8_t bytes[FV_INPUT_BYTES];
    size_t  len;
} fv_input_t;

typedef struct op_spec {
    struct sp_sqe     sqe;
    struct sp_sq_args args;
} op_spec_t;

static void put_ops(const char *name, uint32_t ranks, unsigned flags, const op_spec_t *a, const op_spec_t *b)
{
    fv_input_t in = { .len = FV_HDR_BYTES + FV_OP_BYTES };
    in.bytes[0] = (uint8_t)(ranks - 1);
    in.bytes[1] = (uint8_t)flags;
    memcpy(in.bytes + FV_HDR_BYTES, &a->sqe, sizeof a->sqe);
    memcpy(in.bytes + FV_HDR_BYTES + sizeof a->sqe, &a->args, sizeof a->args);
    if (b != NULL) {
        memcpy(in.bytes + FV_HDR_BYTES + FV_OP_BYTES, &b->sqe, sizeof b->sqe);
        memcpy(in.bytes + FV_HDR_BYTES + FV_OP_BYTES + sizeof b->sqe, &b->args, sizeof b->args);
        in.len = FV_INPUT_BYTES;
    }
    put("validate", name, in.bytes, in.len);
}

static struct sp_tensor_ref tref(uint32_t region, uint64_t offset, uint64_t bytes)
{
    return (struct sp_tensor_ref){ .region = region, .offset = offset, .bytes = bytes };
}

static op_spec_t op(uint8_t opcode, uint8_t dtype, uint64_t count)
{
    op_spec_t o;
    memset(&o, 0, sizeof o);
    o.sqe.opcode = opcode;
    o.sqe.dtype = dtype;
    o.sqe.group = 6;
    o.sqe.user_data = 0x1000 + opcode;
    o.sqe.count = count;
    return o;
}

/* An fp32 uneven all-to-all over P ranks, n elements to and from each. */
static op_spec_t a2av(uint32_t P, uint64_t n)
{
    op_spec_t o = op(SP_OP_ALLTOALLV, SP_DTYPE_F32, 0);
    struct sp_a2av_params a = { { 0 } };
    for (uint32_t j = 0; j < 2 * P; j++)
        a.counts[j] = n;
    o.sqe.ntensors = 2;
    o.sqe.param_bytes = 2 * P * (uint32_t)sizeof a.counts[0];
    memcpy(o.args.params, &a, o.sqe.param_bytes);
    o.args.tensor[0] = tref(SP_REGION_ARENA, 0, P * n * 4);
    o.args.tensor[1] = tref(SP_REGION_ARENA, 8192, P * n * 4);
    return o;
}

/* An all-to-all of q (GQA: heads in kv_heads groups), k and v over P ranks,
 * then, up to ntensors, query-like tensors of head dim 1 (GatedDeltaNet's
 * beta and gate). */
static op_spec_t a2a_n(uint32_t P, uint32_t direction, uint32_t layout, uint32_t batch, uint32_t seq_len,
                       uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, uint8_t dtype, uint32_t kv_flags,
                       uint32_t region, uint32_t ntensors)
{
    op_spec_t o = op(SP_OP_ALLTOALL, dtype, 0);
    struct sp_a2a_params a = { .direction = direction, .layout = layout, .batch = batch, .seq_len = seq_len,
                               .kv_heads = kv_heads, .ntensors = ntensors };
    a.t[0] = (struct sp_a2a_tensor){ .heads = q_heads, .head_dim = head_dim, .kind = SP_HEADS_Q };
    a.t[1] = (struct sp_a2a_tensor){ .heads = kv_heads, .head_dim = head_dim, .kind = SP_HEADS_KV, .flags = kv_flags };
    a.t[2] = a.t[1];
    for (uint32_t i = 3; i < ntensors; i++)
        a.t[i] = (struct sp_a2a_tensor){ .heads = q_heads, .head_dim = 1, .kind = SP_HEADS_Q };
    uint64_t es = sp_dtype_size(dtype), s_loc = sp_rows_local(seq_len, P), off = 0;
    for (uint32_t i = 0; i < a.ntensors; i++) {
        sp_heads_plan_t pl;
        if (!sp_heads_plan(&pl, a.t[i].heads, a.t[i].kind, kv_heads, P)) {
            fprintf(stderr, "fuzz_seeds: an all-to-all seed that does not plan\n");
            exit(1);
        }
        uint64_t seq_side = batch * s_loc * a.t[i].heads * a.t[i].head_dim * es;
        uint64_t head_side = (uint64_t)batch * seq_len * pl.local * a.t[i].head_dim * es;
        uint64_t send = direction == SP_A2A_SEQ_TO_HEAD ? seq_side : head_side;
        uint64_t recv = direction == SP_A2A_SEQ_TO_HEAD ? head_side : seq_side;
        o.args.tensor[2 * i] = tref(region, off, send);
        off += sp_align_up(send, 256);
        o.args.tensor[2 * i + 1] = tref(region, off, recv);
        off += sp_align_up(recv, 256);
    }
    o.sqe.ntensors = (uint8_t)(2 * ntensors);
    o.sqe.param_bytes = sizeof a;
    memcpy(o.args.params, &a, sizeof a);
    return o;
}

static op_spec_t a2a(uint32_t P, uint32_t direction, uint32_t layout, uint32_t batch, uint32_t seq_len,
                     uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim, uint8_t dtype, uint32_t kv_flags,
                     uint32_t region)
{
    return a2a_n(P, direction, layout, batch, seq_len, q_heads, kv_heads, head_dim, dtype, kv_flags, region, 3);
}

static void validate_seeds(void)
{
    op_spec_t o, p;

    o = op(SP_OP_NOOP, 0, 0);
    o.sqe.group = 0;
    put_ops("noop", 1, FV_F_WORLD, &o, NULL);

    o = op(SP_OP_BARRIER, 0, 0);
    o.sqe.timeout_ms = 5000;
    put_ops("barrier", 4, FV_F_WORLD, &o, NULL);

    o = op(SP_OP_ALLREDUCE, SP_DTYPE_F32, 256);
    o.sqe.redop = SP_REDOP_SUM;
    o.sqe.ntensors = 2;
    o.args.tensor[0] = tref(SP_REGION_ARENA, 0, 1024);
    o.args.tensor[1] = tref(SP_REGION_ARENA, 4096, 1024);
    put_ops("allreduce", 4, FV_F_WORLD, &o, NULL);

    /* Rank 1.. sent another count: a mismatch, in a group that is not the world. */
    p = o;
    p.sqe.count = 128;
    put_ops("allreduce-count-mismatch", 3, 0, &o, &p);

    o = op(SP_OP_ALLREDUCE, SP_DTYPE_BF16, 1000);
    o.sqe.redop = SP_REDOP_MAX;
    o.sqe.ntensors = 2;
    o.sqe.channel = 1;
    o.args.tensor[0] = tref(1, 512, 2000);
    o.args.tensor[1] = tref(1, 512, 2000);   /* in place */
    put_ops("allreduce-in-place", 2, FV_F_WORLD, &o, NULL);

    o = op(SP_OP_ALLGATHER, SP_DTYPE_I32, 64);
    o.sqe.ntensors = 2;
    o.args.tensor[0] = tref(SP_REGION_ARENA, 0, 256);
    o.args.tensor[1] = tref(SP_REGION_ARENA, 8192, 4 * 256);
    put_ops("allgather", 4, FV_F_WORLD, &o, NULL);

    o = op(SP_OP_BROADCAST, SP_DTYPE_F64, 32);
    o.sqe.ntensors = 1;
    o.sqe.root = 2;
    o.args.tensor[0] = tref(2, 1u << 30, 256);
    put_ops("broadcast", 4, FV_F_WORLD, &o, NULL);

    o = op(SP_OP_REDUCE_SCATTER, SP_DTYPE_F16, 33);
    o.sqe.redop = SP_REDOP_MIN;
    o.sqe.ntensors = 2;
    o.args.tensor[0] = tref(SP_REGION_ARENA, 0, 4 * 66);
    o.args.tensor[1] = tref(SP_REGION_ARENA, 8192, 66);
    put_ops("reduce-scatter", 4, FV_F_WORLD, &o, NULL);

    /* Uneven all-to-all over 4 ranks: every block of the same 3 elements, as
     * ranks sharing one descriptor must send; the second op expects 4 from rank 1. */
    o = a2av(4, 3);
    put_ops("alltoallv", 4, FV_F_WORLD, &o, NULL);
    p = o;
    ((struct sp_a2av_params *)p.args.params)->counts[4 + 1] = 4;
    p.args.tensor[1].bytes += 4;
    put_ops("alltoallv-counts-mismatch", 4, FV_F_WORLD, &o, &p);

    o = op(SP_OP_SHIFT, 0, 0);
    o.sqe.ntensors = 4;
    o.sqe.flags = SP_SHIFT_F_LINEAR;
    o.sqe.channel = 2;
    o.args.tensor[0] = tref(SP_REGION_ARENA, 0, 4096);       /* K */
    o.args.tensor[1] = tref(SP_REGION_ARENA, 4096, 4096);
    o.args.tensor[2] = tref(SP_REGION_ARENA, 8192, 2048);    /* V, its own head dim */
    o.args.tensor[3] = tref(SP_REGION_ARENA, 10240, 2048);
    put_ops("shift", 3, FV_F_WORLD, &o, NULL);

    o.sqe.flags = SP_SHIFT_F_REVERSE;
    put_ops("shift-reverse", 4, FV_F_WORLD, &o, NULL);

    /* Ulysses: 6 query heads in 2 GQA groups over 4 ranks (dummy heads, kv
     * replication), a sequence of 30 rows (padding), both layouts, both ways. */
    o = a2a(4, SP_A2A_SEQ_TO_HEAD, SP_LAYOUT_BSHD, 2, 30, 6, 2, 8, SP_DTYPE_F32, 0, SP_REGION_ARENA);
    put_ops("alltoall-seq-to-head", 4, FV_F_WORLD, &o, NULL);
    o = a2a(4, SP_A2A_HEAD_TO_SEQ, SP_LAYOUT_SBHD, 2, 30, 6, 2, 8, SP_DTYPE_BF16, SP_A2A_T_SUM_REPLICAS, 1);
    put_ops("alltoall-head-to-seq-sum", 4, FV_F_WORLD, &o, NULL);
    o = a2a(2, SP_A2A_SEQ_TO_HEAD, SP_LAYOUT_SBHD, 1, 16, 8, 8, 4, SP_DTYPE_F16, 0, 2);
    put_ops("alltoall-mha", 2, FV_F_WORLD, &o, NULL);
    p = a2a(2, SP_A2A_SEQ_TO_HEAD, SP_LAYOUT_SBHD, 1, 16, 4, 4, 4, SP_DTYPE_F16, 0, 2);
    put_ops("alltoall-heads-mismatch", 2, FV_F_WORLD, &o, &p);
    o = a2a_n(4, SP_A2A_SEQ_TO_HEAD, SP_LAYOUT_BSHD, 2, 30, 6, 2, 8, SP_DTYPE_F32, 0, SP_REGION_ARENA,
              SP_A2A_MAX_TENSORS);
    put_ops("alltoall-8-tensors", 4, FV_F_WORLD, &o, NULL);

    /* GPU memory: regions 3 and 4 are on GPU 0, region 5 on GPU 1. */
    o = op(SP_OP_ALLREDUCE, SP_DTYPE_F16, 4096);
    o.sqe.ntensors = 2;
    o.args.tensor[0] = tref(3, 0, 8192);
    o.args.tensor[1] = tref(4, 0, 8192);
    put_ops("device-allreduce", 2, FV_F_WORLD, &o, NULL);
    p = o;
    p.args.tensor[1] = tref(SP_REGION_ARENA, 0, 8192);
    put_ops("device-host-mix", 2, FV_F_WORLD, &p, NULL);
    p.args.tensor[1] = tref(5, 0, 8192);
    put_ops("device-two-gpus", 2, FV_F_WORLD, &p, NULL);
    p.args.tensor[0] = tref(SP_REGION_ARENA, 0, 8192);   /* rank 1.. all-reduce host memory */
    p.args.tensor[1] = tref(SP_REGION_ARENA, 8192, 8192);
    put_ops("device-host-memory-mismatch", 2, FV_F_WORLD, &o, &p);
    /* Rank 1 all-reduces in place on GPU 1: refused on one node, fine on two. */
    p = o;
    p.args.tensor[0] = tref(5, 0, 8192);
    p.args.tensor[1] = tref(5, 0, 8192);
    put_ops("device-ranks-on-two-gpus", 2, FV_F_WORLD, &o, &p);
    put_ops("device-ranks-on-two-nodes", 2, FV_F_WORLD | FV_F_NODES, &o, &p);
    o = a2a(4, SP_A2A_SEQ_TO_HEAD, SP_LAYOUT_BSHD, 1, 32, 8, 4, 16, SP_DTYPE_BF16, 0, 3);
    put_ops("device-alltoall", 4, FV_F_WORLD, &o, NULL);

    /* Refused alone: a region the client does not own, bytes past a region's
     * end, and rank 0 with a barrier where the others all-reduce. */
    o = op(SP_OP_ALLREDUCE, SP_DTYPE_F32, 16);
    o.sqe.ntensors = 2;
    o.args.tensor[0] = tref(9, 0, 64);
    o.args.tensor[1] = tref(SP_REGION_ARENA, 0, 64);
    put_ops("bad-region", 2, FV_F_WORLD, &o, NULL);
    o.args.tensor[0] = tref(UINT32_MAX, 4096 - 32, 64);
    put_ops("out-of-bounds", 2, FV_F_WORLD, &o, NULL);
    p = op(SP_OP_BARRIER, 0, 0);
    o.args.tensor[0] = tref(SP_REGION_ARENA, 64, 64);
    put_ops("op-order-mismatch", 3, 0, &p, &o);
}

/* ================================================================ peer messages */

/* A message from a peer, as fuzz_peer reads it: job, header, payload. */
typedef struct peer_msg {
    uint8_t bytes[FP_HDR_BYTES + sizeof(sp_wire_hdr_t) + FP_MAX_RANKS * sizeof(sp_wire_rank_t) + (64u << 10)];
    size_t  len;
} peer_msg_t;

/* What becomes of the sender's ranks' ops. */
enum peer_how {
    PEER_HOST,      /* host memory: the inputs the receiver's ranks read travel */
    PEER_DEVICE,    /* on the sender's GPU 0: descriptors only (NCCL moves the data) */
    PEER_REFUSED,   /* refused by the sender's validation: descriptors only */
};

/* The ranks' arena: the ops are validated against it for their sizes. */
static sp_client_t peer_client = { .id = 1, .layout = { .arena_bytes = 1u << 20 } };

static uint32_t peer_node(uint32_t q, uint32_t P, uint8_t flags)
{
    return fp_node_of(fp_job_rank(q, flags), fp_world(P, flags), flags);
}

/* net.c's node_reads and is_input, for the receiver (node 0): whether its
 * ranks read input i of rank r. */
static bool read_here(const sp_op_t *op, uint32_t r, uint32_t i, uint32_t P, uint8_t flags)
{
    const struct sp_sqe *e = &op->sqe;
    bool input = e->opcode == SP_OP_BROADCAST ? r == e->root && i == 0 : i % 2 == 0;
    if (!input || op->need[i] == 0)
        return false;
    switch (e->opcode) {
    case SP_OP_BARRIER:
        return false;
    case SP_OP_SHIFT: {
        bool reverse = e->flags & SP_SHIFT_F_REVERSE, linear = e->flags & SP_SHIFT_F_LINEAR;
        if (linear && (reverse ? r == 0 : r == P - 1))
            return false;
        return peer_node(reverse ? (r + P - 1) % P : (r + 1) % P, P, flags) == 0;
    }
    default:
        return true;
    }
}

typedef struct pack {
    const uint8_t *src;
    uint8_t       *dst;
    uint64_t       done;
} pack_t;

static void pack_range(void *arg, uint64_t off, uint64_t len)
{
    pack_t *pk = arg;
    memcpy(pk->dst + pk->done, pk->src + off, len);
    pk->done += len;
}

/* Appends rank r's input i (its bytes: a pattern of r and i) to the payload at
 * *off, packed to the slices the receiver's ranks read where the op table
 * sends slices (all-to-all, reduce-scatter). */
static void peer_input(peer_msg_t *m, size_t payload, sp_wire_rank_t *w, const sp_op_t *op, uint32_t r, uint32_t i,
                       uint32_t P, uint8_t flags)
{
    static uint8_t data[64u << 10];
    uint64_t n = op->need[i];
    size_t off = (m->len - payload + SP_WIRE_ALIGN - 1) / SP_WIRE_ALIGN * SP_WIRE_ALIGN;
    if (n > sizeof data || payload + off + n > sizeof m->bytes) {
        fprintf(stderr, "fuzz_seeds: a peer seed's input of %llu bytes does not fit\n", (unsigned long long)n);
        exit(1);
    }
    for (uint64_t b = 0; b < n; b++)
        data[b] = (uint8_t)(r * 31 + i * 7 + b);
    memset(m->bytes + m->len, 0, payload + off - m->len);
    if (sp_op_kind(op->sqe.opcode)->slices != NULL) {
        bool here[FP_MAX_RANKS];
        for (uint32_t q = 0; q < P; q++)
            here[q] = peer_node(q, P, flags) == 0;
        pack_t pk = { .src = data, .dst = m->bytes + payload + off };
        sp_op_kind(op->sqe.opcode)->slices(op, P, r, i, here, pack_range, &pk);
        n = pk.done;
        w->packed |= 1u << i;
    } else {
        memcpy(m->bytes + payload + off, data, n);
    }
    w->off[i] = off;
    w->plen[i] = n;
    m->len = payload + off + n;
}

/* A collective's message from daemon `from`: every rank of the group there
 * submitted o. */
static void peer_coll(peer_msg_t *m, uint32_t P, uint8_t flags, uint32_t from, const op_spec_t *o, enum peer_how how)
{
    sp_wire_hdr_t h = { .magic = SP_WIRE_MAGIC, .kind = SP_WIRE_COLL, .incarnation = 0x5eed, .group_index = 3,
                        .channel = o->sqe.channel, .seq = 1 };
    sp_wire_rank_t w[FP_MAX_RANKS];
    sp_op_t op;
    uint32_t nd = 0;

    fp_node_name(h.from, sizeof h.from, from);
    snprintf(h.job, sizeof h.job, "fuzz-node-0:peer");
    memset(m->bytes, 0, FP_HDR_BYTES);
    m->bytes[0] = (uint8_t)(P - 1);
    m->bytes[1] = flags;
    memset(w, 0, sizeof w);
    for (uint32_t q = 0; q < P; q++)
        if (peer_node(q, P, flags) == from)
            nd++;
    h.nranks = nd;
    size_t payload = FP_HDR_BYTES + sizeof h;
    m->len = payload + nd * sizeof *w;
    nd = 0;
    for (uint32_t q = 0; q < P; q++) {
        if (peer_node(q, P, flags) != from)
            continue;
        sp_wire_rank_t *d = &w[nd++];
        memset(&op, 0, sizeof op);
        struct sp_sq_slot slot = sp_sq_slot_of(&o->args);
        sp_op_copy_in(&op, &o->sqe, &slot);
        op.client = &peer_client;
        sp_op_validate(&op, P);
        if (op.local.status != SPC_OK) {
            fprintf(stderr, "fuzz_seeds: a peer seed's op is refused: %s\n", op.local.msg);
            exit(1);
        }
        d->grank = q;
        d->sqe = op.sqe;
        memcpy(d->tensor, op.tensor, sizeof d->tensor);
        memcpy(d->need, op.need, sizeof d->need);
        memcpy(d->params, op.params.raw, sizeof d->params);
        for (uint32_t i = 0; i < SP_MAX_TENSORS; i++)
            d->off[i] = UINT64_MAX;
        if (how == PEER_REFUSED) {
            d->local_status = SPC_ERR_OUT_OF_BOUNDS;
            snprintf(d->local_detail, sizeof d->local_detail, "send tensor: 1024 bytes at offset 1048064 exceed "
                     "region 0 (1048576 bytes)");
            continue;
        }
        if (how == PEER_DEVICE) {
            d->memory = 1;
            continue;
        }
        for (uint32_t i = 0; i < op.sqe.ntensors; i++)
            if (read_here(&op, q, i, P, flags))
                peer_input(m, payload, d, &op, q, i, P, flags);
    }
    memcpy(m->bytes + FP_HDR_BYTES, &h, sizeof h);
    memcpy(m->bytes + payload, w, nd * sizeof *w);
}

static void put_peer(const char *name, const peer_msg_t *m)
{
    put("peer", name, m->bytes, m->len);
}

static void peer_seeds(void)
{
    static peer_msg_t m;
    const uint8_t rr2 = 0, blocks2 = FP_F_BLOCKS, rr3 = 1;
    op_spec_t o;

    o = op(SP_OP_ALLREDUCE, SP_DTYPE_F32, 64);
    o.sqe.redop = SP_REDOP_SUM;
    o.sqe.ntensors = 2;
    o.args.tensor[0] = tref(SP_REGION_ARENA, 0, 256);
    o.args.tensor[1] = tref(SP_REGION_ARENA, 4096, 256);
    peer_coll(&m, 4, rr2, 1, &o, PEER_HOST);
    put_peer("allreduce", &m);
    /* Cut in the last input: the descriptor's input ends past the message. */
    m.len -= 64;
    put_peer("input-past-end", &m);
    peer_coll(&m, 3, blocks2 | FP_F_SUBGROUP, 1, &o, PEER_HOST);
    put_peer("allreduce-subgroup", &m);
    peer_coll(&m, 4, rr2, 1, &o, PEER_DEVICE);
    put_peer("allreduce-device", &m);
    peer_coll(&m, 4, rr2, 1, &o, PEER_REFUSED);
    put_peer("allreduce-refused-rank", &m);

    o = op(SP_OP_ALLGATHER, SP_DTYPE_I32, 32);
    o.sqe.ntensors = 2;
    o.sqe.channel = 1;
    o.args.tensor[0] = tref(SP_REGION_ARENA, 0, 128);
    o.args.tensor[1] = tref(SP_REGION_ARENA, 4096, 4 * 128);
    peer_coll(&m, 4, blocks2, 1, &o, PEER_HOST);
    put_peer("allgather", &m);

    o = op(SP_OP_BROADCAST, SP_DTYPE_F64, 16);
    o.sqe.ntensors = 1;
    o.sqe.root = 1;
    o.args.tensor[0] = tref(SP_REGION_ARENA, 0, 128);
    peer_coll(&m, 4, rr2, 1, &o, PEER_HOST);
    put_peer("broadcast", &m);

    o = op(SP_OP_REDUCE_SCATTER, SP_DTYPE_I64, 8);
    o.sqe.ntensors = 2;
    o.args.tensor[0] = tref(SP_REGION_ARENA, 0, 4 * 64);
    o.args.tensor[1] = tref(SP_REGION_ARENA, 4096, 64);
    peer_coll(&m, 4, blocks2, 1, &o, PEER_HOST);
    put_peer("reduce-scatter", &m);

    o = op(SP_OP_SHIFT, 0, 0);
    o.sqe.ntensors = 4;
    o.sqe.channel = 2;
    o.args.tensor[0] = tref(SP_REGION_ARENA, 0, 512);        /* K */
    o.args.tensor[1] = tref(SP_REGION_ARENA, 4096, 512);
    o.args.tensor[2] = tref(SP_REGION_ARENA, 8192, 256);     /* V, its own head dim */
    o.args.tensor[3] = tref(SP_REGION_ARENA, 12288, 256);
    peer_coll(&m, 4, rr2, 1, &o, PEER_HOST);
    put_peer("shift", &m);
    o.sqe.flags = SP_SHIFT_F_LINEAR | SP_SHIFT_F_REVERSE;
    peer_coll(&m, 4, blocks2, 1, &o, PEER_HOST);
    put_peer("shift-linear-reverse", &m);

    /* Ulysses over 4 ranks on two daemons: GQA, padding rows, both ways. */
    o = a2a(4, SP_A2A_SEQ_TO_HEAD, SP_LAYOUT_BSHD, 2, 30, 6, 2, 8, SP_DTYPE_F32, 0, SP_REGION_ARENA);
    peer_coll(&m, 4, blocks2, 1, &o, PEER_HOST);
    put_peer("alltoall-seq-to-head", &m);
    o = a2a(4, SP_A2A_HEAD_TO_SEQ, SP_LAYOUT_SBHD, 2, 30, 6, 2, 8, SP_DTYPE_BF16, SP_A2A_T_SUM_REPLICAS,
            SP_REGION_ARENA);
    peer_coll(&m, 4, rr2, 1, &o, PEER_HOST);
    put_peer("alltoall-head-to-seq-sum", &m);
    o = a2a_n(4, SP_A2A_HEAD_TO_SEQ, SP_LAYOUT_BSHD, 1, 13, 6, 2, 4, SP_DTYPE_F32, SP_A2A_T_SUM_REPLICAS,
              SP_REGION_ARENA, SP_A2A_MAX_TENSORS);
    peer_coll(&m, 4, blocks2, 1, &o, PEER_HOST);
    put_peer("alltoall-8-tensors", &m);
    o = a2av(4, 5);
    peer_coll(&m, 4, blocks2, 1, &o, PEER_HOST);
    put_peer("alltoallv", &m);

    o = op(SP_OP_BARRIER, 0, 0);
    peer_coll(&m, 6, rr3, 2, &o, PEER_HOST);
    put_peer("barrier-3-daemons", &m);

    /* Refused whole: a descriptor more than the group has ranks, a sender
     * that names the receiver, a header of another magic. */
    o = op(SP_OP_ALLREDUCE, SP_DTYPE_F32, 64);
    o.sqe.ntensors = 2;
    o.args.tensor[0] = tref(SP_REGION_ARENA, 0, 256);
    o.args.tensor[1] = tref(SP_REGION_ARENA, 4096, 256);
    peer_coll(&m, 4, rr2, 1, &o, PEER_HOST);
    sp_wire_hdr_t h;
    memcpy(&h, m.bytes + FP_HDR_BYTES, sizeof h);
    h.nranks = 5;
    memcpy(m.bytes + FP_HDR_BYTES, &h, sizeof h);
    put_peer("more-ranks-than-group", &m);
    h.nranks = 2;
    fp_node_name(h.from, sizeof h.from, 0);
    memcpy(m.bytes + FP_HDR_BYTES, &h, sizeof h);
    put_peer("from-self", &m);
    fp_node_name(h.from, sizeof h.from, 1);
    h.magic = 0x73706e32;
    memcpy(m.bytes + FP_HDR_BYTES, &h, sizeof h);
    put_peer("foreign-magic", &m);
    /* A descriptor for a rank of the receiver's. */
    h.magic = SP_WIRE_MAGIC;
    memcpy(m.bytes + FP_HDR_BYTES, &h, sizeof h);
    sp_wire_rank_t w;
    memcpy(&w, m.bytes + FP_HDR_BYTES + sizeof h, sizeof w);
    w.grank = 0;
    memcpy(m.bytes + FP_HDR_BYTES + sizeof h, &w, sizeof w);
    put_peer("not-its-rank", &m);

    /* A rank of the sender left the job. */
    static const char why[] = "rank 1 left: its process exited (signal 9)";
    memset(&h, 0, sizeof h);
    h = (sp_wire_hdr_t){ .magic = SP_WIRE_MAGIC, .kind = SP_WIRE_RANK_LOST, .incarnation = 0x5eed, .msgno = 1,
                         .rank = 1 };
    fp_node_name(h.from, sizeof h.from, 1);
    snprintf(h.job, sizeof h.job, "fuzz-node-0:peer");
    memset(m.bytes, 0, FP_HDR_BYTES);
    m.bytes[0] = 3;
    memcpy(m.bytes + FP_HDR_BYTES, &h, sizeof h);
    memcpy(m.bytes + FP_HDR_BYTES + sizeof h, why, sizeof why - 1);
    m.len = FP_HDR_BYTES + sizeof h + sizeof why - 1;
    put_peer("rank-lost", &m);
}

/* ================================================================ http */

static void put_text(const char *name, const char *text, size_t len)
{
    put("http", name, text, len);
}

#define PUT_TEXT(name, literal) put_text(name, literal, sizeof literal - 1)

/* "GET /metrics HTTP/1.0", a header padded so that the head's end finishes
 * `end` bytes in, and a byte after it. */
static void put_padded(const char *name, size_t end)
{
    static char buf[SP_METRICS_HTTP_HEAD_MAX + 16];
    static const char line[] = "GET /metrics HTTP/1.0\r\nX-Pad: ";
    size_t n = sizeof line - 1;
    memcpy(buf, line, n);
    memset(buf + n, 'a', end - 4 - n);
    memcpy(buf + end - 4, "\r\n\r\n", 4);
    buf[end] = 'x';
    put_text(name, buf, end + 1);
}

static void http_seeds(void)
{
    /* What Prometheus sends, and the smallest heads that get the metrics. */
    PUT_TEXT("prometheus", "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:9464\r\nUser-Agent: Prometheus/2.45.0\r\n"
                           "Accept: text/plain;version=0.0.4;q=1,*/*;q=0.1\r\nAccept-Encoding: gzip\r\n\r\n");
    PUT_TEXT("get-lf", "GET /metrics HTTP/1.0\n\n");
    PUT_TEXT("get-query", "GET /metrics?name[]=spd_ops_total HTTP/1.1\r\n\r\n");
    PUT_TEXT("get-then-more", "GET /metrics HTTP/1.0\r\n\r\nGET /other HTTP/1.0\r\n\r\n");
    /* What a kubelet's httpGet probe sends. */
    PUT_TEXT("healthz", "GET /healthz HTTP/1.1\r\nHost: 10.0.0.1:9464\r\nUser-Agent: kube-probe/1.30\r\n"
                        "Accept: */*\r\nConnection: close\r\n\r\n");
    /* Each refusal. */
    PUT_TEXT("post", "POST /metrics HTTP/1.0\r\nContent-Length: 5\r\n\r\nhello");
    PUT_TEXT("get-prefixed-method", "GETS /metrics HTTP/1.0\r\n\r\n");
    PUT_TEXT("other-path", "GET /metricsx HTTP/1.0\r\n\r\n");
    PUT_TEXT("http2", "GET /metrics HTTP/2.0\r\n\r\n");
    PUT_TEXT("two-spaces", "GET  /metrics HTTP/1.0\r\n\r\n");
    PUT_TEXT("no-version", "GET /metrics\r\n\r\n");
    PUT_TEXT("control-byte", "GET /met\x01rics HTTP/1.0\r\n\r\n");
    PUT_TEXT("nul-byte", "GET /metrics\0 HTTP/1.0\r\n\r\n");
    PUT_TEXT("empty-first-line", "\r\n\r\nGET /metrics HTTP/1.0\r\n\r\n");
    PUT_TEXT("garbage", "\x01\x02garbage\r\n\r\n");
    /* No end yet, then the limit: an end in its last byte, and one past it. */
    PUT_TEXT("incomplete", "GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r");
    put_padded("end-at-limit", SP_METRICS_HTTP_HEAD_MAX);
    put_padded("end-past-limit", SP_METRICS_HTTP_HEAD_MAX + 1);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: fuzz_seeds DIR\n");
        return 2;
    }
    out_dir = argv[1];
    if (mkdir(out_dir, 0755) != 0 && errno != EEXIST)
        die("mkdir", out_dir);
    frame_seeds();
    validate_seeds();
    http_seeds();
    peer_seeds();
    return 0;
}
