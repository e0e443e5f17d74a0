/* json.c - a small, strict JSON parser and writer for safetensors headers.
 *
 * The parser implements RFC 8259 completely (objects, arrays, strings with every escape including
 * surrogate pairs, numbers, true/false/null) but is built for untrusted input rather than speed:
 * every read is bounds-checked against the given length, nesting is limited to MAX_DEPTH, strings
 * must be valid UTF-8, duplicate object keys are rejected, and every error is TD_ERR_FORMAT
 * carrying the byte offset. The result is a small tree (td__json) freed with td__json_free().
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "modules_impl.h"

#define MAX_DEPTH 64

typedef struct parser {
  const char *s;
  size_t len, pos;
  td_status st; /* first failure */
} parser;

static bool fail(parser *p, const char *fmt, ...) TD_PRINTF(2, 3);
static bool fail(parser *p, const char *fmt, ...) {
  if (p->st != TD_OK) return false;
  char msg[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  p->st = td_set_error(TD_ERR_FORMAT, "JSON header: %s at byte %zu", msg, p->pos);
  return false;
}

static bool nomem(parser *p) {
  if (p->st == TD_OK) p->st = td_set_error(TD_ERR_NOMEM, "JSON header: out of memory");
  return false;
}

static void skip_ws(parser *p) {
  while (p->pos < p->len) {
    char c = p->s[p->pos];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    p->pos++;
  }
}

static bool peek(parser *p, char *c) {
  if (p->pos >= p->len) return false;
  *c = p->s[p->pos];
  return true;
}

/* ---- strings ---- */

typedef struct sbuf {
  char *d;
  size_t n, cap;
} sbuf;

static bool sbuf_put(parser *p, sbuf *b, const char *s, size_t n) {
  if (b->n + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 16;
    while (cap < b->n + n + 1) cap *= 2;
    char *d = td__realloc(b->d, cap);
    if (!d) return nomem(p);
    b->d = d;
    b->cap = cap;
  }
  memcpy(b->d + b->n, s, n);
  b->n += n;
  b->d[b->n] = '\0';
  return true;
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

static bool read_hex4(parser *p, unsigned *out) {
  if (p->len - p->pos < 4) return fail(p, "truncated \\u escape");
  unsigned v = 0;
  for (int i = 0; i < 4; i++) {
    int h = hexval(p->s[p->pos + (size_t)i]);
    if (h < 0) return fail(p, "bad hex digit in \\u escape");
    v = v * 16 + (unsigned)h;
  }
  p->pos += 4;
  *out = v;
  return true;
}

static size_t utf8_encode(unsigned cp, char *out) {
  if (cp < 0x80) {
    out[0] = (char)cp;
    return 1;
  }
  if (cp < 0x800) {
    out[0] = (char)(0xC0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
  }
  if (cp < 0x10000) {
    out[0] = (char)(0xE0 | (cp >> 12));
    out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[2] = (char)(0x80 | (cp & 0x3F));
    return 3;
  }
  out[0] = (char)(0xF0 | (cp >> 18));
  out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
  out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
  out[3] = (char)(0x80 | (cp & 0x3F));
  return 4;
}

/* utf8_len returns the length of the valid UTF-8 sequence at s[0..n), or 0 when invalid
 * (overlong forms, surrogates and code points past U+10FFFF are invalid). */
static size_t utf8_len(const unsigned char *s, size_t n) {
  unsigned c = s[0];
  size_t len;
  unsigned cp;
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) len = 2, cp = c & 0x1F;
  else if (c >= 0xE0 && c <= 0xEF) len = 3, cp = c & 0x0F;
  else if (c >= 0xF0 && c <= 0xF4) len = 4, cp = c & 0x07;
  else return 0;
  if (n < len) return 0;
  for (size_t i = 1; i < len; i++) {
    if ((s[i] & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (s[i] & 0x3F);
  }
  if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF))) return 0;
  if (cp >= 0xD800 && cp <= 0xDFFF) return 0;
  return len;
}

/* parse_string reads a string starting at the opening quote into a new NUL-terminated buffer. */
static bool parse_string(parser *p, char **out, size_t *out_len) {
  sbuf b = {0};
  p->pos++; /* opening quote */
  if (!sbuf_put(p, &b, "", 0)) return false;
  for (;;) {
    if (p->pos >= p->len) {
      fail(p, "unterminated string");
      goto bad;
    }
    unsigned char c = (unsigned char)p->s[p->pos];
    if (c == '"') {
      p->pos++;
      break;
    }
    if (c < 0x20) {
      fail(p, "control character in string");
      goto bad;
    }
    if (c != '\\') {
      size_t n = utf8_len((const unsigned char *)p->s + p->pos, p->len - p->pos);
      if (n == 0) {
        fail(p, "invalid UTF-8 in string");
        goto bad;
      }
      if (!sbuf_put(p, &b, p->s + p->pos, n)) goto bad;
      p->pos += n;
      continue;
    }
    p->pos++;
    if (p->pos >= p->len) {
      fail(p, "truncated escape");
      goto bad;
    }
    char e = p->s[p->pos++];
    char tmp[4];
    size_t tn = 1;
    switch (e) {
      case '"': tmp[0] = '"'; break;
      case '\\': tmp[0] = '\\'; break;
      case '/': tmp[0] = '/'; break;
      case 'b': tmp[0] = '\b'; break;
      case 'f': tmp[0] = '\f'; break;
      case 'n': tmp[0] = '\n'; break;
      case 'r': tmp[0] = '\r'; break;
      case 't': tmp[0] = '\t'; break;
      case 'u': {
        unsigned cp;
        if (!read_hex4(p, &cp)) goto bad;
        if (cp >= 0xDC00 && cp <= 0xDFFF) {
          fail(p, "unpaired low surrogate");
          goto bad;
        }
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          unsigned lo;
          if (p->len - p->pos < 2 || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u') {
            fail(p, "unpaired high surrogate");
            goto bad;
          }
          p->pos += 2;
          if (!read_hex4(p, &lo)) goto bad;
          if (lo < 0xDC00 || lo > 0xDFFF) {
            fail(p, "bad low surrogate");
            goto bad;
          }
          cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        }
        tn = utf8_encode(cp, tmp);
        break;
      }
      default:
        p->pos--;
        fail(p, "bad escape '\\%c'", e);
        goto bad;
    }
    if (!sbuf_put(p, &b, tmp, tn)) goto bad;
  }
  *out = b.d;
  *out_len = b.n;
  return true;
bad:
  td__free(b.d);
  return false;
}

/* ---- numbers ---- */

static bool is_digit(char c) { return c >= '0' && c <= '9'; }

static bool parse_number(parser *p, td__json *v) {
  size_t start = p->pos;
  bool neg = false, integral = true, overflow = false;
  uint64_t u = 0;
  if (p->s[p->pos] == '-') {
    neg = true;
    p->pos++;
  }
  if (p->pos >= p->len || !is_digit(p->s[p->pos])) return fail(p, "bad number");
  if (p->s[p->pos] == '0') {
    p->pos++;
    if (p->pos < p->len && is_digit(p->s[p->pos])) return fail(p, "leading zero in number");
  } else {
    while (p->pos < p->len && is_digit(p->s[p->pos])) {
      unsigned d = (unsigned)(p->s[p->pos] - '0');
      if (u > (UINT64_MAX - d) / 10) overflow = true;
      else u = u * 10 + d;
      p->pos++;
    }
  }
  if (p->pos < p->len && p->s[p->pos] == '.') {
    integral = false;
    p->pos++;
    if (p->pos >= p->len || !is_digit(p->s[p->pos])) return fail(p, "bad fraction in number");
    while (p->pos < p->len && is_digit(p->s[p->pos])) p->pos++;
  }
  if (p->pos < p->len && (p->s[p->pos] == 'e' || p->s[p->pos] == 'E')) {
    integral = false;
    p->pos++;
    if (p->pos < p->len && (p->s[p->pos] == '+' || p->s[p->pos] == '-')) p->pos++;
    if (p->pos >= p->len || !is_digit(p->s[p->pos])) return fail(p, "bad exponent in number");
    while (p->pos < p->len && is_digit(p->s[p->pos])) p->pos++;
  }
  char buf[64];
  size_t n = p->pos - start;
  if (n >= sizeof buf) n = sizeof buf - 1; /* a long literal only loses precision in num */
  memcpy(buf, p->s + start, n);
  buf[n] = '\0';
  v->type = TD__JSON_NUMBER;
  v->num = strtod(buf, NULL);
  v->is_uint = integral && !neg && !overflow;
  v->u = v->is_uint ? u : 0;
  return true;
}

/* ---- values ---- */

static bool parse_value(parser *p, td__json *v, int depth);

static bool literal(parser *p, const char *word) {
  size_t n = strlen(word);
  if (p->len - p->pos < n || memcmp(p->s + p->pos, word, n) != 0)
    return fail(p, "unexpected character '%c'", p->s[p->pos]);
  p->pos += n;
  return true;
}

static bool grow_items(parser *p, td__json *v, size_t *cap, bool with_keys) {
  if (v->n < *cap) return true;
  size_t c = *cap ? *cap * 2 : 4;
  td__json *items = td__realloc(v->items, c * sizeof *items);
  if (!items) return nomem(p);
  v->items = items;
  if (with_keys) {
    char **keys = td__realloc(v->keys, c * sizeof *keys);
    if (!keys) return nomem(p);
    v->keys = keys;
    size_t *lens = td__realloc(v->key_lens, c * sizeof *lens);
    if (!lens) return nomem(p);
    v->key_lens = lens;
  }
  *cap = c;
  return true;
}

static bool parse_array(parser *p, td__json *v, int depth) {
  v->type = TD__JSON_ARRAY;
  size_t cap = 0;
  p->pos++; /* [ */
  skip_ws(p);
  char c;
  if (peek(p, &c) && c == ']') {
    p->pos++;
    return true;
  }
  for (;;) {
    if (!grow_items(p, v, &cap, false)) return false;
    memset(&v->items[v->n], 0, sizeof v->items[0]);
    v->n++;
    if (!parse_value(p, &v->items[v->n - 1], depth + 1)) return false;
    skip_ws(p);
    if (!peek(p, &c)) return fail(p, "unterminated array");
    p->pos++;
    if (c == ']') return true;
    if (c != ',') {
      p->pos--;
      return fail(p, "expected ',' or ']' in array");
    }
  }
}

static bool parse_object(parser *p, td__json *v, int depth) {
  v->type = TD__JSON_OBJECT;
  size_t cap = 0;
  p->pos++; /* { */
  skip_ws(p);
  char c;
  if (peek(p, &c) && c == '}') {
    p->pos++;
    return true;
  }
  for (;;) {
    skip_ws(p);
    if (!peek(p, &c)) return fail(p, "unterminated object");
    if (c != '"') return fail(p, "expected a string key in object");
    if (!grow_items(p, v, &cap, true)) return false;
    size_t key_pos = p->pos;
    char *key;
    size_t key_len;
    if (!parse_string(p, &key, &key_len)) return false;
    for (size_t i = 0; i < v->n; i++) {
      if (v->key_lens[i] == key_len && memcmp(v->keys[i], key, key_len) == 0) {
        td__free(key);
        p->pos = key_pos;
        return fail(p, "duplicate key \"%.64s\"", v->keys[i]);
      }
    }
    memset(&v->items[v->n], 0, sizeof v->items[0]);
    v->keys[v->n] = key;
    v->key_lens[v->n] = key_len;
    v->n++;
    skip_ws(p);
    if (!peek(p, &c) || c != ':') return fail(p, "expected ':' after object key");
    p->pos++;
    if (!parse_value(p, &v->items[v->n - 1], depth + 1)) return false;
    skip_ws(p);
    if (!peek(p, &c)) return fail(p, "unterminated object");
    p->pos++;
    if (c == '}') return true;
    if (c != ',') {
      p->pos--;
      return fail(p, "expected ',' or '}' in object");
    }
  }
}

static bool parse_value(parser *p, td__json *v, int depth) {
  if (depth > MAX_DEPTH) return fail(p, "nesting deeper than %d", MAX_DEPTH);
  skip_ws(p);
  char c;
  if (!peek(p, &c)) return fail(p, "unexpected end of input");
  switch (c) {
    case '{': return parse_object(p, v, depth);
    case '[': return parse_array(p, v, depth);
    case '"':
      v->type = TD__JSON_STRING;
      return parse_string(p, &v->str, &v->len);
    case 't':
      v->type = TD__JSON_BOOL;
      v->boolean = true;
      return literal(p, "true");
    case 'f':
      v->type = TD__JSON_BOOL;
      return literal(p, "false");
    case 'n':
      v->type = TD__JSON_NULL;
      return literal(p, "null");
    default:
      if (c == '-' || is_digit(c)) return parse_number(p, v);
      if ((unsigned char)c >= 0x20 && (unsigned char)c < 0x7F)
        return fail(p, "unexpected character '%c'", c);
      return fail(p, "unexpected byte 0x%02x", (unsigned)(unsigned char)c);
  }
}

static void json_fini(td__json *v) {
  td__free(v->str);
  for (size_t i = 0; i < v->n; i++) {
    json_fini(&v->items[i]);
    if (v->keys) td__free(v->keys[i]);
  }
  td__free(v->items);
  td__free(v->keys);
  td__free(v->key_lens);
}

void td__json_free(td__json *v) {
  if (!v) return;
  json_fini(v);
  td__free(v);
}

td_status td__json_parse(const char *text, size_t len, td__json **out) {
  TD_CHECK_ARG(text && out, "td__json_parse: NULL argument");
  parser p = {text, len, 0, TD_OK};
  td__json *v = td__calloc(1, sizeof *v);
  if (!v) return td_set_error(TD_ERR_NOMEM, "JSON header: out of memory");
  if (parse_value(&p, v, 0)) {
    skip_ws(&p);
    if (p.pos != p.len) fail(&p, "trailing characters after the JSON value");
  }
  if (p.st != TD_OK) {
    td__json_free(v);
    return p.st;
  }
  *out = v;
  return TD_OK;
}

const td__json *td__json_get(const td__json *v, const char *key) {
  if (!v || v->type != TD__JSON_OBJECT) return NULL;
  size_t n = strlen(key);
  for (size_t i = 0; i < v->n; i++)
    if (v->key_lens[i] == n && memcmp(v->keys[i], key, n) == 0) return &v->items[i];
  return NULL;
}

/* ---- writing ---- */

void td__json_buf_append(td__json_buf *b, const char *s, size_t n) {
  if (b->failed) return;
  if (b->len + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n + 1) cap *= 2;
    char *d = td__realloc(b->data, cap);
    if (!d) {
      b->failed = true;
      return;
    }
    b->data = d;
    b->cap = cap;
  }
  memcpy(b->data + b->len, s, n);
  b->len += n;
  b->data[b->len] = '\0';
}

void td__json_buf_printf(td__json_buf *b, const char *fmt, ...) {
  char tmp[256];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (n < 0 || (size_t)n >= sizeof tmp) {
    b->failed = true;
    return;
  }
  td__json_buf_append(b, tmp, (size_t)n);
}

void td__json_buf_string(td__json_buf *b, const char *s, size_t n) {
  td__json_buf_append(b, "\"", 1);
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c == '"' || c == '\\') {
      char e[2] = {'\\', (char)c};
      td__json_buf_append(b, e, 2);
    } else if (c < 0x20) {
      td__json_buf_printf(b, "\\u%04x", c);
    } else {
      td__json_buf_append(b, (const char *)&s[i], 1);
    }
  }
  td__json_buf_append(b, "\"", 1);
}
