/* auth.c — see auth.h. */
#include "core/auth.h"

#include <errno.h>
#include <grp.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

spc_status_t sp_auth_allowed(uid_t self_uid, uid_t peer_uid, gid_t peer_gid, const gid_t *groups, int ngroups,
                             long allow_gid, sp_err_t *e)
{
    if (peer_uid == self_uid)
        return SPC_OK;
    if (allow_gid != SP_AUTH_NO_GROUP) {
        if ((long)peer_gid == allow_gid)
            return SPC_OK;
        for (int i = 0; i < ngroups; i++)
            if ((long)groups[i] == allow_gid)
                return SPC_OK;
        return sp_err_set(e, SPC_ERR_PERMISSION, "uid %u is not spd's user (uid %u) and not in group %ld",
                          (unsigned)peer_uid, (unsigned)self_uid, allow_gid);
    }
    return sp_err_set(e, SPC_ERR_PERMISSION, "uid %u is not spd's user (uid %u); set allow_group to admit other users",
                      (unsigned)peer_uid, (unsigned)self_uid);
}

int sp_auth_resolve_group(const char *spec, long *gid_p)
{
    if (spec == NULL || *spec == '\0') {
        *gid_p = SP_AUTH_NO_GROUP;
        return 0;
    }
    char *end;
    long v = strtol(spec, &end, 10);
    if (*end == '\0' && v >= 0) {
        *gid_p = v;
        return 0;
    }
    struct group gr, *res = NULL;
    char buf[4096];
    if (getgrnam_r(spec, &gr, buf, sizeof buf, &res) != 0 || res == NULL)
        return -1;
    *gid_p = (long)gr.gr_gid;
    return 0;
}

int sp_auth_peer(int fd, pid_t *pid_p, uid_t *uid_p, gid_t *gid_p, gid_t *groups, int *ngroups_p)
{
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0)
        return -errno;
    socklen_t glen = (socklen_t)(*ngroups_p * (int)sizeof(gid_t));
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &glen) != 0)
        glen = 0;   /* older kernels: the primary group alone decides */
    *pid_p = cred.pid;
    *uid_p = cred.uid;
    *gid_p = cred.gid;
    *ngroups_p = (int)(glen / sizeof(gid_t));
    return 0;
}

static bool access_names(const sp_job_access_t *a, uid_t uid)
{
    if (!a->known)
        return false;
    if (uid == a->owner)
        return true;
    for (uint32_t i = 0; i < a->nallow; i++)
        if (a->allow[i] == uid)
            return true;
    return false;
}

spc_status_t sp_auth_may_join(const sp_job_access_t *a, const char *job_id, uid_t uid, sp_err_t *e)
{
    if (access_names(a, uid))
        return SPC_OK;
    return sp_err_set(e, SPC_ERR_PERMISSION, "job %.128s belongs to uid %u; uid %u may not join it (its creator may "
                      "grant uids at creation: allow_uids)", job_id, (unsigned)a->owner, (unsigned)uid);
}

bool sp_auth_operator(uid_t self_uid, uid_t uid)
{
    return uid == self_uid || uid == 0;
}

bool sp_auth_may_see(const sp_job_access_t *a, uid_t self_uid, uid_t uid)
{
    return sp_auth_operator(self_uid, uid) || access_names(a, uid);
}

void sp_auth_ticket_seal(const uint8_t key[SP_AUTH_KEY_BYTES], sp_job_ticket_t *t)
{
    crypto_auth_hmacsha256(t->mac, (const uint8_t *)t, offsetof(sp_job_ticket_t, mac), key);
}

/* Whether a sealed ticket's nodes and runs describe a job: names ended and
 * not empty, runs from rank 0 rising within the world, each on a node listed. */
static bool ticket_nodes_ok(const sp_job_ticket_t *t)
{
    if (t->nnodes == 0 || t->nnodes > SP_TICKET_NODES || t->root >= t->nnodes || t->nruns == 0 ||
        t->nruns > SP_TICKET_RUNS || t->run_first[0] != 0)
        return false;
    for (uint32_t i = 0; i < t->nnodes; i++)
        if (t->nodes[i][0] == '\0' || memchr(t->nodes[i], '\0', sizeof t->nodes[i]) == NULL)
            return false;
    for (uint32_t i = 0; i < t->nruns; i++)
        if (t->run_node[i] >= t->nnodes || (i > 0 && t->run_first[i] <= t->run_first[i - 1]) ||
            t->run_first[i] >= t->world_size)
            return false;
    return true;
}

spc_status_t sp_auth_ticket_open(const uint8_t key[SP_AUTH_KEY_BYTES], const uint8_t *bytes, size_t len,
                                 sp_job_ticket_t *t, sp_err_t *e)
{
    sp_job_ticket_t in;

    if (len != sizeof in)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "a resume ticket of %zu bytes; this spd's are %zu", len, sizeof in);
    memcpy(&in, bytes, sizeof in);
    /* The MAC first: nothing of a ticket spd did not write is looked at. */
    if (crypto_auth_hmacsha256_verify(in.mac, (const uint8_t *)&in, offsetof(sp_job_ticket_t, mac), key) != 0)
        return sp_err_set(e, SPC_ERR_PERMISSION, "the resume ticket was not issued by this node's spd (forged, "
                          "altered, or sealed under a resume key this spd does not have)");
    if (in.version != SP_JOB_TICKET_VERSION || memchr(in.id, '\0', sizeof in.id) == NULL || in.id[0] == '\0' ||
        memchr(in.launch, '\0', sizeof in.launch) == NULL || in.nallow > SP_JOB_MAX_ALLOW_UIDS || in.named > 1 ||
        in.world_size == 0 || !ticket_nodes_ok(&in))
        return sp_err_set(e, SPC_ERR_PROTOCOL, "a resume ticket of version %u that this spd cannot read", in.version);
    *t = in;
    return SPC_OK;
}
