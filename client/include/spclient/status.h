/*
 * spclient/status.h — the one status type of spd.
 *
 * spc_status_t crosses the wire: the daemon puts it in completion entries and
 * error replies, the client library returns it from every call. 0 is success,
 * 1 means "still in progress", negative values are errors grouped by how much is
 * broken:
 *
 *   -1   .. -99    the request itself is wrong (argument, region, shape)
 *   -100 .. -199   a peer or a transport failed (another rank, another node)
 *   -200 .. -299   a device failed (CUDA, NCCL)
 *   -300 .. -399   the daemon or the connection to it is gone or refusing
 *
 * The table below is append-only: a value, once shipped, keeps its meaning.
 */
#ifndef SPCLIENT_STATUS_H
#define SPCLIENT_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

/* Marks the public API: the library is built with hidden visibility, and only
 * these (and its linker script allows only spc_*) are exported. */
#ifndef SPC_API
#define SPC_API __attribute__((visibility("default")))
#endif

/* X(name, value, message) */
#define SPC_STATUS_MAP(X)                                                          \
    X(SPC_OK,                  0,    "success")                                    \
    X(SPC_IN_PROGRESS,         1,    "operation still in progress")                \
    X(SPC_ERR_INVALID_ARG,    -1,    "invalid argument")                           \
    X(SPC_ERR_NO_MEMORY,      -2,    "out of memory")                              \
    X(SPC_ERR_BAD_REGION,     -3,    "region unknown or not owned by this client") \
    X(SPC_ERR_OUT_OF_BOUNDS,  -4,    "offset or length outside the region")        \
    X(SPC_ERR_UNSUPPORTED,    -5,    "operation or type not supported")            \
    X(SPC_ERR_MISMATCH,       -6,    "ranks disagree on the operation")            \
    X(SPC_ERR_TIMEOUT,        -7,    "timed out waiting for ranks")                \
    X(SPC_ERR_RING_FULL,      -8,    "submission ring full")                       \
    X(SPC_ERR_NOT_FOUND,      -9,    "no such object")                             \
    X(SPC_ERR_BUSY,          -10,    "object busy or already in use")              \
    X(SPC_ERR_PEER_LOST,    -100,    "a peer rank was lost")                       \
    X(SPC_ERR_PEER_REFUSED, -101,    "a peer rank's request was refused")          \
    X(SPC_ERR_TRANSPORT,    -102,    "transport failure")                          \
    X(SPC_ERR_DEVICE,       -200,    "device failure")                             \
    X(SPC_ERR_NO_DEVICE,    -201,    "no usable device")                           \
    X(SPC_ERR_DAEMON_LOST,  -300,    "connection to spd lost")                     \
    X(SPC_ERR_CONNECT,      -301,    "cannot connect to spd")                      \
    X(SPC_ERR_PROTOCOL,     -302,    "protocol error")                             \
    X(SPC_ERR_PERMISSION,   -303,    "permission denied")                          \
    X(SPC_ERR_SHUTTING_DOWN,-304,    "spd is shutting down")                       \
    X(SPC_ERR_LIMIT,        -305,    "daemon limit reached")                       \
    X(SPC_ERR_CANCELED,     -306,    "operation canceled")                         \
    X(SPC_ERR_RESTARTED,    -307,    "spd restarted mid-operation; not retried")

typedef enum spc_status {
#define SPC__STATUS_ENUM(name, value, msg) name = value,
    SPC_STATUS_MAP(SPC__STATUS_ENUM)
#undef SPC__STATUS_ENUM
} spc_status_t;

/** The enumerator's name ("SPC_ERR_TIMEOUT"), or "SPC_UNKNOWN_STATUS". Never NULL. */
SPC_API const char *spc_status_name(spc_status_t status);

/** A short English message for the status. Never NULL. */
SPC_API const char *spc_status_message(spc_status_t status);

#ifdef __cplusplus
}
#endif
#endif /* SPCLIENT_STATUS_H */
