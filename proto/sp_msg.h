/*
 * sp_msg.h — spd.Msg to and from frames. No I/O: callers own the sockets.
 */
#ifndef SP_MSG_H
#define SP_MSG_H

#include <stddef.h>
#include <stdint.h>

#include "spd.pb-c.h"
#include "sp_frame.h"

/*
 * The control protocol between a client (libspclient, spctl) and spd. Each
 * side speaks a range and the hello picks the highest number both speak
 * (spd.proto, Hello). Bumped when a message or the segment changes meaning;
 * spd keeps serving at least the previous number.
 *   1: the segment's layout 4 (8 tensor refs and 1 KiB per argument slot: an
 *      all-to-all of at most 4 tensors).
 *   2: hellos carry a range; the segment's layout 5 (16 tensor refs and 2 KiB
 *      per argument slot: all-to-alls of 8 tensors).
 * An spd from before ranges gave layout 5 under protocol 1 too, so a client
 * takes the layout the segment's header names, of those it knows; spd gives
 * protocol 1 layout 4, which is what the libraries of then check for.
 */
#define SP_PROTOCOL_VERSION 2u
#define SP_PROTOCOL_MIN     1u

/* The segment layout (sp_shm.h) a protocol's clients get. */
static inline uint32_t sp_protocol_seg_version(uint32_t protocol)
{
    return protocol >= 2 ? 5u : 4u;
}

/* The same for links between daemons; PeerHello carries the range. 2: mutual
 * authentication with roles and a transcript, data-path keys (spd.proto).
 * 3: a rank's descriptor on the data path holds 16 tensor refs and 1 KiB of
 * params (cluster/net_wire.h), an all-to-all of 8 tensors; PeerHello may
 * carry a range. The data path of 2 is not served: a daemon of 2 is refused,
 * naming both ranges. */
#define SP_PEER_PROTOCOL_VERSION 3u
#define SP_PEER_PROTOCOL_MIN     3u

/* The highest number in both [lo_a, hi_a] and [lo_b, hi_b]; 0 when none.
 * A hello's range is [protocol, max(protocol, protocol_max)]. */
static inline uint32_t sp_protocol_pick(uint32_t lo_a, uint32_t hi_a, uint32_t lo_b, uint32_t hi_b)
{
    uint32_t lo = lo_a > lo_b ? lo_a : lo_b, hi = hi_a < hi_b ? hi_a : hi_b;
    return lo <= hi ? hi : 0;
}

/* Default frame payload limit of both sides; the daemon's is configurable. */
#define SP_FRAME_DEFAULT_LIMIT (1u << 20)

/* The most physical allocations one device registration of cuMem memory may
 * span (RegisterDeviceReq.chunks): 2 GiB of 2 MiB pages, or 20 GiB of the
 * 20 MiB segments PyTorch maps for large blocks. Each is a descriptor the
 * client holds until the reply, so its RLIMIT_NOFILE must leave room for them. */
#define SP_DEVICE_MAX_CHUNKS 1024u

/* The most other users one job may admit (JobCreateReq.allow_uids); the
 * public header's SPC_JOB_MAX_ALLOW_UIDS. */
#define SP_JOB_MAX_ALLOW_UIDS 16u

/* Bounds of a named join's strings (JobJoinReq.name and .launch), their NUL
 * included; the public header's SPC_JOB_NAME_MAX and SPC_JOB_LAUNCH_MAX. */
#define SP_JOB_NAME_MAX   64u
#define SP_JOB_LAUNCH_MAX 128u

/* The bytes besides letters and digits that each may hold. */
#define SP_JOB_NAME_CHARS   "._-"
#define SP_JOB_LAUNCH_CHARS "._-:@/+="

/* What is wrong with a job name ("is empty", "holds ' ' at byte 3", ...), or
 * NULL when it is one (spd.proto, JobJoinReq). Client and daemon check alike. */
const char *sp_job_name_problem(const char *name);
/* The same for a launch id: NULL when it is one. */
const char *sp_job_launch_problem(const char *launch);
/* How many bytes at the start of s, at most max, are letters, digits or
 * `allowed`: what of a refused name or launch id a message may quote, since
 * messages reach logs and the rest may be anything. */
size_t sp_job_text_plain(const char *s, size_t max, const char *allowed);
/* Makes every byte of s outside letters, digits and `allowed` a '-'. */
void sp_job_text_clean(char *s, const char *allowed);

/*
 * Serializes msg into a new buffer holding one whole frame (header + payload).
 * Returns 0, or -1 when out of memory or the message exceeds SP_FRAME_MAX_LIMIT.
 * The caller frees *buf_p with free().
 */
int sp_msg_encode(const Spd__Msg *msg, uint8_t **buf_p, size_t *len_p);

/* Unpacks a frame's payload; NULL when it is not a valid spd.Msg. Free with sp_msg_free. */
Spd__Msg *sp_msg_decode(const sp_frame_t *frame);

void sp_msg_free(Spd__Msg *msg);

/* The name of the message's body ("hello", "job_join_req", ...), for logs. */
const char *sp_msg_body_name(const Spd__Msg *msg);

#endif /* SP_MSG_H */
