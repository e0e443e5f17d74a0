/* netaddr.c - Slurm node lists, job-derived ports and the choice of a listen address.
 *
 * Design. Node lists are handled in two passes over the text: a check pass that validates the
 * whole list and counts the hosts arithmetically (so "h[0-999999999]" is refused without
 * producing anything), then a generation pass that trusts the syntax and writes names, stopping
 * after a caller-chosen number of hosts (1 for td__slurm_first_host). Generation recurses once per
 * bracket group of an item; items have at most MAX_GROUPS groups, so the depth is bounded.
 *
 * The interface matcher and picker are pure functions over a list of td__ifaddr so that tests can
 * feed them made-up interfaces; td__choose_address is the only part that asks the system
 * (getifaddrs, getaddrinfo, a connected UDP socket, which sends nothing).
 *
 * This file uses libc plus td_set_error and td_log only (plain malloc/free, no core helpers):
 * tools/tdistrun compiles it in and supplies those two functions itself.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include "netaddr.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define MAX_GROUPS 8 /* bracket groups in one item ("r[1-2]n[1-4]" has 2) */
#define MAX_DIGITS 9 /* digits in one number, so values fit any unsigned long */

/* ---- Slurm node lists ---- */

static td_status list_error(const char *list, size_t pos, const char *what) {
  return td_set_error(TD_ERR_INVALID, "slurm node list '%.200s%s': %s at position %zu", list,
                      strlen(list) > 200 ? "..." : "", what, pos);
}

static bool is_digit(char c) { return c >= '0' && c <= '9'; }

/* parse_num reads a decimal number at s[*i] (before end); width is its digit count. */
static bool parse_num(const char *s, size_t *i, size_t end, unsigned long *v, int *width) {
  size_t k = *i;
  unsigned long x = 0;
  while (k < end && is_digit(s[k]) && k - *i < MAX_DIGITS + 1) x = x * 10 + (unsigned long)(s[k++] - '0');
  if (k == *i || k - *i > MAX_DIGITS) return false;
  *width = (int)(k - *i);
  *v = x;
  *i = k;
  return true;
}

/* check_group validates the group list[b..e) (the text between '[' and ']') and adds its number
 * of hosts to *count. */
static td_status check_group(const char *list, size_t b, size_t e, size_t *count) {
  size_t i = b, total = 0;
  if (b == e) return list_error(list, b, "empty brackets");
  for (;;) {
    unsigned long lo, hi;
    int w;
    if (!parse_num(list, &i, e, &lo, &w))
      return list_error(list, i, "expected a number of at most 9 digits inside brackets");
    hi = lo;
    if (i < e && list[i] == '-') {
      i++;
      if (!parse_num(list, &i, e, &hi, &w))
        return list_error(list, i, "expected the upper bound of a range");
      if (hi < lo) return list_error(list, i, "reversed range (upper bound below lower)");
    }
    if (hi - lo >= TD__SLURM_MAX_HOSTS || total + (hi - lo + 1) > TD__SLURM_MAX_HOSTS)
      return list_error(list, i, "list expands to more than 65536 hosts");
    total += hi - lo + 1;
    if (i == e) break;
    if (list[i] != ',') return list_error(list, i, "unexpected character inside brackets");
    i++;
    if (i == e) return list_error(list, i, "empty element inside brackets");
  }
  *count = total;
  return TD_OK;
}

/* check_item validates the item list[b..e) and returns its number of hosts in *count. */
static td_status check_item(const char *list, size_t b, size_t e, size_t *count) {
  size_t total = 1, i = b, groups = 0;
  if (b == e) return list_error(list, b, "empty host name");
  while (i < e) {
    char c = list[i];
    if (c == ']') return list_error(list, i, "unbalanced ']'");
    if ((unsigned char)c <= ' ' || c == 0x7f) return list_error(list, i, "space or control character");
    if (c != '[') {
      i++;
      continue;
    }
    size_t close = i + 1;
    while (close < e && list[close] != ']' && list[close] != '[') close++;
    if (close == e) return list_error(list, i, "unbalanced '['");
    if (list[close] == '[') return list_error(list, close, "nested '['");
    if (++groups > MAX_GROUPS) return list_error(list, i, "more than 8 bracket groups in one name");
    size_t g = 0;
    td_status st = check_group(list, i + 1, close, &g);
    if (st != TD_OK) return st;
    if (g > TD__SLURM_MAX_HOSTS / total) return list_error(list, i, "list expands to more than 65536 hosts");
    total *= g;
    i = close + 1;
  }
  *count = total;
  return TD_OK;
}

/* item_end returns the end of the item starting at b: the next ',' outside brackets, or the end
 * of the list. Bracket errors are left to check_item. */
static size_t item_end(const char *list, size_t b) {
  bool in = false;
  size_t i = b;
  for (; list[i]; i++) {
    if (list[i] == '[') in = true;
    else if (list[i] == ']') in = false;
    else if (list[i] == ',' && !in) break;
  }
  return i;
}

/* check_list validates the whole list and counts its hosts. */
static td_status check_list(const char *list, size_t *count) {
  if (!list || !*list) return td_set_error(TD_ERR_INVALID, "slurm node list is empty or unset");
  size_t total = 0, b = 0;
  for (;;) {
    size_t e = item_end(list, b), c = 0;
    td_status st = check_item(list, b, e, &c);
    if (st != TD_OK) return st;
    if (total + c > TD__SLURM_MAX_HOSTS) return list_error(list, b, "list expands to more than 65536 hosts");
    total += c;
    if (!list[e]) break;
    b = e + 1;
    if (!list[b]) return list_error(list, b, "empty host name after ','");
  }
  *count = total;
  return TD_OK;
}

typedef struct sink {
  char **hosts; /* cap entries */
  size_t n, cap;
} sink;

/* gen writes the hosts of list[i..e) (a checked item) after the prefix buf[0..blen), stopping
 * once the sink is full. */
static td_status gen(const char *list, size_t i, size_t e, char *buf, size_t blen, sink *s) {
  while (i < e && list[i] != '[') {
    if (blen + 1 >= TD__SLURM_MAX_NAME) return list_error(list, i, "host name longer than 255 bytes");
    buf[blen++] = list[i++];
  }
  if (i == e) {
    char *h = malloc(blen + 1);
    if (!h) return td_set_error(TD_ERR_NOMEM, "slurm node list: out of memory");
    memcpy(h, buf, blen);
    h[blen] = '\0';
    s->hosts[s->n++] = h;
    return TD_OK;
  }
  size_t close = i + 1;
  while (list[close] != ']') close++;
  size_t j = i + 1;
  while (j < close && s->n < s->cap) {
    unsigned long lo = 0, hi, v;
    int w = 0, w2 = 0;
    parse_num(list, &j, close, &lo, &w);
    hi = lo;
    if (list[j] == '-') {
      j++;
      parse_num(list, &j, close, &hi, &w2);
    }
    if (list[j] == ',') j++;
    for (v = lo; v <= hi && s->n < s->cap; v++) {
      int k = snprintf(buf + blen, TD__SLURM_MAX_NAME - blen, "%0*lu", w, v);
      if (k < 0 || (size_t)k >= TD__SLURM_MAX_NAME - blen)
        return list_error(list, i, "host name longer than 255 bytes");
      td_status st = gen(list, close + 1, e, buf, blen + (size_t)k, s);
      if (st != TD_OK) return st;
    }
  }
  return TD_OK;
}

/* expand fills s (capacity s->cap, at most count) from the checked list. */
static td_status expand(const char *list, sink *s) {
  char buf[TD__SLURM_MAX_NAME];
  size_t b = 0;
  while (s->n < s->cap) {
    size_t e = item_end(list, b);
    td_status st = gen(list, b, e, buf, 0, s);
    if (st != TD_OK) return st;
    if (!list[e]) break;
    b = e + 1;
  }
  return TD_OK;
}

void td__slurm_hosts_free(char **hosts, size_t n) {
  if (!hosts) return;
  for (size_t i = 0; i < n; i++) free(hosts[i]);
  free(hosts);
}

td_status td__slurm_expand(const char *list, char ***hosts, size_t *n) {
  if (!hosts || !n) return td_set_error(TD_ERR_INVALID, "slurm_expand: NULL output");
  size_t count;
  td_status st = check_list(list, &count);
  if (st != TD_OK) return st;
  sink s = {calloc(count, sizeof(char *)), 0, count};
  if (!s.hosts) return td_set_error(TD_ERR_NOMEM, "slurm node list: out of memory");
  st = expand(list, &s);
  if (st != TD_OK) {
    td__slurm_hosts_free(s.hosts, s.n);
    return st;
  }
  *hosts = s.hosts;
  *n = s.n;
  return TD_OK;
}

td_status td__slurm_first_host(const char *list, char *out, size_t n) {
  if (!out || n == 0) return td_set_error(TD_ERR_INVALID, "slurm_first_host: NULL output");
  size_t count;
  td_status st = check_list(list, &count);
  if (st != TD_OK) return st;
  char *first = NULL;
  sink s = {&first, 0, 1};
  st = expand(list, &s);
  if (st != TD_OK) return st;
  size_t l = strlen(first);
  if (l >= n) {
    free(first);
    return td_set_error(TD_ERR_INVALID, "slurm node list: first host name (%zu bytes) does not fit", l);
  }
  memcpy(out, first, l + 1);
  free(first);
  return TD_OK;
}

/* ---- ports ---- */

td_status td__slurm_port(const char *job_id, int *port) {
  if (!port) return td_set_error(TD_ERR_INVALID, "slurm_port: NULL output");
  if (!job_id || !*job_id) return td_set_error(TD_ERR_INVALID, "SLURM_JOB_ID is empty or unset");
  unsigned long long v = 0;
  for (const char *p = job_id; *p; p++) {
    if (!is_digit(*p) || p - job_id >= 20)
      return td_set_error(TD_ERR_INVALID, "SLURM_JOB_ID '%.64s' is not a job number", job_id);
    v = v * 10 + (unsigned)(*p - '0');
  }
  *port = TD__SLURM_PORT_BASE + (int)(v % TD__SLURM_PORT_SPAN);
  return TD_OK;
}

void td__boot_id(char *out, size_t n) {
  snprintf(out, n, "-");
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (!f) return;
  if (fgets(out, (int)n, f)) out[strcspn(out, "\r\n")] = 0;
  fclose(f);
  if (!out[0] || strchr(out, ' ')) snprintf(out, n, "-");
}

int td__job_port(const char *job_key) {
  uint32_t h = 2166136261u;
  for (const char *p = job_key ? job_key : ""; *p; p++) h = (h ^ (uint8_t)*p) * 16777619u;
  return TD__SLURM_PORT_BASE + (int)(h % TD__SLURM_PORT_SPAN);
}

/* ---- interfaces ---- */

bool td__ifname_spec_valid(const char *spec) {
  if (!spec) return false;
  if (*spec == '^') spec++;
  if (*spec == '=') spec++;
  for (; *spec; spec++)
    if (*spec != ',') return true;
  return false;
}

bool td__ifname_match(const char *spec, const char *ifname) {
  if (!spec || !ifname) return false;
  bool exclude = false, exact = false, any = false, hit = false;
  if (*spec == '^') {
    exclude = true;
    spec++;
  }
  if (*spec == '=') {
    exact = true;
    spec++;
  }
  size_t nl = strlen(ifname);
  while (*spec) {
    const char *c = strchr(spec, ',');
    size_t l = c ? (size_t)(c - spec) : strlen(spec);
    if (l > 0) {
      any = true;
      if (exact ? (l == nl && memcmp(spec, ifname, l) == 0) : strncmp(ifname, spec, l) == 0)
        hit = true;
    }
    spec += l;
    if (*spec == ',') spec++;
  }
  if (!any) return false;
  return exclude ? !hit : hit;
}

td_status td__ifaddr_pick(const char *spec, const td__ifaddr *list, size_t n, int prefer,
                          char *out, size_t n_out, char *ifname, size_t ifname_n) {
  if (!out || (n && !list)) return td_set_error(TD_ERR_INVALID, "ifaddr_pick: NULL argument");
  if (!td__ifname_spec_valid(spec))
    return td_set_error(TD_ERR_INVALID, "TD_SOCKET_IFNAME '%s' names no interface (expected a "
                        "comma list of name prefixes, '^' to exclude, '=' for exact names)",
                        spec ? spec : "");
  int fams[2] = {AF_INET, AF_INET6};
  if (prefer == AF_INET6) {
    fams[0] = AF_INET6;
    fams[1] = AF_INET;
  }
  for (int f = 0; f < 2; f++) {
    for (size_t i = 0; i < n; i++) {
      const td__ifaddr *a = &list[i];
      if (a->family != fams[f] || !a->up || a->link_local || !a->name || !a->addr) continue;
      if (!td__ifname_match(spec, a->name)) continue;
      if (strlen(a->addr) >= n_out || (ifname && strlen(a->name) >= ifname_n))
        return td_set_error(TD_ERR_INVALID, "ifaddr_pick: address '%s' does not fit", a->addr);
      strcpy(out, a->addr);
      if (ifname) strcpy(ifname, a->name);
      return TD_OK;
    }
  }
  char seen[512] = "";
  size_t sl = 0;
  for (size_t i = 0; i < n && sl < sizeof seen - 1; i++) {
    bool dup = false;
    for (size_t j = 0; j < i && !dup; j++) dup = list[j].name && list[i].name && !strcmp(list[j].name, list[i].name);
    if (dup || !list[i].name) continue;
    int k = snprintf(seen + sl, sizeof seen - sl, "%s%s%s", sl ? ", " : "", list[i].name,
                     list[i].up ? "" : " (down)");
    if (k < 0) break;
    sl += (size_t)k;
  }
  return td_set_error(TD_ERR_NOT_FOUND, "TD_SOCKET_IFNAME '%s' selects no interface that is up "
                      "with a usable address (interfaces: %s)", spec, sl ? seen : "none");
}

/* ---- the system's interfaces and routes ---- */

static bool numeric_host(const struct sockaddr *sa, char *out, size_t n) {
  socklen_t len = sa->sa_family == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6);
  return getnameinfo(sa, len, out, (socklen_t)n, NULL, 0, NI_NUMERICHOST) == 0;
}

static bool is_loopback(const struct sockaddr *sa) {
  if (sa->sa_family == AF_INET)
    return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
  if (sa->sa_family == AF_INET6) {
    const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(a)) return true;
    return IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127;
  }
  return false;
}

/* System interface list: names and addresses point into ifa / the strings block. */
typedef struct syslist {
  struct ifaddrs *ifa;
  td__ifaddr *items;
  char (*addrs)[INET6_ADDRSTRLEN + IF_NAMESIZE + 2];
  size_t n;
} syslist;

static void syslist_free(syslist *l) {
  if (l->ifa) freeifaddrs(l->ifa);
  free(l->items);
  free(l->addrs);
}

static td_status syslist_read(syslist *l) {
  memset(l, 0, sizeof *l);
  if (getifaddrs(&l->ifa) != 0)
    return td_set_error(TD_ERR_IO, "listen address: getifaddrs: %s", strerror(errno));
  size_t cap = 0;
  for (struct ifaddrs *p = l->ifa; p; p = p->ifa_next) cap++;
  l->items = calloc(cap ? cap : 1, sizeof *l->items);
  l->addrs = calloc(cap ? cap : 1, sizeof *l->addrs);
  if (!l->items || !l->addrs) {
    syslist_free(l);
    return td_set_error(TD_ERR_NOMEM, "listen address: out of memory");
  }
  for (struct ifaddrs *p = l->ifa; p; p = p->ifa_next) {
    if (!p->ifa_addr || (p->ifa_addr->sa_family != AF_INET && p->ifa_addr->sa_family != AF_INET6))
      continue;
    if (!numeric_host(p->ifa_addr, l->addrs[l->n], sizeof l->addrs[l->n])) continue;
    td__ifaddr *it = &l->items[l->n];
    it->name = p->ifa_name;
    it->family = p->ifa_addr->sa_family;
    it->addr = l->addrs[l->n];
    it->up = (p->ifa_flags & IFF_UP) != 0;
    it->loopback = (p->ifa_flags & IFF_LOOPBACK) != 0;
    it->link_local = it->family == AF_INET6 &&
                     IN6_IS_ADDR_LINKLOCAL(&((struct sockaddr_in6 *)p->ifa_addr)->sin6_addr);
    l->n++;
  }
  return TD_OK;
}

/* ifname_of finds the interface holding numeric address addr (for the log); "?" if none. */
static void ifname_of(const char *addr, char *out, size_t n) {
  snprintf(out, n, "?");
  syslist l;
  if (syslist_read(&l) != TD_OK) return;
  for (size_t i = 0; i < l.n; i++)
    if (strcmp(l.items[i].addr, addr) == 0) {
      snprintf(out, n, "%s", l.items[i].name);
      break;
    }
  syslist_free(&l);
}

static td_status put(const char *addr, char *out, size_t n) {
  size_t l = strlen(addr);
  if (l >= n) return td_set_error(TD_ERR_INVALID, "listen address '%s' does not fit in %zu bytes", addr, n);
  memcpy(out, addr, l + 1);
  return TD_OK;
}

/* route_source finds the local address of the route toward ai: a connected UDP socket has a
 * source address as soon as connect() returns; nothing is sent. */
static bool route_source(const struct addrinfo *ai, char *out, size_t n) {
  struct sockaddr_storage dst, src;
  if (ai->ai_addrlen > sizeof dst) return false;
  memcpy(&dst, ai->ai_addr, ai->ai_addrlen);
  if (dst.ss_family == AF_INET) ((struct sockaddr_in *)&dst)->sin_port = htons(9);
  else ((struct sockaddr_in6 *)&dst)->sin6_port = htons(9);
  int fd = socket(dst.ss_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  socklen_t sl = sizeof src;
  bool ok = connect(fd, (struct sockaddr *)&dst, ai->ai_addrlen) == 0 &&
            getsockname(fd, (struct sockaddr *)&src, &sl) == 0 &&
            numeric_host((struct sockaddr *)&src, out, n);
  close(fd);
  return ok;
}

td_status td__choose_address(const char *master_addr, const char *ifname_spec, char *out,
                             size_t n) {
  if (!out || n == 0) return td_set_error(TD_ERR_INVALID, "choose_address: NULL output");
  struct in6_addr tmp;
  int fam = AF_UNSPEC;
  if (master_addr && inet_pton(AF_INET6, master_addr, &tmp) == 1) fam = AF_INET6;
  else if (master_addr && inet_pton(AF_INET, master_addr, &tmp) == 1) fam = AF_INET;

  if (ifname_spec && *ifname_spec) {
    syslist l;
    td_status st = syslist_read(&l);
    if (st != TD_OK) return st;
    char addr[sizeof l.addrs[0]], name[IF_NAMESIZE + 1];
    st = td__ifaddr_pick(ifname_spec, l.items, l.n, fam, addr, sizeof addr, name, sizeof name);
    syslist_free(&l);
    if (st != TD_OK) return st;
    st = put(addr, out, n);
    if (st == TD_OK)
      td_log(TD_LOG_INFO, "rpc: listen address %s (interface %s, from TD_SOCKET_IFNAME='%s')",
             addr, name, ifname_spec);
    return st;
  }

  if (!master_addr || !*master_addr) {
    td_log(TD_LOG_INFO, "rpc: listen address 127.0.0.1 (no MASTER_ADDR: single host)");
    return put("127.0.0.1", out, n);
  }
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_DGRAM};
  struct addrinfo *res = NULL;
  int gai = getaddrinfo(master_addr, NULL, &hints, &res);
  if (gai != 0) {
    td_log(TD_LOG_WARN, "rpc: cannot resolve MASTER_ADDR '%s' (%s); listening on 127.0.0.1",
           master_addr, gai_strerror(gai));
    return put("127.0.0.1", out, n);
  }
  char addr[INET6_ADDRSTRLEN + IF_NAMESIZE + 2];
  const char *why = NULL;
  for (struct addrinfo *p = res; p && !why; p = p->ai_next) {
    if (is_loopback(p->ai_addr)) {
      snprintf(addr, sizeof addr, "%s", p->ai_family == AF_INET6 &&
               IN6_IS_ADDR_LOOPBACK(&((struct sockaddr_in6 *)p->ai_addr)->sin6_addr) ? "::1"
               : "127.0.0.1");
      why = "MASTER_ADDR %s is loopback (single host)";
    } else if (route_source(p, addr, sizeof addr)) {
      why = "route toward MASTER_ADDR %s";
    }
  }
  freeaddrinfo(res);
  if (!why) {
    td_log(TD_LOG_WARN, "rpc: no route toward MASTER_ADDR '%s'; listening on 127.0.0.1",
           master_addr);
    return put("127.0.0.1", out, n);
  }
  char name[IF_NAMESIZE + 1];
  ifname_of(addr, name, sizeof name);
  td_status st = put(addr, out, n);
  if (st == TD_OK) {
    char reason[400];
    snprintf(reason, sizeof reason, why, master_addr); /* why is one of two literals above */
    td_log(TD_LOG_INFO, "rpc: listen address %s (interface %s): %s", addr, name, reason);
  }
  return st;
}

void td__addr_host(const char *addr, char *out, size_t n) {
  const char *b = addr, *e;
  if (*b == '[') {
    b++;
    e = strchr(b, ']');
  } else {
    e = strrchr(b, ':');
  }
  size_t len = e ? (size_t)(e - b) : strlen(b);
  if (len >= n) len = n - 1;
  memcpy(out, b, len);
  out[len] = 0;
}
