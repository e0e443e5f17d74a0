/* trace_html.c - `tdist-trace html RUN.json [-o OUT.html]`: renders a merged trace (the output of
 * `tdist-trace merge`) as one self-contained HTML page, to look at a run offline: no network, no
 * external script or style, nothing to install (ui.perfetto.dev needs the internet, and
 * Debian's Chromium refuses chrome://tracing).
 *
 * The page is an inline SVG drawn here, so it shows the whole run even where scripts are off:
 * one track per worker thread (named after the worker's process track and the thread), spans
 * ("X" events, and "B"/"E" pairs) stacked by nesting, async calls ("b"/"e" pairs, a call from
 * send to reply) on lanes of their own under their worker, instants as ticks, and flow arrows
 * from each call to its handler ("s"/"f" pairs). Every element carries its time and duration
 * (data-t, data-d, in microseconds from the run's first event) and a <title> with the event's
 * name, category, duration and arguments (the browser's tooltip). A small inline script zooms
 * (wheel) and pans (drag) the time axis by rewriting those elements' x and width; labels show
 * where their span is wide enough.
 *
 * Plain C, no library: it reads the merged file line by line (one event per line, as merge writes
 * it) and picks fields out of each line; strings are JSON-unescaped and HTML-escaped. Beyond
 * MAX_EVENTS events the rest is left out (said on stderr and on the page).
 *
 * Exit status: 0 written, 1 an error (said on stderr), 2 usage.
 */
#define _GNU_SOURCE
#include "trace_html.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_EVENTS 200000
#define ROW_PX 18   /* one nesting level of a track */
#define LABEL_PX 230 /* the track names' column */
#define WIDTH_PX 1400 /* the time axis at the first zoom */

typedef struct ev {
  char ph;
  int pid, tid;
  double ts, dur; /* microseconds */
  unsigned long long id;
  char name[96], cat[32];
  char *args; /* the raw args object, or NULL */
  int track, row;
} ev;

typedef struct track {
  int pid, tid; /* tid -1: the async calls of pid */
  int rows;
  double y;
} track;

typedef struct trace {
  ev *e;
  int n, cap, dropped;
  track *t;
  int nt;
  char (*pname)[128]; /* process names by pid (pid < npname) */
  int npname;
  double t0, t1;
} trace;

/* ---- reading ---- */

/* The value of "key": in line: a string (unescaped into out) or a number (copied); NULL when
 * absent. */
static const char *field(const char *line, const char *key, char *out, size_t n) {
  char k[40];
  snprintf(k, sizeof k, "\"%s\":", key);
  const char *p = strstr(line, k);
  if (!p || n == 0) return NULL;
  p += strlen(k);
  size_t o = 0;
  if (*p == '"') {
    for (p++; *p && *p != '"'; p++) {
      char c = *p;
      if (c == '\\' && p[1]) {
        c = *++p;
        if (c == 'n' || c == 't' || c == 'r') c = ' ';
        else if (c == 'u') { /* \u00XX from the recorder's escaping: shown as '?' */
          for (int i = 0; i < 4 && p[1]; i++) p++;
          c = '?';
        }
      }
      if (o + 1 < n) out[o++] = c;
    }
  } else {
    while (*p && *p != ',' && *p != '}' && o + 1 < n) out[o++] = *p++;
  }
  out[o] = 0;
  return out;
}

/* The raw text of the "args" object of line (balanced braces, strings skipped), or NULL. */
static char *raw_args(const char *line) {
  const char *p = strstr(line, "\"args\":{");
  if (!p) return NULL;
  p += 7;
  int depth = 0;
  bool str = false;
  const char *q = p;
  for (; *q; q++) {
    if (str) {
      if (*q == '\\' && q[1]) q++;
      else if (*q == '"') str = false;
    } else if (*q == '"') {
      str = true;
    } else if (*q == '{') {
      depth++;
    } else if (*q == '}' && --depth == 0) {
      break;
    }
  }
  if (!*q) return NULL;
  return strndup(p, (size_t)(q - p + 1));
}

static void set_pname(trace *tr, int pid, const char *name) {
  if (pid < 0 || pid > 1 << 20) return;
  if (pid >= tr->npname) {
    void *p = realloc(tr->pname, (size_t)(pid + 1) * sizeof *tr->pname);
    if (!p) return;
    tr->pname = p;
    for (int i = tr->npname; i <= pid; i++) tr->pname[i][0] = 0;
    tr->npname = pid + 1;
  }
  snprintf(tr->pname[pid], sizeof tr->pname[pid], "%s", name);
}

static int read_line(trace *tr, const char *line) {
  char b[128];
  if (line[0] != '{' || !field(line, "ph", b, sizeof b)) return 0;
  ev e = {.ph = b[0]};
  if (!field(line, "pid", b, sizeof b)) return 0;
  e.pid = atoi(b);
  e.tid = field(line, "tid", b, sizeof b) ? atoi(b) : 0;
  if (e.ph == 'M') {
    char nm[64], a[128] = "";
    const char *args = strstr(line, "\"args\":");
    if (field(line, "name", nm, sizeof nm) && strcmp(nm, "process_name") == 0 && args &&
        field(args, "name", a, sizeof a))
      set_pname(tr, e.pid, a);
    return 0;
  }
  if (!strchr("XBEbeisfIn", e.ph) || !field(line, "ts", b, sizeof b)) return 0;
  e.ts = strtod(b, NULL);
  e.dur = field(line, "dur", b, sizeof b) ? strtod(b, NULL) : 0;
  if (e.dur < 0) e.dur = 0;
  e.id = field(line, "id", b, sizeof b) ? strtoull(b, NULL, 0) : 0;
  if (!field(line, "name", e.name, sizeof e.name)) snprintf(e.name, sizeof e.name, "?");
  if (!field(line, "cat", e.cat, sizeof e.cat)) e.cat[0] = 0;
  if (tr->n == MAX_EVENTS) {
    tr->dropped++;
    return 0;
  }
  if (tr->n == tr->cap) {
    int cap = tr->cap ? tr->cap * 2 : 1024;
    ev *p = realloc(tr->e, (size_t)cap * sizeof *p);
    if (!p) return -1;
    tr->e = p;
    tr->cap = cap;
  }
  e.args = raw_args(line);
  tr->e[tr->n++] = e;
  return 0;
}

static int load(const char *path, trace *tr) {
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "tdist-trace: cannot open %s: %s\n", path, strerror(errno));
    return -1;
  }
  char *line = NULL;
  size_t cap = 0;
  int rc = 0;
  while (rc == 0 && getline(&line, &cap, f) > 0) rc = read_line(tr, line);
  free(line);
  fclose(f);
  return rc;
}

/* ---- layout ---- */

static int cmp_ts(const void *a, const void *b) {
  const ev *x = a, *y = b;
  if (x->ts != y->ts) return x->ts < y->ts ? -1 : 1;
  bool xe = x->ph == 'E' || x->ph == 'e', ye = y->ph == 'E' || y->ph == 'e';
  if (xe != ye) return xe ? 1 : -1; /* an end after a begin at the same time */
  return x->dur > y->dur ? -1 : x->dur < y->dur; /* the enclosing span first */
}

static int track_of(trace *tr, int pid, int tid) {
  for (int i = 0; i < tr->nt; i++)
    if (tr->t[i].pid == pid && tr->t[i].tid == tid) return i;
  track *p = realloc(tr->t, (size_t)(tr->nt + 1) * sizeof *p);
  if (!p) return -1;
  tr->t = p;
  tr->t[tr->nt] = (track){pid, tid, 1, 0};
  return tr->nt++;
}

/* B/E pairs become X spans, b/e pairs spans on their pid's async track (ph 'b' kept), so that
 * every drawn event has a start and a duration. Unmatched ends are dropped, unmatched begins end
 * at the run's end. */
static void pair_up(trace *tr) {
  for (int i = 0; i < tr->n; i++) {
    ev *e = &tr->e[i];
    if (e->ph != 'B' && e->ph != 'b') continue;
    char close = e->ph == 'B' ? 'E' : 'e';
    e->dur = -1;
    for (int k = i + 1; k < tr->n; k++) {
      ev *c = &tr->e[k];
      if (c->ph != close || c->pid != e->pid) continue;
      if (close == 'E' ? c->tid != e->tid : (c->id != e->id || strcmp(c->name, e->name) != 0))
        continue;
      e->dur = c->ts - e->ts;
      c->ph = 0; /* consumed */
      break;
    }
    if (e->dur < 0) e->dur = tr->t1 - e->ts;
    if (e->ph == 'B') e->ph = 'X';
  }
}

/* Rows: a thread's spans nest (a span starting inside an open one goes one row down); async
 * calls take the first lane free at their start. */
static void place(trace *tr) {
  enum { DEPTH = 64 };
  for (int t = 0; t < tr->nt; t++) {
    double ends[DEPTH];
    int depth = 0;
    for (int i = 0; i < tr->n; i++) {
      ev *e = &tr->e[i];
      if (e->track != t || (e->ph != 'X' && e->ph != 'b' && e->ph != 'i' && e->ph != 'I'))
        continue;
      if (e->ph == 'b') { /* lanes */
        int r = 0;
        while (r < depth && ends[r] > e->ts) r++;
        if (r == DEPTH) r = DEPTH - 1;
        if (r == depth && depth < DEPTH) depth++;
        ends[r] = e->ts + e->dur;
        e->row = r;
      } else {
        while (depth > 0 && ends[depth - 1] <= e->ts) depth--;
        e->row = depth < DEPTH ? depth : DEPTH - 1;
        if (e->ph == 'X' && depth < DEPTH) ends[depth++] = e->ts + e->dur;
      }
      if (e->row + 1 > tr->t[t].rows) tr->t[t].rows = e->row + 1;
    }
  }
}

static int cmp_track(const void *a, const void *b) {
  const track *x = a, *y = b;
  if (x->pid != y->pid) return x->pid - y->pid;
  if ((x->tid < 0) != (y->tid < 0)) return x->tid < 0 ? 1 : -1; /* calls under the threads */
  return x->tid - y->tid;
}

static int layout(trace *tr) {
  if (tr->n == 0) return 0;
  qsort(tr->e, (size_t)tr->n, sizeof *tr->e, cmp_ts);
  tr->t0 = tr->e[0].ts;
  tr->t1 = tr->t0;
  for (int i = 0; i < tr->n; i++)
    if (tr->e[i].ts + tr->e[i].dur > tr->t1) tr->t1 = tr->e[i].ts + tr->e[i].dur;
  pair_up(tr);
  for (int i = 0; i < tr->n; i++) { /* tracks, in order, so that place() sees them */
    ev *e = &tr->e[i];
    if (!e->ph || e->ph == 'E' || e->ph == 'e') continue;
    if (track_of(tr, e->pid, e->ph == 'b' ? -1 : e->tid) < 0) return -1;
  }
  qsort(tr->t, (size_t)tr->nt, sizeof *tr->t, cmp_track);
  for (int i = 0; i < tr->n; i++) {
    ev *e = &tr->e[i];
    e->track = !e->ph || e->ph == 'E' || e->ph == 'e' ? -1
                                                      : track_of(tr, e->pid, e->ph == 'b' ? -1 : e->tid);
  }
  place(tr);
  double y = 40;
  for (int t = 0; t < tr->nt; t++) {
    tr->t[t].y = y;
    y += tr->t[t].rows * ROW_PX + 8;
  }
  return 0;
}

/* ---- writing ---- */

static void esc(FILE *o, const char *s) {
  for (; s && *s; s++) {
    switch (*s) {
      case '<': fputs("&lt;", o); break;
      case '>': fputs("&gt;", o); break;
      case '&': fputs("&amp;", o); break;
      case '"': fputs("&quot;", o); break;
      default: fputc((unsigned char)*s < ' ' ? ' ' : *s, o);
    }
  }
}

static const char *const palette[] = {"#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2",
                                      "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"};

static const char *color(const char *cat) {
  unsigned h = 5381;
  for (; *cat; cat++) h = h * 33 + (unsigned char)*cat;
  return palette[h % (sizeof palette / sizeof *palette)];
}

static double px(const trace *tr, double t) {
  double span = tr->t1 > tr->t0 ? tr->t1 - tr->t0 : 1;
  return LABEL_PX + (t - tr->t0) * WIDTH_PX / span;
}

static void track_name(const trace *tr, const track *t, FILE *o) {
  if (t->pid >= 0 && t->pid < tr->npname && tr->pname[t->pid][0]) esc(o, tr->pname[t->pid]);
  else fprintf(o, "process %d", t->pid);
  if (t->tid < 0) fputs(": calls", o);
  else fprintf(o, ": thread %d", t->tid);
}

static void write_event(const trace *tr, const ev *e, FILE *o) {
  const track *t = &tr->t[e->track];
  double y = t->y + e->row * ROW_PX;
  double x = px(tr, e->ts), w = px(tr, e->ts + e->dur) - x;
  bool instant = e->ph == 'i' || e->ph == 'I';
  fprintf(o, "<g class=\"ev\" data-t=\"%.3f\" data-d=\"%.3f\">", e->ts - tr->t0,
          instant ? -1.0 : e->dur); /* -1: an instant, drawn as a tick */
  fputs("<title>", o);
  esc(o, e->name);
  fprintf(o, " [%s] at %.3f ms", e->cat, (e->ts - tr->t0) * 1e-3);
  if (!instant) fprintf(o, ", %.3f ms", e->dur * 1e-3);
  if (e->args) {
    fputc(' ', o);
    esc(o, e->args);
  }
  fputs("</title>", o);
  if (instant) {
    fprintf(o, "<rect x=\"%.2f\" y=\"%.1f\" width=\"2\" height=\"%d\" fill=\"#000\"/>", x, y,
            ROW_PX - 2);
  } else {
    fprintf(o, "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%d\" fill=\"%s\"%s/>", x, y,
            w > 0.5 ? w : 0.5, ROW_PX - 2, color(e->cat),
            e->ph == 'b' ? " fill-opacity=\"0.55\"" : "");
    fprintf(o, "<text x=\"%.2f\" y=\"%.1f\"%s>", x + 2, y + ROW_PX - 6,
            w >= 60 ? "" : " visibility=\"hidden\"");
    esc(o, e->name);
    fputs("</text>", o);
  }
  fputs("</g>\n", o);
}

/* Flow arrows: from each "s" to the "f" with its id. */
static void write_flows(const trace *tr, FILE *o) {
  for (int i = 0; i < tr->n; i++) {
    const ev *s = &tr->e[i];
    if (s->ph != 's' || s->track < 0) continue;
    for (int k = i; k < tr->n; k++) {
      const ev *f = &tr->e[k];
      if (f->ph != 'f' || f->id != s->id || f->track < 0) continue;
      fprintf(o, "<line class=\"flow\" data-t=\"%.3f\" data-t2=\"%.3f\" x1=\"%.2f\" y1=\"%.1f\" "
              "x2=\"%.2f\" y2=\"%.1f\" stroke=\"#c00\" stroke-opacity=\"0.6\"/>\n", s->ts - tr->t0, f->ts - tr->t0, px(tr, s->ts),
              tr->t[s->track].y + ROW_PX / 2.0, px(tr, f->ts), tr->t[f->track].y + ROW_PX / 2.0);
      break;
    }
  }
}

/* The page's script: zoom (wheel, around the pointer) and pan (drag) the time axis; labels show
 * when their span is at least 60 px wide; the axis' ticks follow. */
static const char *const script =
    "(function(){\n"
    "var svg=document.getElementById('tl'),L=+svg.dataset.label,W=+svg.dataset.width,\n"
    "T=+svg.dataset.span,s=W/T,off=0,evs=svg.querySelectorAll('g.ev'),\n"
    "fl=svg.querySelectorAll('line.flow'),ax=document.getElementById('axis');\n"
    "function X(t){return L+(t-off)*s;}\n"
    "function fmt(us){return us>=1e6?(us/1e6).toFixed(3)+' s':us>=1e3?(us/1e3).toFixed(3)+' ms'"
    ":us.toFixed(1)+' us';}\n"
    "function draw(){\n"
    " for(var i=0;i<evs.length;i++){var g=evs[i],t=+g.dataset.t,d=+g.dataset.d,\n"
    "  r=g.firstElementChild.nextElementSibling,x=X(t),w=Math.max(d*s,0.5);\n"
    "  r.setAttribute('x',x);if(d>=0)r.setAttribute('width',w);\n"
    "  var tx=r.nextElementSibling;if(tx){tx.setAttribute('x',x+2);\n"
    "  tx.setAttribute('visibility',w>=60&&x+w>L?'visible':'hidden');}}\n"
    " for(var k=0;k<fl.length;k++){fl[k].setAttribute('x1',X(+fl[k].dataset.t));\n"
    "  fl[k].setAttribute('x2',X(+fl[k].dataset.t2));}\n"
    " var step=Math.pow(10,Math.floor(Math.log10(T/s/W*150+1e-9)+1e-9)),h='';\n"
    " for(var u=Math.ceil(off/step)*step;u<off+W/s;u+=step)"
    "h+='<line x1=\"'+X(u)+'\" x2=\"'+X(u)+'\" y1=\"22\" y2=\"32\" stroke=\"#666\"/>'+\n"
    "  '<text x=\"'+(X(u)+2)+'\" y=\"18\">'+fmt(u)+'</text>';\n"
    " ax.innerHTML=h;}\n"
    "svg.addEventListener('wheel',function(e){e.preventDefault();\n"
    " var t=off+(e.offsetX-L)/s,f=e.deltaY<0?1.25:0.8;s=Math.max(W/T/2,s*f);\n"
    " off=Math.max(0,t-(e.offsetX-L)/s);draw();},{passive:false});\n"
    "var drag=null;svg.addEventListener('mousedown',function(e){drag={x:e.clientX,o:off};});\n"
    "window.addEventListener('mouseup',function(){drag=null;});\n"
    "window.addEventListener('mousemove',function(e){if(!drag)return;\n"
    " off=Math.max(0,drag.o-(e.clientX-drag.x)/s);draw();});\n"
    "document.getElementById('reset').onclick=function(){s=W/T;off=0;draw();};\n"
    "draw();})();\n";

static int write_page(const trace *tr, const char *src, FILE *o) {
  double height = 40;
  for (int t = 0; t < tr->nt; t++) height = tr->t[t].y + tr->t[t].rows * ROW_PX + 8;
  double span = tr->t1 > tr->t0 ? tr->t1 - tr->t0 : 1;
  fputs("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">\n<title>tdist trace: ", o);
  esc(o, src);
  fputs("</title>\n<style>body{font:12px sans-serif;margin:8px}svg{background:#fff;"
        "user-select:none;cursor:grab}text{font:11px sans-serif;pointer-events:none}"
        ".lbl{font-weight:bold}line.flow{stroke:#c00;stroke-width:1;opacity:.6}"
        "g.ev:hover rect{stroke:#000}</style>\n</head><body>\n", o);
  fputs("<div>tdist trace of ", o);
  esc(o, src);
  fprintf(o, ": %d events, %d tracks, %.3f ms (wheel: zoom, drag: pan, hover: details) "
          "<button id=\"reset\">whole run</button>", tr->n, tr->nt, span * 1e-3);
  if (tr->dropped) fprintf(o, " <b>%d more events left out</b>", tr->dropped);
  fputs("</div>\n", o);
  fprintf(o, "<svg id=\"tl\" width=\"%d\" height=\"%.0f\" "
          "data-label=\"%d\" data-width=\"%d\" data-span=\"%.3f\">\n",
          LABEL_PX + WIDTH_PX + 20, height, LABEL_PX, WIDTH_PX, span);
  fputs("<g id=\"axis\">", o); /* drawn again by the script as it zooms */
  double step = 1;
  while (span / step > 10) step *= 10;
  while (span / step < 4) step /= 2;
  for (double u = 0; u <= span; u += step)
    fprintf(o, "<line x1=\"%.2f\" x2=\"%.2f\" y1=\"22\" y2=\"32\" stroke=\"#666\"/>"
            "<text x=\"%.2f\" y=\"18\">%.3f ms</text>", px(tr, tr->t0 + u), px(tr, tr->t0 + u),
            px(tr, tr->t0 + u) + 2, u * 1e-3);
  fputs("</g>\n", o);
  for (int t = 0; t < tr->nt; t++) {
    fprintf(o, "<rect x=\"0\" y=\"%.1f\" width=\"%d\" height=\"%d\" fill=\"%s\"/>", tr->t[t].y - 4,
            LABEL_PX + WIDTH_PX + 20, tr->t[t].rows * ROW_PX + 8, t % 2 ? "#f4f4f4" : "#fafafa");
    fprintf(o, "<text class=\"lbl\" x=\"4\" y=\"%.1f\">", tr->t[t].y + ROW_PX - 6);
    track_name(tr, &tr->t[t], o);
    fputs("</text>\n", o);
  }
  for (int i = 0; i < tr->n; i++)
    if (tr->e[i].track >= 0 && tr->e[i].ph && strchr("XbiI", tr->e[i].ph))
      write_event(tr, &tr->e[i], o);
  write_flows(tr, o);
  fprintf(o, "<rect x=\"0\" y=\"0\" width=\"%d\" height=\"%.0f\" fill=\"#fff\" "
          "fill-opacity=\"0\" pointer-events=\"none\"/>\n</svg>\n<script>\n%s</script>\n"
          "</body></html>\n", LABEL_PX, height, script);
  return ferror(o) ? -1 : 0;
}

int td_trace_html_main(int argc, char **argv) {
  if (argc < 3 || (argc != 3 && (argc != 5 || strcmp(argv[3], "-o") != 0))) {
    fprintf(stderr, "usage: tdist-trace html RUN.json [-o OUT.html]   (RUN.json: from merge)\n");
    return 2;
  }
  const char *in = argv[2];
  char out[1200];
  if (argc == 5) {
    snprintf(out, sizeof out, "%s", argv[4]);
  } else {
    size_t l = strlen(in);
    snprintf(out, sizeof out, "%.*s.html", (int)(l > 5 && !strcmp(in + l - 5, ".json") ? l - 5 : l),
             in);
  }
  trace tr = {0};
  int rc = load(in, &tr) == 0 && layout(&tr) == 0 ? 0 : 1;
  if (rc == 0 && tr.n == 0) {
    fprintf(stderr, "tdist-trace: no events in %s\n", in);
    rc = 1;
  }
  char tmp[1300];
  snprintf(tmp, sizeof tmp, "%s.tmp", out);
  FILE *o = rc == 0 ? fopen(tmp, "w") : NULL;
  if (rc == 0 && !o) {
    fprintf(stderr, "tdist-trace: cannot write %s: %s\n", tmp, strerror(errno));
    rc = 1;
  }
  if (o) {
    bool ok = write_page(&tr, in, o) == 0;
    if (fclose(o) != 0 || !ok || rename(tmp, out) != 0) {
      fprintf(stderr, "tdist-trace: cannot write %s: %s\n", out, strerror(errno));
      unlink(tmp);
      rc = 1;
    }
  }
  if (rc == 0) {
    if (tr.dropped)
      fprintf(stderr, "tdist-trace: %d events past the first %d left out of the page\n",
              tr.dropped, MAX_EVENTS);
    fprintf(stderr, "tdist-trace: wrote %s (%d events, %d tracks)\n", out, tr.n, tr.nt);
  }
  for (int i = 0; i < tr.n; i++) free(tr.e[i].args);
  free(tr.e), free(tr.t), free(tr.pname);
  return rc;
}
