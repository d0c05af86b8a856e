/*
 * sp_msg.h — spd.Msg to and from frames. No I/O: callers own the sockets.
 */
#ifndef SP_MSG_H
#define SP_MSG_H

#include <stddef.h>
#include <stdint.h>

#include "spd.pb-c.h"
#include "sp_frame.h"

/* Bumped when a message changes meaning; Hello carries it and Welcome answers it. */
#define SP_PROTOCOL_VERSION 1u

/* The same for links between daemons; PeerHello carries it. 2: mutual
 * authentication with roles and a transcript, data-path keys (spd.proto).
 * 3: a rank's descriptor on the data path holds 16 tensor refs and 1 KiB of
 * params (cluster/net_wire.h), an all-to-all of 8 tensors. */
#define SP_PEER_PROTOCOL_VERSION 3u

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
