/* why_hung.h - the `why-hung` command of tdist-trace (tools/why_hung.c). */
#ifndef TD_TOOLS_WHY_HUNG_H
#define TD_TOOLS_WHY_HUNG_H

/* td_why_hung_main runs `tdist-trace why-hung DIR` (argv as main's); returns the exit status. */
int td_why_hung_main(int argc, char **argv);

#endif
