/* Frame codec and message round trips (proto/sp_frame.c, proto/sp_msg.c). */
#include "sp_msg.h"
#include "sp_test.h"

static void test_parse(void)
{
    uint8_t buf[64];
    sp_frame_t f;

    sp_frame_header_write(buf, 5);
    memcpy(buf + 8, "hello", 5);
    /* Every strict prefix of a valid frame needs more; the whole frame parses. */
    for (size_t n = 0; n < 13; n++)
        CHECK_EQ(sp_frame_parse(buf, n, 1024, &f), SP_FRAME_NEED_MORE);
    CHECK_EQ(sp_frame_parse(buf, 13, 1024, &f), SP_FRAME_OK);
    CHECK_EQ(f.length, 5);
    CHECK_EQ(f.frame_bytes, 13);
    CHECK(memcmp(f.payload, "hello", 5) == 0);
    /* Trailing bytes of the next frame do not disturb this one. */
    CHECK_EQ(sp_frame_parse(buf, 20, 1024, &f), SP_FRAME_OK);
    CHECK_EQ(f.frame_bytes, 13);

    /* Garbage is refused at its first byte. */
    uint8_t junk[1] = { 'G' };
    CHECK_EQ(sp_frame_parse(junk, 1, 1024, &f), SP_FRAME_BAD_MAGIC);
    uint8_t half[2] = { 'S', 'X' };
    CHECK_EQ(sp_frame_parse(half, 2, 1024, &f), SP_FRAME_BAD_MAGIC);
    uint8_t ver[3] = { 'S', 'P', 99 };
    CHECK_EQ(sp_frame_parse(ver, 3, 1024, &f), SP_FRAME_BAD_VERSION);
    uint8_t flags[4] = { 'S', 'P', SP_WIRE_VERSION, 1 };
    CHECK_EQ(sp_frame_parse(flags, 4, 1024, &f), SP_FRAME_BAD_FLAGS);

    /* The limit: exactly at it parses, one over is refused from the header alone. */
    sp_frame_header_write(buf, 1024);
    CHECK_EQ(sp_frame_parse(buf, 8, 1024, &f), SP_FRAME_NEED_MORE);
    sp_frame_header_write(buf, 1025);
    CHECK_EQ(sp_frame_parse(buf, 8, 1024, &f), SP_FRAME_TOO_BIG);
    CHECK_EQ(f.length, 1025);
    /* No caller can raise the limit past the hard cap. */
    sp_frame_header_write(buf, SP_FRAME_MAX_LIMIT + 1);
    CHECK_EQ(sp_frame_parse(buf, 8, UINT32_MAX, &f), SP_FRAME_TOO_BIG);
    /* Lengths are little-endian on every host. */
    sp_frame_header_write(buf, 0x01020304);
    CHECK_EQ(buf[4], 0x04);
    CHECK_EQ(buf[7], 0x01);
}

static void test_msg_roundtrip(void)
{
    Spd__Msg m = SPD__MSG__INIT;
    Spd__JobJoinReq j = SPD__JOB_JOIN_REQ__INIT;
    j.job_id = "node:abc";
    j.world_size = 8;
    j.rank = 5;
    j.timeout_ms = 1234;
    m.seq = 42;
    m.body_case = SPD__MSG__BODY_JOB_JOIN_REQ;
    m.job_join_req = &j;

    uint8_t *buf;
    size_t len;
    CHECK_EQ(sp_msg_encode(&m, &buf, &len), 0);
    sp_frame_t f;
    CHECK_EQ(sp_frame_parse(buf, len, SP_FRAME_DEFAULT_LIMIT, &f), SP_FRAME_OK);
    CHECK_EQ(f.frame_bytes, len);
    Spd__Msg *d = sp_msg_decode(&f);
    CHECK(d != NULL);
    CHECK_EQ(d->seq, 42);
    CHECK_EQ(d->body_case, SPD__MSG__BODY_JOB_JOIN_REQ);
    CHECK_STREQ(d->job_join_req->job_id, "node:abc");
    CHECK_EQ(d->job_join_req->world_size, 8);
    CHECK_EQ(d->job_join_req->rank, 5);
    CHECK_EQ(d->job_join_req->timeout_ms, 1234);
    CHECK_STREQ(sp_msg_body_name(d), "job_join_req");
    sp_msg_free(d);
    free(buf);

    /* A payload that is not a Msg does not decode. */
    uint8_t bad[] = { 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff };
    sp_frame_t g = { .payload = bad, .length = sizeof bad };
    CHECK(sp_msg_decode(&g) == NULL);
}

int main(void)
{
    test_parse();
    test_msg_roundtrip();
    printf("frame: ok\n");
    return 0;
}
