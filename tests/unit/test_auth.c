/* Who may attach, and who may join and see a job (daemon/core/auth.c), without
 * needing other users. */
#include "core/auth.h"
#include "sp_test.h"

int main(void)
{
    sp_err_t e = SP_ERR_INIT;
    gid_t groups[] = { 10, 20, 30 };

    CHECK_EQ(sp_auth_allowed(1000, 1000, 1000, NULL, 0, SP_AUTH_NO_GROUP, &e), SPC_OK);
    CHECK_EQ(sp_auth_allowed(1000, 1001, 1001, groups, 3, SP_AUTH_NO_GROUP, &e), SPC_ERR_PERMISSION);
    CHECK_CONTAINS(e.msg, "uid 1001 is not spd's user (uid 1000)");
    /* Root is not special: a user's spd does not take root's ranks either. */
    CHECK_EQ(sp_auth_allowed(1000, 0, 0, NULL, 0, SP_AUTH_NO_GROUP, &e), SPC_ERR_PERMISSION);
    /* allow_group admits by primary or supplementary group, nobody else. */
    CHECK_EQ(sp_auth_allowed(1000, 1001, 20, NULL, 0, 20, &e), SPC_OK);
    CHECK_EQ(sp_auth_allowed(1000, 1001, 1001, groups, 3, 30, &e), SPC_OK);
    CHECK_EQ(sp_auth_allowed(1000, 1001, 1001, groups, 3, 40, &e), SPC_ERR_PERMISSION);
    CHECK_CONTAINS(e.msg, "not in group 40");

    /* A job: its owner and the uids it grants join and see it; operators
     * (spd's uid, root) see it but join no other user's job. */
    sp_job_access_t a = { .known = true, .owner = 1001, .nallow = 1, .allow = { 1003 } };
    CHECK_EQ(sp_auth_may_join(&a, "n:1", 1001, &e), SPC_OK);
    CHECK_EQ(sp_auth_may_join(&a, "n:1", 1003, &e), SPC_OK);
    CHECK_EQ(sp_auth_may_join(&a, "n:1", 1002, &e), SPC_ERR_PERMISSION);
    CHECK_CONTAINS(e.msg, "job n:1 belongs to uid 1001; uid 1002 may not join it");
    CHECK_EQ(sp_auth_may_join(&a, "n:1", 0, &e), SPC_ERR_PERMISSION);
    CHECK_EQ(sp_auth_may_join(&a, "n:1", 1000, &e), SPC_ERR_PERMISSION);
    CHECK(sp_auth_may_see(&a, 1000, 1001));
    CHECK(sp_auth_may_see(&a, 1000, 1003));
    CHECK(sp_auth_may_see(&a, 1000, 1000));
    CHECK(sp_auth_may_see(&a, 1000, 0));
    CHECK(!sp_auth_may_see(&a, 1000, 1002));
    /* A mirror whose root has not said whose the job is names nobody yet. */
    sp_job_access_t unknown = { .known = false };
    CHECK(!sp_auth_may_see(&unknown, 1000, 1001));
    CHECK(sp_auth_may_see(&unknown, 1000, 1000));

    long gid;
    CHECK_EQ(sp_auth_resolve_group("", &gid), 0);
    CHECK_EQ(gid, SP_AUTH_NO_GROUP);
    CHECK_EQ(sp_auth_resolve_group("123", &gid), 0);
    CHECK_EQ(gid, 123);
    CHECK_EQ(sp_auth_resolve_group("root", &gid), 0);
    CHECK_EQ(gid, 0);
    CHECK_EQ(sp_auth_resolve_group("no-such-group-here", &gid), -1);

    /* Tickets: what spd seals opens under its key, and under that key alone;
     * a change of any byte, a ticket of another size or one that is sealed but
     * makes no sense is refused. */
    uint8_t key[SP_AUTH_KEY_BYTES], other[SP_AUTH_KEY_BYTES];
    memset(key, 7, sizeof key);
    memset(other, 8, sizeof other);
    sp_job_ticket_t t = { .version = SP_JOB_TICKET_VERSION, .world_size = 4, .owner = 1001, .nallow = 1,
                          .allow = { 1003 }, .id = "node:0123", .launch = "", .nnodes = 1, .nruns = 1,
                          .nodes = { "node" } }, got;
    sp_auth_ticket_seal(key, &t);
    CHECK_EQ(sp_auth_ticket_open(key, (const uint8_t *)&t, sizeof t, &got, &e), SPC_OK);
    CHECK(memcmp(&got, &t, sizeof t) == 0);
    CHECK_EQ(sp_auth_ticket_open(other, (const uint8_t *)&t, sizeof t, &got, &e), SPC_ERR_PERMISSION);
    CHECK_CONTAINS(e.msg, "not issued by this node's spd");
    for (size_t i = 0; i < sizeof t; i++) {
        sp_job_ticket_t bad = t;
        ((uint8_t *)&bad)[i] ^= 0x01;
        CHECK_EQ(sp_auth_ticket_open(key, (const uint8_t *)&bad, sizeof bad, &got, &e), SPC_ERR_PERMISSION);
    }
    CHECK_EQ(sp_auth_ticket_open(key, (const uint8_t *)&t, sizeof t - 1, &got, &e), SPC_ERR_INVALID_ARG);
    sp_job_ticket_t odd = t;
    odd.nallow = SP_JOB_MAX_ALLOW_UIDS + 1;
    sp_auth_ticket_seal(key, &odd);
    CHECK_EQ(sp_auth_ticket_open(key, (const uint8_t *)&odd, sizeof odd, &got, &e), SPC_ERR_PROTOCOL);
    memset(odd.id, 'x', sizeof odd.id);   /* no end */
    odd.nallow = 0;
    sp_auth_ticket_seal(key, &odd);
    CHECK_EQ(sp_auth_ticket_open(key, (const uint8_t *)&odd, sizeof odd, &got, &e), SPC_ERR_PROTOCOL);

    /* A job over two daemons: ranks 0-1 here, 2-3 on node-b, root there. Its
     * runs must rise from rank 0 within the world, each on a node listed. */
    sp_job_ticket_t two = t;
    two.nnodes = 2;
    two.root = 1;
    snprintf(two.nodes[1], sizeof two.nodes[1], "node-b");
    two.nruns = 2;
    two.run_first[1] = 2;
    two.run_node[1] = 1;
    memset(two.nonce, 0x5a, sizeof two.nonce);
    sp_auth_ticket_seal(key, &two);
    CHECK_EQ(sp_auth_ticket_open(key, (const uint8_t *)&two, sizeof two, &got, &e), SPC_OK);
    const struct { uint32_t first1, node1, root, nnodes; } bad_runs[] = {
        { 4, 1, 1, 2 },   /* a run past the world */
        { 0, 1, 1, 2 },   /* runs not rising */
        { 2, 2, 1, 2 },   /* a node not listed */
        { 2, 1, 2, 2 },   /* a root not listed */
        { 2, 1, 1, SP_TICKET_NODES + 1 },
    };
    for (size_t i = 0; i < sizeof bad_runs / sizeof bad_runs[0]; i++) {
        odd = two;
        odd.run_first[1] = bad_runs[i].first1;
        odd.run_node[1] = (uint8_t)bad_runs[i].node1;
        odd.root = bad_runs[i].root;
        odd.nnodes = bad_runs[i].nnodes;
        sp_auth_ticket_seal(key, &odd);
        CHECK_EQ(sp_auth_ticket_open(key, (const uint8_t *)&odd, sizeof odd, &got, &e), SPC_ERR_PROTOCOL);
    }
    printf("auth: ok\n");
    return 0;
}
