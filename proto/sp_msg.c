/* sp_msg.c — see sp_msg.h. */
#include "sp_msg.h"

#include <stdlib.h>

int sp_msg_encode(const Spd__Msg *msg, uint8_t **buf_p, size_t *len_p)
{
    size_t payload = spd__msg__get_packed_size(msg);
    if (payload > SP_FRAME_MAX_LIMIT)
        return -1;

    uint8_t *buf = malloc(SP_FRAME_HDR_BYTES + payload);
    if (buf == NULL)
        return -1;
    sp_frame_header_write(buf, (uint32_t)payload);
    spd__msg__pack(msg, buf + SP_FRAME_HDR_BYTES);
    *buf_p = buf;
    *len_p = SP_FRAME_HDR_BYTES + payload;
    return 0;
}

Spd__Msg *sp_msg_decode(const sp_frame_t *frame)
{
    return spd__msg__unpack(NULL, frame->length, frame->payload);
}

void sp_msg_free(Spd__Msg *msg)
{
    if (msg != NULL)
        spd__msg__free_unpacked(msg, NULL);
}

const char *sp_msg_body_name(const Spd__Msg *msg)
{
    const ProtobufCFieldDescriptor *f =
        protobuf_c_message_descriptor_get_field(&spd__msg__descriptor, (unsigned)msg->body_case);
    return f != NULL ? f->name : "empty";
}
