/* samehost.c - the same-host record and probe (samehost.h). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* process_vm_readv */
#endif
#include "samehost.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/random.h>
#include <sys/uio.h>
#endif

#include "core.h"
#include "netaddr.h"

uint64_t td__samehost_nonce(const void *salt) {
  uint64_t v = 0;
#if defined(__linux__)
  if (getrandom(&v, sizeof v, 0) == (ssize_t)sizeof v && v) return v;
#endif
  return td__now_ns() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)salt;
}

/* The pid namespace ("pid:[4026531836]"), or false. */
static bool pid_namespace(char *buf, size_t n) {
#if defined(__linux__)
  ssize_t k = readlink("/proc/self/ns/pid", buf, n - 1);
  if (k <= 0) return false;
  buf[k] = 0;
  return strchr(buf, ' ') == NULL;
#else
  (void)buf;
  (void)n;
  return false;
#endif
}

bool td__samehost_record(const char *host, const uint64_t *nonce, char *buf, size_t n) {
  char bid[64], ns[64];
  td__boot_id(bid, sizeof bid);
  if (strcmp(bid, "-") == 0 || strchr(bid, ' ') || !pid_namespace(ns, sizeof ns) || !host ||
      !*host || strchr(host, ' ')) {
    snprintf(buf, n, "-");
    return false;
  }
  int k = snprintf(buf, n, "%d %llu %llu %s %s %s", (int)getpid(), (unsigned long long)*nonce,
                   (unsigned long long)(uintptr_t)nonce, bid, ns, host);
  if (k < 0 || (size_t)k >= n) {
    snprintf(buf, n, "-");
    return false;
  }
  return true;
}

bool td__samehost_parse(const char *rec, td__host_rec *out) {
  unsigned long long nonce = 0, addr = 0;
  memset(out, 0, sizeof *out);
  if (!rec || sscanf(rec, "%d %llu %llu %63s %63s %255s", &out->pid, &nonce, &addr, out->boot,
                     out->pidns, out->host) != 6 || out->pid <= 0)
    return false;
  out->nonce = nonce;
  out->addr = addr;
  return true;
}

bool td__samehost_same(const td__host_rec *a, const td__host_rec *b) {
  return strcmp(a->boot, b->boot) == 0 && strcmp(a->pidns, b->pidns) == 0 &&
         strcmp(a->host, b->host) == 0;
}

bool td__samehost_readable(const td__host_rec *peer) {
#if defined(__linux__)
  uint64_t got = 0;
  struct iovec l = {&got, sizeof got}, r = {(void *)(uintptr_t)peer->addr, sizeof got};
  return process_vm_readv(peer->pid, &l, 1, &r, 1, 0) == (ssize_t)sizeof got &&
         got == peer->nonce;
#else
  (void)peer;
  return false;
#endif
}
