/* sp_status.c — names and messages of spc_status_t, from the one table in
 * spclient/status.h. Linked into both the daemon and libspclient. */
#include "spclient/status.h"

const char *spc_status_name(spc_status_t status)
{
    switch (status) {
#define SPC__NAME_CASE(name, value, msg) case name: return #name;
        SPC_STATUS_MAP(SPC__NAME_CASE)
#undef SPC__NAME_CASE
    }
    return "SPC_UNKNOWN_STATUS";
}

const char *spc_status_message(spc_status_t status)
{
    switch (status) {
#define SPC__MSG_CASE(name, value, msg) case name: return msg;
        SPC_STATUS_MAP(SPC__MSG_CASE)
#undef SPC__MSG_CASE
    }
    return "unknown status";
}

