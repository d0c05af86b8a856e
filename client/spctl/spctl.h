/*
 * spctl.h — what the parts of spctl share: the JSON string writer, and the
 * commands that need no daemon (plan.c).
 */
#ifndef SPCTL_H
#define SPCTL_H

/* Writes s as a JSON string (quoted and escaped) to stdout. */
void spctl_json_string(const char *s);

/* `spctl plan ARGS`: argv[0] is "plan". Returns the exit code. */
int spctl_plan(int argc, char **argv, int json);

#endif /* SPCTL_H */
