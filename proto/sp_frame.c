/* sp_frame.c — see sp_frame.h. */
#include "sp_frame.h"

#define SP_MAGIC0 'S'
#define SP_MAGIC1 'P'

static uint32_t load_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

sp_frame_result_t sp_frame_parse(const uint8_t *buf, size_t avail, uint32_t max_payload,
                                 sp_frame_t *frame)
{
    if (max_payload > SP_FRAME_MAX_LIMIT)
        max_payload = SP_FRAME_MAX_LIMIT;

    /* Judge each header byte as soon as it is here: garbage is refused at once
     * instead of after the peer has sent eight bytes. */
    if (avail >= 1 && buf[0] != SP_MAGIC0)
        return SP_FRAME_BAD_MAGIC;
    if (avail >= 2 && buf[1] != SP_MAGIC1)
        return SP_FRAME_BAD_MAGIC;
    if (avail >= 3 && buf[2] != SP_WIRE_VERSION)
        return SP_FRAME_BAD_VERSION;
    if (avail >= 4 && buf[3] != 0)
        return SP_FRAME_BAD_FLAGS;
    if (avail < SP_FRAME_HDR_BYTES)
        return SP_FRAME_NEED_MORE;

    uint32_t length = load_le32(buf + 4);
    if (length > max_payload) {
        frame->length = length;
        return SP_FRAME_TOO_BIG;
    }
    if (avail - SP_FRAME_HDR_BYTES < length)
        return SP_FRAME_NEED_MORE;

    frame->payload = buf + SP_FRAME_HDR_BYTES;
    frame->length = length;
    frame->frame_bytes = SP_FRAME_HDR_BYTES + (size_t)length;
    return SP_FRAME_OK;
}

void sp_frame_header_write(uint8_t *hdr, uint32_t length)
{
    hdr[0] = SP_MAGIC0;
    hdr[1] = SP_MAGIC1;
    hdr[2] = SP_WIRE_VERSION;
    hdr[3] = 0;
    hdr[4] = (uint8_t)length;
    hdr[5] = (uint8_t)(length >> 8);
    hdr[6] = (uint8_t)(length >> 16);
    hdr[7] = (uint8_t)(length >> 24);
}

const char *sp_frame_result_str(sp_frame_result_t r)
{
    switch (r) {
    case SP_FRAME_OK:          return "ok";
    case SP_FRAME_NEED_MORE:   return "incomplete frame";
    case SP_FRAME_BAD_MAGIC:   return "bad frame magic (not an spd peer)";
    case SP_FRAME_BAD_VERSION: return "unsupported wire version";
    case SP_FRAME_BAD_FLAGS:   return "reserved frame flags set";
    case SP_FRAME_TOO_BIG:     return "frame over the size limit";
    }
    return "unknown frame result";
}
