/* The status table: every value named, messages present, values unique and in
 * their ranges. */
#include "sp_shm.h"
#include "sp_test.h"

int main(void)
{
    static const struct { spc_status_t st; const char *name; } all[] = {
#define ROW(name, value, msg) { name, #name },
        SPC_STATUS_MAP(ROW)
#undef ROW
    };
    size_t n = sizeof all / sizeof all[0];
    for (size_t i = 0; i < n; i++) {
        CHECK_STREQ(spc_status_name(all[i].st), all[i].name);
        CHECK(strlen(spc_status_message(all[i].st)) > 0);
        for (size_t k = i + 1; k < n; k++)
            CHECK(all[i].st != all[k].st);
        int v = (int)all[i].st;
        const char *nm = all[i].name;
        /* Names say their group: SPC_ERR_PEER_* in -100.., DAEMON/CONNECT/... in -300.. */
        if (strncmp(nm, "SPC_ERR_PEER", 12) == 0 || strcmp(nm, "SPC_ERR_TRANSPORT") == 0)
            CHECK(v <= -100 && v > -200);
        if (strcmp(nm, "SPC_ERR_DAEMON_LOST") == 0 || strcmp(nm, "SPC_ERR_CONNECT") == 0)
            CHECK(v <= -300 && v > -400);
        if (v < 0 && v > -100)
            CHECK(strncmp(nm, "SPC_ERR_", 8) == 0);
    }
    CHECK_STREQ(spc_status_name((spc_status_t)-9999), "SPC_UNKNOWN_STATUS");
    CHECK_STREQ(spc_status_message((spc_status_t)-9999), "unknown status");
    /* The dtype table of the wire, through the public wrappers. */
    CHECK_EQ(spc_dtype_size(SPC_BF16), 2);
    CHECK_EQ(spc_dtype_size(SPC_F64), 8);
    CHECK_EQ(spc_dtype_size((spc_dtype_t)99), 0);
    CHECK_STREQ(spc_dtype_name(SPC_F32), "fp32");
    CHECK_STREQ(sp_dtype_name(SP_DTYPE_BF16), "bf16");
    CHECK_STREQ(spc_dtype_name((spc_dtype_t)99), "unknown");
    CHECK_EQ(SPC_OK, 0);
    CHECK_EQ(SPC_IN_PROGRESS, 1);
    printf("status: %zu statuses ok\n", n);
    return 0;
}
