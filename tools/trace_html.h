/* trace_html.h - the `html` command of tdist-trace (tools/trace_html.c). */
#ifndef TD_TOOLS_TRACE_HTML_H
#define TD_TOOLS_TRACE_HTML_H

/* td_trace_html_main runs `tdist-trace html RUN.json [-o OUT.html]` (argv as main's); returns the
 * exit status. */
int td_trace_html_main(int argc, char **argv);

#endif
