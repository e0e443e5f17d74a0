/* idx.c - reader for IDX files of unsigned bytes (the MNIST file format), gzip or raw.
 *
 * Format: a 4-byte magic (0x00, 0x00, element type, ndim), ndim big-endian uint32 sizes, then the
 * elements in row-major order. Only type 0x08 (unsigned byte) is read.
 *
 * Design: the file is read through zlib's gz* interface, which also passes raw files through
 * (gzdirect() tells which it was). Nothing is trusted before it is checked: the data buffer grows
 * as bytes actually arrive (capped by what the header declares), so a corrupt header claiming
 * gigabytes cannot make us allocate them; after the declared bytes one more read must hit the end
 * of the stream, which also makes zlib verify the gzip CRC and length trailer.
 */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "../core/core.h"
#include "tdist/data.h"

/* Largest array accepted (bytes): far above any IDX data set, far below overflow. */
#define IDX_MAX_BYTES ((uint64_t)1 << 40)
/* First allocation for the data; doubled as bytes arrive. */
#define IDX_FIRST_CHUNK ((size_t)64 << 20)
/* Largest single gzread (its length is an unsigned int, its result an int). */
#define IDX_READ_CHUNK ((size_t)1 << 30)

/* read_full reads up to n bytes, stopping early only at end of stream or on error. Returns the
 * number of bytes read, or -1 on an error (see gzerror). */
static int64_t read_full(gzFile gz, void *buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    size_t want = n - got < IDX_READ_CHUNK ? n - got : IDX_READ_CHUNK;
    int r = gzread(gz, (uint8_t *)buf + got, (unsigned)want);
    if (r < 0) return -1;
    if (r == 0) break;
    got += (size_t)r;
  }
  return (int64_t)got;
}

/* zmsg returns zlib's message for gz without the "path: " prefix gzerror() puts in front. */
static const char *zmsg(gzFile gz, const char *path, int *errnum) {
  const char *msg = gzerror(gz, errnum);
  if (!msg || !*msg) return "unknown error";
  size_t n = strlen(path);
  if (!strncmp(msg, path, n) && !strncmp(msg + n, ": ", 2)) msg += n + 2;
  return msg;
}

/* stream_error turns the gz stream's error state into a status with path in the message. */
static td_status stream_error(gzFile gz, const char *path, const char *what) {
  int errnum = Z_OK;
  const char *msg = zmsg(gz, path, &errnum);
  if (errnum == Z_ERRNO)
    return td_set_error(TD_ERR_IO, "%s: read error while reading %s: %s", path, what,
                        strerror(errno));
  if (errnum == Z_MEM_ERROR) return td_set_error(TD_ERR_NOMEM, "%s: zlib out of memory", path);
  if (errnum == Z_BUF_ERROR)
    return td_set_error(TD_ERR_FORMAT, "%s: truncated file: gzip stream ends early (zlib: %s)",
                        path, msg);
  return td_set_error(TD_ERR_FORMAT, "%s: corrupt gzip data (zlib: %s)", path, msg);
}

/* short_read reports a stream that ended before `what` was complete. */
static td_status short_read(gzFile gz, const char *path, const char *what, uint64_t want,
                            uint64_t got) {
  int errnum = Z_OK;
  const char *msg = zmsg(gz, path, &errnum);
  if (errnum != Z_OK && errnum != Z_BUF_ERROR) return stream_error(gz, path, what);
  return td_set_error(TD_ERR_FORMAT,
                      "%s: truncated file: %s needs %llu bytes, only %llu present%s%s%s", path,
                      what, (unsigned long long)want, (unsigned long long)got,
                      errnum == Z_BUF_ERROR ? " (zlib: " : "",
                      errnum == Z_BUF_ERROR ? msg : "", errnum == Z_BUF_ERROR ? ")" : "");
}

static bool gzerror_ok(gzFile gz) {
  int errnum = Z_OK;
  gzerror(gz, &errnum);
  return errnum == Z_OK;
}

static td_status open_error(const char *path, int err) {
  if (err == ENOENT || err == ENOTDIR)
    return td_set_error(TD_ERR_NOT_FOUND, "%s: no such file", path);
  if (err == 0) return td_set_error(TD_ERR_NOMEM, "%s: cannot open (zlib out of memory)", path);
  return td_set_error(TD_ERR_IO, "%s: cannot open: %s", path, strerror(err));
}

/* check_header validates the 4-byte magic; direct says the file was not gzip-compressed. */
static td_status check_header(const char *path, const uint8_t m[4], bool direct,
                              int expect_ndim) {
  if (m[0] != 0 || m[1] != 0 || m[3] == 0) {
    if (direct)
      return td_set_error(TD_ERR_FORMAT,
                          "%s: neither a gzip file nor an IDX file (starts with %02x %02x %02x "
                          "%02x)",
                          path, m[0], m[1], m[2], m[3]);
    return td_set_error(TD_ERR_FORMAT,
                        "%s: bad IDX magic number 0x%02x%02x%02x%02x (expected 0x000008NN)", path,
                        m[0], m[1], m[2], m[3]);
  }
  if (m[2] != TD_IDX_TYPE_U8)
    return td_set_error(TD_ERR_FORMAT,
                        "%s: IDX element type 0x%02x is not supported (only unsigned bytes, 0x08)",
                        path, m[2]);
  if (m[3] > TD_MAX_DIMS)
    return td_set_error(TD_ERR_FORMAT, "%s: IDX header declares %d dimensions (at most %d)", path,
                        m[3], TD_MAX_DIMS);
  if (expect_ndim > 0 && m[3] != expect_ndim)
    return td_set_error(TD_ERR_FORMAT, "%s: IDX file has %d dimensions, expected %d (magic "
                        "0x000008%02x, expected 0x000008%02x)",
                        path, m[3], expect_ndim, m[3], expect_ndim);
  return TD_OK;
}

/* read_data reads exactly total bytes into a buffer grown as data arrives. */
static td_status read_data(gzFile gz, const char *path, size_t total, uint8_t **out) {
  size_t cap = total < IDX_FIRST_CHUNK ? total : IDX_FIRST_CHUNK;
  uint8_t *buf = td__malloc(cap ? cap : 1);
  if (!buf) return td_set_error(TD_ERR_NOMEM, "%s: cannot allocate %zu bytes", path, cap);
  size_t got = 0;
  while (got < total) {
    if (got == cap) {
      size_t ncap = cap > total / 2 ? total : cap * 2;
      uint8_t *nb = td__realloc(buf, ncap);
      if (!nb) {
        td__free(buf);
        return td_set_error(TD_ERR_NOMEM, "%s: cannot allocate %zu bytes", path, ncap);
      }
      buf = nb;
      cap = ncap;
    }
    int64_t r = read_full(gz, buf + got, cap - got);
    if (r < 0) {
      td__free(buf);
      return stream_error(gz, path, "the data");
    }
    got += (size_t)r;
    if (got < cap) break; /* end of stream */
  }
  if (got < total) {
    td_status s = short_read(gz, path, "the data its header declares", total, got);
    td__free(buf);
    return s;
  }
  *out = buf;
  return TD_OK;
}

td_status td_idx_read(const char *path, int expect_ndim, td_idx *out) {
  TD_CHECK_ARG(path && out, "td_idx_read: path and out must not be NULL");
  TD_CHECK_ARG(expect_ndim >= 0 && expect_ndim <= TD_MAX_DIMS,
               "td_idx_read: expect_ndim %d out of range", expect_ndim);
  errno = 0;
  gzFile gz = gzopen(path, "rb");
  if (!gz) return open_error(path, errno);
  gzbuffer(gz, 1u << 17);

  td_status s = TD_OK;
  uint8_t *data = NULL;
  td_idx a;
  memset(&a, 0, sizeof a);
  uint8_t magic[4];
  int64_t r = read_full(gz, magic, sizeof magic);
  if (r < 0) {
    s = stream_error(gz, path, "the IDX header");
    goto out;
  }
  if (r == 0 && gzerror_ok(gz)) {
    s = td_set_error(TD_ERR_FORMAT, "%s: empty file", path);
    goto out;
  }
  if (r < 4) {
    s = short_read(gz, path, "the IDX magic number", 4, (uint64_t)r);
    goto out;
  }
  if ((s = check_header(path, magic, gzdirect(gz) != 0, expect_ndim)) != TD_OK) goto out;

  a.ndim = magic[3];
  uint8_t dims[4 * TD_MAX_DIMS];
  size_t dbytes = 4 * (size_t)a.ndim;
  r = read_full(gz, dims, dbytes);
  if (r < 0) {
    s = stream_error(gz, path, "the IDX dimensions");
    goto out;
  }
  if ((size_t)r < dbytes) {
    s = short_read(gz, path, "the IDX dimensions", dbytes, (uint64_t)r);
    goto out;
  }
  uint64_t total = 1;
  for (int i = 0; i < a.ndim; i++) {
    const uint8_t *p = dims + 4 * i;
    uint64_t d = ((uint64_t)p[0] << 24) | ((uint64_t)p[1] << 16) | ((uint64_t)p[2] << 8) | p[3];
    a.dims[i] = (int64_t)d;
    if (d && total > IDX_MAX_BYTES / d) {
      s = td_set_error(TD_ERR_FORMAT, "%s: IDX dimensions declare more than %llu bytes", path,
                       (unsigned long long)IDX_MAX_BYTES);
      goto out;
    }
    total *= d;
  }
  if ((s = read_data(gz, path, (size_t)total, &data)) != TD_OK) goto out;

  /* The stream must end here; this read also makes zlib check the gzip trailer. */
  uint8_t extra;
  r = gzread(gz, &extra, 1);
  if (r < 0) {
    s = stream_error(gz, path, "the end of the file");
    goto out;
  }
  if (r > 0) {
    s = td_set_error(TD_ERR_FORMAT, "%s: file has data after the %llu bytes its IDX header "
                     "declares (wrong dimensions?)",
                     path, (unsigned long long)total);
    goto out;
  }
  if (!gzerror_ok(gz)) {
    s = stream_error(gz, path, "the gzip trailer");
    goto out;
  }
  a.data = data;
  a.nbytes = (size_t)total;
  data = NULL;
  *out = a;
out:
  td__free(data);
  gzclose_r(gz);
  return s;
}

void td_idx_fini(td_idx *a) {
  if (!a) return;
  td__free(a->data);
  memset(a, 0, sizeof *a);
}
