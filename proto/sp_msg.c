/* sp_msg.c — see sp_msg.h. */
#include "sp_msg.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* Names and launch ids come from environments and reach logs, spctl's tables
 * and metrics labels: short, plain ASCII, nothing a shell or a label quotes. */
static bool plain_char(char ch, const char *allowed)
{
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           (ch != '\0' && strchr(allowed, ch) != NULL);
}

static const char *bounded_plain(const char *s, size_t max, const char *allowed, char why[96])
{
    size_t n = strnlen(s, max);
    if (n == 0)
        return "is empty";
    if (n == max) {
        snprintf(why, 96, "is longer than %zu bytes", max - 1);
        return why;
    }
    for (size_t i = 0; i < n; i++) {
        if (plain_char(s[i], allowed))
            continue;
        snprintf(why, 96, "holds byte 0x%02x at %zu; allowed are letters, digits and '%s'", (unsigned char)s[i], i,
                 allowed);
        return why;
    }
    return NULL;
}

const char *sp_job_name_problem(const char *name)
{
    static _Thread_local char why[96];
    const char *p = bounded_plain(name, SP_JOB_NAME_MAX, SP_JOB_NAME_CHARS, why);
    if (p == NULL && !plain_char(name[0], ""))
        return "does not begin with a letter or a digit";
    return p;
}

const char *sp_job_launch_problem(const char *launch)
{
    static _Thread_local char why[96];
    /* None at all is allowed: then world size and a started job tell launches apart. */
    return launch[0] == '\0' ? NULL : bounded_plain(launch, SP_JOB_LAUNCH_MAX, SP_JOB_LAUNCH_CHARS, why);
}

size_t sp_job_text_plain(const char *s, size_t max, const char *allowed)
{
    size_t n = 0;
    while (n < max && s[n] != '\0' && plain_char(s[n], allowed))
        n++;
    return n;
}

void sp_job_text_clean(char *s, const char *allowed)
{
    for (; *s != '\0'; s++)
        if (!plain_char(*s, allowed))
            *s = '-';
}
