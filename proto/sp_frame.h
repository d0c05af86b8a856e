/*
 * sp_frame.h — the frame codec of the control protocol. It does no I/O.
 *
 * A frame is an 8-byte header followed by `length` bytes of payload (one
 * serialized spd.Msg):
 *
 *   offset 0  'S' 'P'          magic
 *   offset 2  u8 version       SP_WIRE_VERSION
 *   offset 3  u8 flags         0; nonzero is refused (reserved)
 *   offset 4  u32 length       payload bytes, little-endian
 *
 * The parser looks at the bytes it is given and says whether they start with a
 * complete frame, need more bytes, or can never be a valid frame (wrong magic,
 * unknown version, reserved flags, or a length over the caller's limit). Streams
 * that produce an error cannot be resynchronised: the caller drops the connection.
 */
#ifndef SP_FRAME_H
#define SP_FRAME_H

#include <stddef.h>
#include <stdint.h>

#define SP_WIRE_VERSION      1u
#define SP_FRAME_HDR_BYTES   8u
/* No configuration may raise the frame limit above this. */
#define SP_FRAME_MAX_LIMIT   (64u << 20)

typedef enum sp_frame_result {
    SP_FRAME_OK        =  0,   /* a complete frame is in *frame */
    SP_FRAME_NEED_MORE =  1,   /* not enough bytes yet; nothing is wrong so far */
    SP_FRAME_BAD_MAGIC = -1,
    SP_FRAME_BAD_VERSION = -2,
    SP_FRAME_BAD_FLAGS = -3,
    SP_FRAME_TOO_BIG   = -4,
} sp_frame_result_t;

typedef struct sp_frame {
    const uint8_t *payload;    /* points into the caller's buffer */
    uint32_t       length;     /* payload bytes */
    size_t         frame_bytes;/* header + payload: what to consume */
} sp_frame_t;

/*
 * Looks for one frame at the start of buf[0..avail). `max_payload` is the limit
 * for this connection (at most SP_FRAME_MAX_LIMIT). On SP_FRAME_OK fills *frame;
 * on SP_FRAME_TOO_BIG stores the announced length in frame->length so the caller
 * can say how big it was. Errors are detected as soon as the header's bytes that
 * show them have arrived.
 */
sp_frame_result_t sp_frame_parse(const uint8_t *buf, size_t avail, uint32_t max_payload,
                                 sp_frame_t *frame);

/* Writes the header for a payload of `length` bytes into hdr[SP_FRAME_HDR_BYTES]. */
void sp_frame_header_write(uint8_t *hdr, uint32_t length);

/* A short description of a parse result, for logs and error details. */
const char *sp_frame_result_str(sp_frame_result_t r);

#endif /* SP_FRAME_H */
