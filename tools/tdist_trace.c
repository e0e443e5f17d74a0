/* tdist_trace.c - `tdist-trace merge DIR [-o OUT]`: merges the per-worker trace files that
 * tracing wrote into DIR (TD_TRACE=DIR, see tdist/trace.h) into one Chrome trace / Perfetto JSON
 * timeline: one process track per worker (named "worker0 (rank 0)"), every timestamp moved onto
 * rank 0's clock with the offset the worker estimated at rendezvous, flow arrows from each call to
 * its handler kept. The merged file's otherData lists each worker's offset and residual, and the
 * events it dropped (said on stderr too when there were any).
 *
 * Plain C, no library: it relies on the shape core/trace.c writes (one event per line; the
 * otherData line last) and only rewrites the "ts" field of each event line.
 *
 * `tdist-trace html RUN.json` renders a merged trace as a self-contained page (tools/trace_html.c);
 * `tdist-trace why-hung DIR` reads flight recorder dumps instead (tools/why_hung.c).
 *
 * Exit status: 0 merged, 1 an error (said on stderr), 2 usage.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trace_html.h"
#include "why_hung.h"

typedef struct worker {
  char path[1024];
  int rank;
  char name[160];
  long long offset_ns, residual_ns;
  long long dropped; /* events the worker could not record ("dropped_events"; absent: 0) */
} worker;

static int usage(void) {
  fprintf(stderr, "usage: tdist-trace merge DIR [-o OUT]   (OUT defaults to DIR/run.json)\n"
                  "       tdist-trace html RUN.json [-o OUT.html]   (a self-contained timeline "
                  "page)\n"
                  "       tdist-trace why-hung DIR         (reads the *.flight dumps in DIR)\n");
  return 2;
}

/* Reads the otherData line of a worker file. Returns 0 when found. */
static int read_meta(worker *w) {
  FILE *f = fopen(w->path, "r");
  if (!f) return -1;
  char line[4096];
  int found = -1;
  while (fgets(line, sizeof line, f)) {
    const char *p = strstr(line, "\"otherData\":");
    if (!p) continue;
    const char *r = strstr(p, "\"tdist_rank\":"), *n = strstr(p, "\"tdist_name\":\"");
    const char *o = strstr(p, "\"clock_offset_ns\":"), *s = strstr(p, "\"clock_residual_ns\":");
    if (!r || !n || !o || !s) break;
    w->rank = atoi(r + 13);
    n += 14;
    size_t k = 0;
    while (*n && *n != '"' && k + 1 < sizeof w->name) w->name[k++] = *n++;
    w->name[k] = 0;
    w->offset_ns = atoll(o + 18);
    w->residual_ns = atoll(s + 20);
    const char *d = strstr(p, "\"dropped_events\":");
    w->dropped = d ? atoll(d + 17) : 0;
    found = 0;
  }
  fclose(f);
  return found;
}

/* Copies the event lines of w to out with "ts" moved by the offset. */
static int copy_events(const worker *w, FILE *out, int *first) {
  FILE *f = fopen(w->path, "r");
  if (!f) return -1;
  char *line = NULL;
  size_t cap = 0;
  ssize_t len;
  while ((len = getline(&line, &cap, f)) > 0) {
    if (line[0] != '{' || strncmp(line, "{\"traceEvents\"", 14) == 0) continue;
    while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == ',')) line[--len] = 0;
    char *ts = strstr(line, "\"ts\":");
    fputs(*first ? "" : ",\n", out);
    *first = 0;
    if (!ts) {
      fputs(line, out);
      continue;
    }
    char *end;
    double v = strtod(ts + 5, &end);
    fwrite(line, 1, (size_t)(ts + 5 - line), out);
    fprintf(out, "%.3f", v + (double)w->offset_ns * 1e-3);
    fputs(end, out);
  }
  free(line);
  fclose(f);
  return 0;
}

static int cmp_rank(const void *a, const void *b) {
  return ((const worker *)a)->rank - ((const worker *)b)->rank;
}

int main(int argc, char **argv) {
  if (argc >= 2 && strcmp(argv[1], "why-hung") == 0) return td_why_hung_main(argc, argv);
  if (argc >= 2 && strcmp(argv[1], "html") == 0) return td_trace_html_main(argc, argv);
  if (argc < 3 || strcmp(argv[1], "merge") != 0) return usage();
  const char *dir = argv[2];
  char outpath[1100];
  snprintf(outpath, sizeof outpath, "%s/run.json", dir);
  for (int i = 3; i < argc; i++) {
    if (strcmp(argv[i], "-o") == 0 && i + 1 < argc) snprintf(outpath, sizeof outpath, "%s", argv[++i]);
    else return usage();
  }
  DIR *d = opendir(dir);
  if (!d) {
    fprintf(stderr, "tdist-trace: cannot open %s: %s\n", dir, strerror(errno));
    return 1;
  }
  worker *ws = NULL;
  int n = 0, cap = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    size_t l = strlen(e->d_name);
    if (l < 11 || strcmp(e->d_name + l - 11, ".trace.json") != 0) continue;
    if (n == cap) {
      cap = cap ? cap * 2 : 16;
      ws = realloc(ws, (size_t)cap * sizeof *ws);
      if (!ws) return 1;
    }
    memset(&ws[n], 0, sizeof ws[n]);
    snprintf(ws[n].path, sizeof ws[n].path, "%s/%s", dir, e->d_name);
    if (read_meta(&ws[n]) != 0) {
      fprintf(stderr, "tdist-trace: %s is not a complete tdist trace (skipped)\n", ws[n].path);
      continue;
    }
    n++;
  }
  closedir(d);
  if (n == 0) {
    fprintf(stderr, "tdist-trace: no *.trace.json files in %s\n", dir);
    return 1;
  }
  qsort(ws, (size_t)n, sizeof *ws, cmp_rank);
  char tmp[1200];
  snprintf(tmp, sizeof tmp, "%s.tmp", outpath);
  FILE *out = fopen(tmp, "w");
  if (!out) {
    fprintf(stderr, "tdist-trace: cannot write %s: %s\n", tmp, strerror(errno));
    return 1;
  }
  fputs("{\"traceEvents\":[\n", out);
  int first = 1;
  for (int i = 0; i < n; i++) {
    fprintf(out, "%s{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":%d,\"tid\":0,\"ts\":0,"
            "\"args\":{\"name\":\"%s (rank %d)\"}},\n"
            "{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":%d,\"tid\":0,\"ts\":0,"
            "\"args\":{\"sort_index\":%d}}",
            first ? "" : ",\n", ws[i].rank, ws[i].name, ws[i].rank, ws[i].rank, ws[i].rank);
    first = 0;
    if (copy_events(&ws[i], out, &first) != 0) {
      fprintf(stderr, "tdist-trace: cannot read %s\n", ws[i].path);
      fclose(out);
      return 1;
    }
  }
  fputs("\n],\n\"displayTimeUnit\":\"ns\",\n\"otherData\":{\"tdist_workers\":[", out);
  for (int i = 0; i < n; i++)
    fprintf(out, "%s{\"rank\":%d,\"name\":\"%s\",\"clock_offset_ns\":%lld,"
            "\"clock_residual_ns\":%lld,\"dropped_events\":%lld}",
            i ? "," : "", ws[i].rank, ws[i].name, ws[i].offset_ns, ws[i].residual_ns,
            ws[i].dropped);
  fputs("]}}\n", out);
  if (fclose(out) != 0 || rename(tmp, outpath) != 0) {
    fprintf(stderr, "tdist-trace: cannot write %s: %s\n", outpath, strerror(errno));
    return 1;
  }
  long long worst = 0;
  for (int i = 0; i < n; i++) {
    if (ws[i].residual_ns > worst) worst = ws[i].residual_ns;
    if (ws[i].dropped)
      fprintf(stderr, "tdist-trace: %s (rank %d) dropped %lld events: its timeline is incomplete\n",
              ws[i].name, ws[i].rank, ws[i].dropped);
  }
  fprintf(stderr, "tdist-trace: merged %d workers into %s (clock alignment within %.1f us)\n", n,
          outpath, (double)worst * 1e-3);
  free(ws);
  return 0;
}
