/* Who may attach, and who may join and see a job (daemon/core/auth.c), without
 * needing other users. */
#include "core/auth.h"
#include "sp_test.h"

int main(void)
{
    char why[256];
    gid_t groups[] = { 10, 20, 30 };

    CHECK(sp_auth_allowed(1000, 1000, 1000, NULL, 0, SP_AUTH_NO_GROUP, why, sizeof why));
    CHECK(!sp_auth_allowed(1000, 1001, 1001, groups, 3, SP_AUTH_NO_GROUP, why, sizeof why));
    CHECK_CONTAINS(why, "uid 1001 is not spd's user (uid 1000)");
    /* Root is not special: a user's spd does not take root's ranks either. */
    CHECK(!sp_auth_allowed(1000, 0, 0, NULL, 0, SP_AUTH_NO_GROUP, why, sizeof why));
    /* allow_group admits by primary or supplementary group, nobody else. */
    CHECK(sp_auth_allowed(1000, 1001, 20, NULL, 0, 20, why, sizeof why));
    CHECK(sp_auth_allowed(1000, 1001, 1001, groups, 3, 30, why, sizeof why));
    CHECK(!sp_auth_allowed(1000, 1001, 1001, groups, 3, 40, why, sizeof why));
    CHECK_CONTAINS(why, "not in group 40");

    /* A job: its owner and the uids it grants join and see it; operators
     * (spd's uid, root) see it but join no other user's job. */
    sp_job_access_t a = { .known = true, .owner = 1001, .nallow = 1, .allow = { 1003 } };
    CHECK(sp_auth_may_join(&a, "n:1", 1001, why, sizeof why));
    CHECK(sp_auth_may_join(&a, "n:1", 1003, why, sizeof why));
    CHECK(!sp_auth_may_join(&a, "n:1", 1002, why, sizeof why));
    CHECK_CONTAINS(why, "job n:1 belongs to uid 1001; uid 1002 may not join it");
    CHECK(!sp_auth_may_join(&a, "n:1", 0, why, sizeof why));
    CHECK(!sp_auth_may_join(&a, "n:1", 1000, why, sizeof why));
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
    printf("auth: ok\n");
    return 0;
}
